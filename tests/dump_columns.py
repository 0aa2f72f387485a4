"""Test helper: read a dump back as per-sequence Python lists (independent of how the reader batches)."""

from __future__ import annotations

import itertools

import numpy as np

from grpo_cli.io import RolloutDataset

TOKEN_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "loss_mask", "versions", "advantages")
SEQUENCE_COLUMNS = ("rewards", "current_version", "step", "group_id", "seq_id")


def read_columns(source, batch_tokens: int = 7) -> dict[str, list]:
    """Every column of a dump (a directory, a file or an open RolloutDataset) as per-sequence lists.

    ``lengths`` holds each sequence's token count and ``columns`` the sorted canonical columns present.
    """
    ds = source if isinstance(source, RolloutDataset) else RolloutDataset([source])
    out: dict[str, list] = {"lengths": []}
    for batch in ds.iter_batches(batch_tokens=batch_tokens):
        bounds = list(itertools.pairwise(batch.cu_seqlens.tolist()))
        out["lengths"] += [b - a for a, b in bounds]
        for name in TOKEN_COLUMNS:
            values = getattr(batch, name)
            if values is not None:
                out.setdefault(name, []).extend(values[a:b].tolist() for a, b in bounds)
        for name in SEQUENCE_COLUMNS:
            values = getattr(batch, name)
            if values is not None:
                out.setdefault(name, []).extend(values.tolist())
    out["columns"] = sorted(ds.columns)
    return out


def f32(values) -> list[float]:
    """Values as float32 stores them (what the reader returns for float32 columns), as Python floats."""
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()


def f32s(rows) -> list[list[float]]:
    return [f32(row) for row in rows]
