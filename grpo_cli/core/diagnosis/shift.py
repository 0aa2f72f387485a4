"""The **shift** family: does ``old_logp`` sit one token late or early against ``new_logp``?

Mean |new_t − old_(t+s)| for s ∈ {−1, 0, +1} over pairs of loss-mask tokens of the same sequence; per
sequence, the best shift and a table of the sequences that agree best at s ≠ 0."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import TOP_FIELDS, as_float, counts_by, sums_by, table_rows, update_top
from grpo_cli.core.packing import segment_ids
from grpo_cli.core.state import MetricState, count, top_rows, total

__all__ = ["MIN_SEQ_PAIRS", "SHIFT_FLOOR", "SHIFT_PREFERENCE", "shift_compute", "shift_state", "shift_update"]

MIN_SEQ_PAIRS = 3
"""A sequence takes part in a per-sequence shift decision only with at least this many token pairs per shift."""
SHIFT_PREFERENCE = 0.5
"""A sequence prefers shift s ≠ 0 when its mean |new − old_s| is below this fraction of the shift-0 mean."""
SHIFT_FLOOR = 0.02
"""…and its shift-0 mean is above this (nats): sequences whose columns already agree prefer nothing."""


def shift_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`shift_update`."""
    specs = {"n_seq": count(), "n_seq_late": count(), "n_seq_early": count(), "top": top_rows(top_k, len(TOP_FIELDS))}
    for name in ("m1", "0", "p1"):
        specs[f"n_{name}"] = count()
        specs[f"sum_{name}"] = total()
    return MetricState(specs, device)


def _pair_sums(new: Tensor, old: Tensor, valid: Tensor, seq: Tensor, n_seq: int, s: int) -> tuple[Tensor, Tensor]:
    """Per-sequence (Σ|new_t − old_(t+s)|, pair count) over valid pairs within a sequence."""
    if s == 0:
        a, b, ok = new, old, valid
        owner = seq
    elif s > 0:
        a, b = new[:-s], old[s:]
        ok = valid[:-s] & valid[s:] & (seq[:-s] == seq[s:])
        owner = seq[:-s]
    else:
        a, b = new[-s:], old[:s]
        ok = valid[-s:] & valid[:s] & (seq[-s:] == seq[:s])
        owner = seq[-s:]
    diff = torch.where(ok, (a - b).abs(), torch.zeros((), dtype=a.dtype, device=a.device))
    return sums_by(owner, diff, n_seq), counts_by(owner, ok, n_seq)


def shift_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences (all tokens, with the loss mask) into ``state``.

    Args:
        state: from :func:`shift_state`.
        new_logp, old_logp: ``[N]`` per-token log-probs as dumped.
        loss_mask: ``[N]`` bool.
        cu_seqlens: ``[B + 1]`` offsets.
        file_index, rows: the batch's file and the row of each sequence (``top`` locations).
        step: ``[B]`` step per sequence, or ``None``.

    The ``top`` table ranks sequences preferring a shift by the gain ``mean_0 − mean_best`` (nats); its ``value``
    column is the preferred shift (−1 or +1).
    """
    n_seq = cu_seqlens.numel() - 1
    n = new_logp.numel()
    if n == 0 or n_seq == 0:
        return
    new, old = as_float(new_logp), as_float(old_logp)
    valid = loss_mask.to(torch.bool)
    seq = segment_ids(cu_seqlens, n).to(new.device)
    per = {s: _pair_sums(new, old, valid, seq, n_seq, s) for s in (-1, 0, 1)}
    names = {-1: "m1", 0: "0", 1: "p1"}
    state.update(**{f"sum_{names[s]}": per[s][0].sum() for s in per}, **{f"n_{names[s]}": per[s][1].sum() for s in per})
    mean = {s: per[s][0] / per[s][1].clamp_min(1) for s in per}
    enough = (per[-1][1] >= MIN_SEQ_PAIRS) & (per[0][1] >= MIN_SEQ_PAIRS) & (per[1][1] >= MIN_SEQ_PAIRS)
    best_side = torch.minimum(mean[-1], mean[1])
    side = torch.where(mean[1] <= mean[-1], 1.0, -1.0).to(torch.float64)
    prefers = enough & (mean[0] > SHIFT_FLOOR) & (best_side < SHIFT_PREFERENCE * mean[0])
    late = prefers & (side > 0)
    early = prefers & (side < 0)
    state.update(
        n_seq=enough.sum(), n_seq_late=late.sum(), n_seq_early=early.sum(),
    )
    update_top(state, mean[0] - best_side, prefers, side, file_index=file_index, rows=rows, step=step)


def shift_compute(state: MetricState) -> dict[str, Any]:
    """``diag/shift_abs_diff_m1``, ``_0``, ``_p1`` (mean |new − old shifted|), ``diag/shift_best`` (the shift with the
    smallest mean), ``diag/shift_gain`` (shift-0 mean / best mean), ``diag/shift_seq_late_frac`` and
    ``diag/shift_seq_early_frac`` (sequences preferring +1 / −1), ``diag/shift_n_seq`` and ``diag/shift_top``."""
    out: dict[str, Any] = {}
    means = {}
    for s, name in ((-1, "m1"), (0, "0"), (1, "p1")):
        n = int(state[f"n_{name}"])
        if n:
            means[s] = float(state[f"sum_{name}"]) / n
            out[f"diag/shift_abs_diff_{name}"] = means[s]
    if not means or 0 not in means:
        return out
    best = min(means, key=lambda s: (means[s], abs(s)))
    out["diag/shift_best"] = best
    out["diag/shift_gain"] = means[0] / means[best] if means[best] > 0 else (1.0 if means[0] == 0 else math.inf)
    n_seq = int(state["n_seq"])
    out["diag/shift_n_seq"] = n_seq
    if n_seq:
        out["diag/shift_seq_late_frac"] = int(state["n_seq_late"]) / n_seq
        out["diag/shift_seq_early_frac"] = int(state["n_seq_early"]) / n_seq
    out["diag/shift_top"] = table_rows(state["top"])
    return out
