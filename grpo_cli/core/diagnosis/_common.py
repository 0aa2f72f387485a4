"""The plumbing every family of :mod:`grpo_cli.core.diagnosis` shares: the log-prob column names, the
bounded ``top_*`` tables of sequence locations, and dtype handling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["LOGP_COLUMNS", "TOP_FIELDS", "as_float", "locations", "table_rows", "top_table"]

LOGP_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp")
TOP_FIELDS = ("score", "file", "row", "step", "value")
"""Columns of every ``top_*`` table: the ranking score, the sequence's file index and row, its step (NaN when the
dump has none) and one family-specific value (documented per table)."""


def as_float(x: Tensor) -> Tensor:
    """``x`` as float32 when it is a half type (bf16, fp16), else unchanged (no copy)."""
    return x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x


def locations(file_index: int, rows: Tensor | None, n_seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """float64 (file, row) columns of a batch's sequences (rows 0 … n_seq − 1 when ``rows`` is ``None``)."""
    row = rows.to(device=device, dtype=torch.float64) if rows is not None else torch.arange(
        n_seq, device=device, dtype=torch.float64
    )
    return torch.full((n_seq,), float(file_index), dtype=torch.float64, device=device), row


def top_table(score: Tensor, keep: Tensor, file: Tensor, row: Tensor, step: Tensor | None, value: Tensor) -> Tensor:
    """Rows ``[score, file, row, step, value]`` of the sequences where ``keep``."""
    n = score.numel()
    step_col = step.to(torch.float64) if step is not None else torch.full((n,), math.nan, dtype=torch.float64)
    rows = torch.stack(
        [score.to(torch.float64), file, row, step_col.to(score.device), value.to(torch.float64)], dim=1
    )
    return rows[keep]


def table_rows(table: Tensor) -> list[dict[str, Any]]:
    """The filled rows of a ``top_*`` table as dicts of :data:`TOP_FIELDS` (``step`` ``None`` when unknown)."""
    out = []
    for r in table.tolist():
        if r[0] == -math.inf:
            continue
        out.append({
            "score": r[0], "file": int(r[1]), "row": int(r[2]),
            "step": None if math.isnan(r[3]) else int(r[3]), "value": r[4],
        })
    return out
