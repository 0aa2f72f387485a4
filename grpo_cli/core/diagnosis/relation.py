"""The **relation** family: how ``old_logp`` relates to ``new_logp`` (a temperature tilts the line,
top-p/top-k renormalisation lifts ``old``), over valid tokens and per sequence."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import TOP_FIELDS, as_float, counts_by, sums_by, table_rows, update_top
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids
from grpo_cli.core.state import MetricState, count, top_rows, total

__all__ = ["ONESIDED_FRAC", "ONESIDED_MIN_TOKENS", "relation_compute", "relation_state", "relation_update"]


def relation_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`relation_update`."""
    specs = {name: total() for name in ("sx", "sy", "sxx", "sxy", "syy", "sd", "seq_sd", "seq_sdd")}
    specs.update(n=count(), n_gt=count(), n_lt=count(), n_seq=count(), n_seq_long=count(), n_seq_onesided=count())
    specs["top"] = top_rows(top_k, len(TOP_FIELDS))
    return MetricState(specs, device)


ONESIDED_MIN_TOKENS = 8
"""A sequence is tested for one-sidedness only with at least this many valid tokens."""
ONESIDED_FRAC = 0.95
"""…and is one-sided when at least this fraction of them have old > new (a healthy sequence: about half)."""


def relation_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    cu_seqlens: Tensor,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of **valid tokens** (compacted by the loss mask) into ``state``.

    Args:
        state: from :func:`relation_state`.
        new_logp, old_logp: ``[N]`` valid-token log-probs as dumped (x = new, y = old).
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        file_index, rows, step: locations of the sequences for the ``top`` table, which ranks sequences by their
            mean d = old − new (``value``: their valid-token count).
    """
    n = new_logp.numel()
    if n == 0:
        return
    x = as_float(new_logp).to(torch.float64)
    y = as_float(old_logp).to(torch.float64)
    d = y - x
    state.update(
        n=torch.tensor(n), sx=x.sum(), sy=y.sum(), sxx=(x * x).sum(), sxy=(x * y).sum(), syy=(y * y).sum(),
        sd=d.sum(), n_gt=(y > x).sum(), n_lt=(y < x).sum(),
    )
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(x.device)
    seq = segment_ids(cu_seqlens, n).to(x.device)
    n_seq = lengths.numel()
    sums = sums_by(seq, d, n_seq)
    has = lengths > 0
    seq_mean = sums / lengths.clamp_min(1)
    state.update(n_seq=has.sum(), seq_sd=seq_mean[has].sum(), seq_sdd=(seq_mean[has] ** 2).sum())
    gt = counts_by(seq, y > x, n_seq)
    long = lengths >= ONESIDED_MIN_TOKENS
    onesided = long & (gt >= ONESIDED_FRAC * lengths)
    state.update(n_seq_long=long.sum(), n_seq_onesided=onesided.sum())
    update_top(state, seq_mean, has, lengths, file_index=file_index, rows=rows, step=step)


def relation_compute(state: MetricState) -> dict[str, Any]:
    """``diag/old_vs_new_slope`` b and ``diag/old_vs_new_intercept`` a of old ≈ a + b·new (absent when new is
    constant), ``diag/old_gt_new_frac``, ``diag/old_lt_new_frac``, ``diag/old_minus_new_mean`` (token mean of
    d = old − new), ``diag/seq_old_minus_new_mean`` and ``diag/seq_old_minus_new_ci`` (mean over sequences of the
    per-sequence mean d and the half-width of its 95 % normal interval, 1.96·sd/√n_seq), ``diag/relation_n_seq``,
    ``diag/onesided_seq_frac`` (sequences of ≥ ONESIDED_MIN_TOKENS valid tokens with old > new on ≥ ONESIDED_FRAC
    of them) and ``diag/old_minus_new_top`` (the sequences with the largest mean d)."""
    n = int(state["n"])
    if n == 0:
        return {}
    mx, my = float(state["sx"]) / n, float(state["sy"]) / n
    vx = float(state["sxx"]) / n - mx * mx
    cxy = float(state["sxy"]) / n - mx * my
    out: dict[str, Any] = {
        "diag/old_gt_new_frac": int(state["n_gt"]) / n,
        "diag/old_lt_new_frac": int(state["n_lt"]) / n,
        "diag/old_minus_new_mean": float(state["sd"]) / n,
    }
    if vx > 1e-12 * max(1.0, mx * mx):
        b = cxy / vx
        out["diag/old_vs_new_slope"] = b
        out["diag/old_vs_new_intercept"] = my - b * mx
    n_seq = int(state["n_seq"])
    out["diag/relation_n_seq"] = n_seq
    if n_seq:
        m = float(state["seq_sd"]) / n_seq
        var = max(float(state["seq_sdd"]) / n_seq - m * m, 0.0)
        out["diag/seq_old_minus_new_mean"] = m
        out["diag/seq_old_minus_new_ci"] = 1.96 * math.sqrt(var / n_seq) if n_seq > 1 else math.inf
    if int(state["n_seq_long"]):
        out["diag/onesided_seq_frac"] = int(state["n_seq_onesided"]) / int(state["n_seq_long"])
    out["diag/old_minus_new_top"] = table_rows(state["top"])
    return out
