"""The plumbing every family of :mod:`grpo_cli.core.diagnosis` shares: the log-prob column names, the
bounded ``top_*`` tables of sequence locations, and dtype handling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli._intervals import jackknife_interval
from grpo_cli.core.state import MetricState

__all__ = [
    "LOGP_COLUMNS",
    "TOP_FIELDS",
    "as_float",
    "counts_by",
    "jackknife",
    "key_sums",
    "locations",
    "sums_by",
    "table_rows",
    "top_table",
    "update_top",
]

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


def update_top(
    state: MetricState,
    score: Tensor,
    keep: Tensor,
    value: Tensor,
    *,
    file_index: int,
    rows: Tensor | None,
    step: Tensor | None,
) -> None:
    """Offer the sequences where ``keep`` to ``state``'s bounded ``top`` table, ranked by ``score`` (one per
    sequence), with their locations and a family-specific ``value``."""
    file, row = locations(file_index, rows, score.numel(), score.device)
    state.update(top=top_table(score, keep, file, row, step, value))


def sums_by(index: Tensor, values: Tensor, n: int) -> Tensor:
    """float64 Σ ``values`` per segment: ``out[j]`` sums the tokens with ``index == j`` (``index``: a sequence or key
    index per token, ``0 ≤ index < n``)."""
    return torch.zeros(n, dtype=torch.float64, device=index.device).index_add_(0, index, values.to(torch.float64))


def counts_by(index: Tensor, mask: Tensor, n: int) -> Tensor:
    """int64 count of the ``mask`` tokens per segment (``index`` as in :func:`sums_by`)."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(0, index, mask.to(torch.int64))


def key_sums(values: Tensor, key_of_seq: Tensor, cu_seqlens: Tensor, n_keys: int) -> Tensor:
    """float64 ``[C, n_keys]``: each row of ``values`` (``[C, N]`` float64 over packed tokens) summed over the tokens
    of the sequences of each key (``key_of_seq``: ``[B]`` in ``[0, n_keys)``).

    Each sum adds its tokens in token order, as :func:`sums_by` (``index_add_``) does, so the bits are the same; when
    the keys come in runs (a dump written step by step) a segmented reduction over the runs does it several times
    faster.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=values.device, dtype=torch.int64)
    if n_keys == 1 or bool((key_of_seq[1:] >= key_of_seq[:-1]).all()):
        run = torch.zeros(n_keys, dtype=torch.int64, device=values.device).index_add_(0, key_of_seq, lengths)
        return torch.segment_reduce(values, "sum", lengths=run.expand(values.shape[0], n_keys), axis=1, unsafe=True)
    key_of_token = torch.repeat_interleave(key_of_seq, lengths, output_size=values.shape[1])
    # a 1-D index_add_ per row: index_add_ along dim 1 scatters through an expanded index, slower with many keys
    return torch.stack([sums_by(key_of_token, row, n_keys) for row in values])


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


# -- uncertainty ------------------------------------------------------------------------------------------------------
def jackknife(stat: Any, blocks: Tensor) -> tuple[float, float, float]:
    """A statistic of summed quantities and its delete-a-block jackknife 95 % interval.

    Args:
        stat: maps a ``[m]`` float64 vector of totals to a float (NaN where undefined).
        blocks: ``[K, m]`` the same quantities summed per block of sequences (a hash of the sequence's GRPO group, so
            correlated samples of one prompt share a block; see :func:`grpo_cli.engine.blocks.block_keys`).

    Returns:
        ``(value, low, high)``: ``stat`` of the totals, ± t(g − 1)·se with the delete-a-group jackknife
        variance (g − 1)/g · Σ (θ_(k) − θ_(·))² over the g non-empty blocks (Efron & Stein 1981). The interval is
        (−∞, ∞) with fewer than two usable blocks: no spread can be estimated.
    """
    blocks = blocks.to(torch.float64).cpu()
    total = blocks.sum(0)
    value = float(stat(total))
    loo = []
    for k in range(blocks.shape[0]):
        if bool((blocks[k] != 0).any()):
            theta = float(stat(total - blocks[k]))
            if math.isfinite(theta):
                loo.append(theta)
    return (value, *jackknife_interval(value, loo))
