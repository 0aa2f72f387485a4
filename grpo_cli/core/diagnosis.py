"""Statistics for the findings layer (``diag/*`` keys) as a functional core: ``*_state`` / ``*_update`` / ``*_compute``.

Each family answers one question a detector (:mod:`grpo_cli.findings.detect`) asks of a dump, from a
:class:`~grpo_cli.core.state.MetricState` (int64 counts, float64 sums, min/max, bounded top-k tables) or a
:class:`~grpo_cli.core.keyed_state.KeyedState` (one row per key), so every figure merges across batches, workers and
ranks and does not depend on batching (float64 sums up to summation order). Log-probs are used **as dumped** (no
``--temperature`` rescaling: the temperature test needs the raw values).

Families (inputs are whole packed sequences, the loss mask included, unless said otherwise):

- **shift** (:func:`shift_update`): mean |new_t − old_(t+s)| for s ∈ {−1, 0, +1} over pairs of loss-mask tokens of
  the same sequence. s = +1 compares a token's ``new_logp`` with the *next* slot's ``old_logp``, which is where the
  value sits when ``old_logp`` was written one token late. Per sequence: the best shift and a table of the sequences
  that agree best at s ≠ 0.
- **relation** (:func:`relation_update`): the least-squares line old ≈ a + b·new over valid tokens (sums of x, y,
  xx, xy, yy), the fraction of tokens with old > new, and per-sequence means of d = old − new (with their spread,
  for a confidence bound). A temperature on one side tilts the line (b ≠ 1); top-p/top-k renormalisation lifts
  ``old`` on nearly every token (old > new, a > 0, b ≈ 1).
- **zeros** (:func:`zeros_update`): valid tokens whose log-prob is exactly 0 per column, ``old_logp`` = 0 where
  ``new_logp`` is clearly below 0 (an engine that returned no log-prob), trailing runs of exact zeros (padding), and
  with ``versions``: prompt tokens (version < 0) in the loss and generated tokens (version ≥ 0) left out of it.
- **equality** (:func:`equality_update`): valid tokens where two log-prob columns are bitwise equal, per pair.
- **duplicates** (:func:`duplicates_update`): keyed tables of sequence content hashes and of (step, seq_id) keys.
- **groups** (:func:`groups_update`): per GRPO group (step, group_id), sums of reward r and sequence advantage A
  (the mean over the sequence's valid tokens): sign, centring and scale of A against r.
- **by_step** (:func:`by_step_update`): per training step, |new − old| overall and at lag 0, NeMo RL's multiplicative
  probability error exp(|new − old|) at lag 0, entropy (or −new as its proxy), and EOS counts.
- **lags** (:func:`lags_update`): per lag bin, |new − old| and the error of AReaL's log-linear proximal
  approximation ``old + α(new − old)``, α = (k − 1)/k, against the dumped (recomputed) ``prox_logp``; lag-0 figures.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids
from grpo_cli.core.prox import broadcast_current_version
from grpo_cli.core.state import MetricState, Reduce, count, maximum, top_rows, total

__all__ = [
    "LOGP_COLUMNS",
    "MAX_DIAG_LAG",
    "MIN_SEQ_PAIRS",
    "SHIFT_PREFERENCE",
    "TOP_FIELDS",
    "ZERO_GAP",
    "by_step_compute",
    "by_step_state",
    "by_step_update",
    "diagnosis_compute",
    "diagnosis_state",
    "diagnosis_update",
    "duplicates_compute",
    "duplicates_state",
    "duplicates_update",
    "equality_compute",
    "equality_state",
    "equality_update",
    "groups_compute",
    "groups_state",
    "groups_update",
    "lags_compute",
    "lags_state",
    "lags_update",
    "relation_compute",
    "relation_state",
    "relation_update",
    "sequence_hash",
    "shift_compute",
    "shift_state",
    "shift_update",
    "zeros_compute",
    "zeros_state",
    "zeros_update",
]

LOGP_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp")
TOP_FIELDS = ("score", "file", "row", "step", "value")
"""Columns of every ``top_*`` table: the ranking score, the sequence's file index and row, its step (NaN when the
dump has none) and one family-specific value (documented per table)."""
MIN_SEQ_PAIRS = 3
"""A sequence takes part in a per-sequence shift decision only with at least this many token pairs per shift."""
SHIFT_PREFERENCE = 0.5
"""A sequence prefers shift s ≠ 0 when its mean |new − old_s| is below this fraction of the shift-0 mean."""
SHIFT_FLOOR = 0.02
"""…and its shift-0 mean is above this (nats): sequences whose columns already agree prefer nothing."""
ZERO_GAP = 1.0
"""``old_logp`` = 0 counts as "no log-prob returned" where ``new_logp`` < −ZERO_GAP (trainer probability < e⁻¹).
An engine that renormalises over a top-p/top-k set legitimately reports 0 when the set holds one token, whose
probability is then at least top_p; the gap keeps those tokens (top_p ≥ 0.37) out of the count."""
MAX_DIAG_LAG = 32
"""Lags 0 … MAX_DIAG_LAG − 1 get a bin each in :func:`lags_update`; larger lags share one overflow bin."""
_PAIRS = (
    ("new", "old"), ("new", "prox"), ("new", "ref"), ("old", "prox"), ("old", "ref"), ("prox", "ref"),
)
_HASH_P = 2_147_483_647  # 2^31 − 1
_LOC_SCALE = 2.0**32


def _f64(x: Tensor) -> Tensor:
    return x.sum(dtype=torch.float64)


def _float(x: Tensor) -> Tensor:
    return x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x


def _locations(file_index: int, rows: Tensor | None, n_seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
    row = rows.to(device=device, dtype=torch.float64) if rows is not None else torch.arange(
        n_seq, device=device, dtype=torch.float64
    )
    return torch.full((n_seq,), float(file_index), dtype=torch.float64, device=device), row


def _top_table(score: Tensor, keep: Tensor, file: Tensor, row: Tensor, step: Tensor | None, value: Tensor) -> Tensor:
    """Rows ``[score, file, row, step, value]`` of the sequences where ``keep``."""
    n = score.numel()
    step_col = step.to(torch.float64) if step is not None else torch.full((n,), math.nan, dtype=torch.float64)
    rows = torch.stack(
        [score.to(torch.float64), file, row, step_col.to(score.device), value.to(torch.float64)], dim=1
    )
    return rows[keep]


def _table_rows(table: Tensor) -> list[dict[str, Any]]:
    out = []
    for r in table.tolist():
        if r[0] == -math.inf:
            continue
        out.append({
            "score": r[0], "file": int(r[1]), "row": int(r[2]),
            "step": None if math.isnan(r[3]) else int(r[3]), "value": r[4],
        })
    return out


# -- shift -----------------------------------------------------------------------------------------------------------
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
    diff = torch.where(ok, (a - b).abs(), torch.zeros((), dtype=a.dtype, device=a.device)).to(torch.float64)
    sums = torch.zeros(n_seq, dtype=torch.float64, device=new.device).index_add_(0, owner, diff)
    counts = torch.zeros(n_seq, dtype=torch.int64, device=new.device).index_add_(0, owner, ok.to(torch.int64))
    return sums, counts


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
    new, old = _float(new_logp), _float(old_logp)
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
    file, row = _locations(file_index, rows, n_seq, new.device)
    state.update(top=_top_table(mean[0] - best_side, prefers, file, row, step, side))


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
    out["diag/shift_top"] = _table_rows(state["top"])
    return out


# -- relation of old to new ------------------------------------------------------------------------------------------
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
    x = _float(new_logp).to(torch.float64)
    y = _float(old_logp).to(torch.float64)
    d = y - x
    state.update(
        n=torch.tensor(n), sx=x.sum(), sy=y.sum(), sxx=(x * x).sum(), sxy=(x * y).sum(), syy=(y * y).sum(),
        sd=d.sum(), n_gt=(y > x).sum(), n_lt=(y < x).sum(),
    )
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(x.device)
    seq = segment_ids(cu_seqlens, n).to(x.device)
    n_seq = lengths.numel()
    sums = torch.zeros(n_seq, dtype=torch.float64, device=x.device).index_add_(0, seq, d)
    has = lengths > 0
    seq_mean = sums / lengths.clamp_min(1)
    state.update(n_seq=has.sum(), seq_sd=seq_mean[has].sum(), seq_sdd=(seq_mean[has] ** 2).sum())
    gt = torch.zeros(n_seq, dtype=torch.int64, device=x.device).index_add_(0, seq, (y > x).to(torch.int64))
    long = lengths >= ONESIDED_MIN_TOKENS
    onesided = long & (gt >= ONESIDED_FRAC * lengths)
    state.update(n_seq_long=long.sum(), n_seq_onesided=onesided.sum())
    file, row = _locations(file_index, rows, n_seq, x.device)
    state.update(top=_top_table(seq_mean, has, file, row, step, lengths))


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
    out["diag/old_minus_new_top"] = _table_rows(state["top"])
    return out


# -- exact zeros and mask coverage -----------------------------------------------------------------------------------
def zeros_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`zeros_update`."""
    specs = {f"n_zero_{c}": count() for c in LOGP_COLUMNS}
    specs.update({f"n_{c}": count() for c in LOGP_COLUMNS})
    for name in (
        "n_valid", "n_old_zero_new_not", "n_seq", "n_seq_trailing", "n_tok_trailing", "n_versions_valid",
        "n_prompt_in_loss", "n_generated", "n_generated_masked", "n_holes", "n_holes_generated", "n_seq_suspect",
    ):
        specs[name] = count()
    specs["top"] = top_rows(top_k, len(TOP_FIELDS))
    return MetricState(specs, device)


def zeros_update(
    state: MetricState,
    *,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    columns: dict[str, Tensor | None],
    versions: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences (all tokens) into ``state``.

    Args:
        state: from :func:`zeros_state`.
        loss_mask: ``[N]`` bool.
        cu_seqlens: ``[B + 1]`` offsets.
        columns: ``{name: [N] log-probs or None}`` for the names of :data:`LOGP_COLUMNS` (``new_logp`` required).
        versions: ``[N]`` behaviour version per token (−1 for prompt tokens), or ``None``.
        file_index, rows, step: sequence locations for the ``top`` table, which ranks sequences by their suspicious
            tokens (valid tokens with ``old_logp`` = 0 while ``new_logp`` < −ZERO_GAP, valid tokens in a trailing
            zero run, prompt tokens in the loss, generated tokens out of it); ``value`` = the sequence's valid tokens.

    A trailing zero run is the run of valid tokens at the end of a sequence's valid tokens whose ``new_logp`` (and
    ``old_logp`` when present) are exactly 0; runs of at least 2 tokens count (a single certain last token is
    ordinary).
    """
    n = loss_mask.numel()
    n_seq = cu_seqlens.numel() - 1
    if n == 0 or n_seq == 0:
        return
    valid = loss_mask.to(torch.bool)
    device = valid.device
    seq = segment_ids(cu_seqlens, n).to(device)
    new = _float(cast(Tensor, columns["new_logp"]))  # required (see Args)
    state.update(n_valid=valid.sum())
    zero_all = valid.clone()
    for name in LOGP_COLUMNS:
        col = columns.get(name)
        if col is None:
            continue
        is_zero = valid & (_float(col) == 0)
        state.update(**{f"n_zero_{name}": is_zero.sum(), f"n_{name}": valid.sum()})
        if name in ("new_logp", "old_logp"):
            zero_all &= _float(col) == 0
    suspect = torch.zeros(n, dtype=torch.bool, device=device)
    old = columns.get("old_logp")
    if old is not None:
        gap = valid & (_float(old) == 0) & (new < -ZERO_GAP)
        state.update(n_old_zero_new_not=gap.sum())
        suspect |= gap
    # trailing zero runs: the valid zero tokens after a sequence's last valid non-zero token
    n_valid_seq = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, valid.to(torch.int64))
    idx = torch.arange(n, device=device)
    last_valid = torch.full((n_seq,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, seq, torch.where(valid, idx, -1), reduce="amax"
    )
    breaker = valid & ~zero_all
    last_breaker = torch.full((n_seq,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, seq, torch.where(breaker, idx, -1), reduce="amax"
    )
    in_run = valid & zero_all & (idx > last_breaker.index_select(0, seq))
    run_len = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, in_run.to(torch.int64))
    trailing = (run_len >= 2) & (last_valid >= 0)
    state.update(n_seq=(n_valid_seq > 0).sum(), n_seq_trailing=trailing.sum(), n_tok_trailing=run_len[trailing].sum())
    suspect |= in_run & trailing.index_select(0, seq)
    # holes: masked tokens strictly between a sequence's first and last valid token
    big = torch.iinfo(torch.int64).max
    first_valid = torch.full((n_seq,), big, dtype=torch.int64, device=device).scatter_reduce(
        0, seq, torch.where(valid, idx, big), reduce="amin"
    )
    inside = (idx > first_valid.index_select(0, seq)) & (idx < last_valid.index_select(0, seq))
    hole = inside & ~valid
    state.update(n_holes=hole.sum())
    if versions is not None:
        generated = versions >= 0
        has_valid = (n_valid_seq > 0).index_select(0, seq)
        prompt_in_loss = valid & ~generated
        generated_masked = generated & ~valid & has_valid
        state.update(
            n_versions_valid=valid.sum(), n_prompt_in_loss=prompt_in_loss.sum(),
            n_generated=(generated & has_valid).sum(), n_generated_masked=generated_masked.sum(),
            n_holes_generated=(hole & generated).sum(),
        )
        suspect |= prompt_in_loss | generated_masked
    per_seq = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, suspect.to(torch.int64))
    flagged = per_seq > 0
    state.update(n_seq_suspect=flagged.sum())
    file, row = _locations(file_index, rows, n_seq, device)
    state.update(top=_top_table(per_seq.to(torch.float64), flagged, file, row, step, n_valid_seq))


def zeros_compute(state: MetricState) -> dict[str, Any]:
    """``diag/zero_frac/<column>`` (valid tokens with log-prob exactly 0), ``diag/old_zero_new_nonzero_frac``,
    ``diag/trailing_zero_seq_frac`` and ``diag/trailing_zero_tokens``, ``diag/mask_hole_frac`` (masked tokens inside
    a sequence's response span / valid tokens), with ``versions``: ``diag/prompt_in_loss_frac`` (valid tokens with
    version < 0 / valid tokens), ``diag/generated_masked_frac`` (generated tokens out of the loss / generated tokens
    of sequences with a valid token) and ``diag/mask_hole_generated_frac``; ``diag/mask_suspect_seq_frac`` and
    ``diag/mask_top``."""
    n_valid = int(state["n_valid"])
    if n_valid == 0:
        return {}
    out: dict[str, Any] = {}
    for name in LOGP_COLUMNS:
        if int(state[f"n_{name}"]):
            out[f"diag/zero_frac/{name}"] = int(state[f"n_zero_{name}"]) / int(state[f"n_{name}"])
    if int(state["n_old_logp"]):
        out["diag/old_zero_new_nonzero_frac"] = int(state["n_old_zero_new_not"]) / n_valid
    n_seq = int(state["n_seq"])
    if n_seq:
        out["diag/trailing_zero_seq_frac"] = int(state["n_seq_trailing"]) / n_seq
        out["diag/mask_suspect_seq_frac"] = int(state["n_seq_suspect"]) / n_seq
    out["diag/trailing_zero_tokens"] = int(state["n_tok_trailing"])
    out["diag/mask_hole_frac"] = int(state["n_holes"]) / n_valid
    if int(state["n_versions_valid"]):
        out["diag/prompt_in_loss_frac"] = int(state["n_prompt_in_loss"]) / int(state["n_versions_valid"])
        out["diag/mask_hole_generated_frac"] = int(state["n_holes_generated"]) / n_valid
        if int(state["n_generated"]):
            out["diag/generated_masked_frac"] = int(state["n_generated_masked"]) / int(state["n_generated"])
    out["diag/mask_top"] = _table_rows(state["top"])
    return out


# -- bitwise equality of columns -------------------------------------------------------------------------------------
def equality_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`equality_update`."""
    specs = {}
    for a, b in _PAIRS:
        specs[f"n_{a}_{b}"] = count()
        specs[f"eq_{a}_{b}"] = count()
    return MetricState(specs, device)


def equality_update(state: MetricState, *, columns: dict[str, Tensor | None]) -> None:
    """Fold one batch of **valid tokens** into ``state``.

    Args:
        state: from :func:`equality_state`.
        columns: ``{"new": …, "old": …, "prox": …, "ref": …}`` valid-token log-probs or ``None`` (absent).

    Equality is exact (``a == b`` in the stored dtype; two NaNs are never equal). Tokens where both are exactly 0
    do not count as equal: zeros say nothing about which policy produced a column (padding, or certain tokens),
    and :func:`zeros_update` reports them.
    """
    for a, b in _PAIRS:
        x, y = columns.get(a), columns.get(b)
        if x is None or y is None or x.numel() == 0:
            continue
        state.update(**{f"n_{a}_{b}": torch.tensor(x.numel()), f"eq_{a}_{b}": ((x == y) & (x != 0)).sum()})


def equality_compute(state: MetricState) -> dict[str, Any]:
    """``diag/equal_frac/<a>_<b>``: the fraction of valid tokens where columns a and b are bitwise equal and not 0,
    for each pair of ``new``, ``old``, ``prox``, ``ref`` the dump has."""
    out: dict[str, Any] = {}
    for a, b in _PAIRS:
        n = int(state[f"n_{a}_{b}"])
        if n:
            out[f"diag/equal_frac/{a}_{b}"] = int(state[f"eq_{a}_{b}"]) / n
    return out


# -- duplicates ------------------------------------------------------------------------------------------------------
def _mix(values: Tensor, salt: int) -> Tensor:
    """A position-free mixing of int64 values in [0, 2^32) into [0, _HASH_P)."""
    hi, lo = values >> 16, values & 0xFFFF
    return (hi * (40503 + salt) + lo * (65599 + 7 * salt) + 12345 + salt) % _HASH_P


def sequence_hash(bits: list[Tensor], cu_seqlens: Tensor) -> Tensor:
    """A float64 key in [0, 2^52) per sequence from the float32 bit patterns of its per-token values.

    Args:
        bits: ``[N]`` float tensors (each viewed as float32 bits) to hash together.
        cu_seqlens: ``[B + 1]`` offsets.

    Each token contributes ``mix(bits) · m(position)`` modulo the prime 2³¹ − 1 with a position multiplier
    ``m(p) = (p + 1)·2654435761 mod (2³¹ − 1)``; the per-sequence sum modulo 2³¹ − 1 is combined with the length
    (mod 2²¹), so two keys collide by chance with probability about 2⁻⁵², and equal sequences always agree.
    """
    n = bits[0].numel()
    n_seq = cu_seqlens.numel() - 1
    device = bits[0].device
    seq = segment_ids(cu_seqlens, n).to(device)
    pos = torch.arange(n, device=device) - cu_seqlens[:-1].to(device).index_select(0, seq)
    mult = ((pos + 1) * 2654435761) % _HASH_P
    acc = torch.zeros(n, dtype=torch.int64, device=device)
    for salt, values in enumerate(bits):
        raw = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        acc = (acc + _mix(raw, salt) * mult % _HASH_P) % _HASH_P
    sums = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, acc) % _HASH_P
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(device) % (1 << 21)
    return (sums + _HASH_P * lengths).to(torch.float64)


def duplicates_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`duplicates_update`: keyed tables ``content`` and ``ids`` with columns
    (count, first location, last location), a location being ``file·2³² + row``."""
    ops = (Reduce.SUM, Reduce.MIN, Reduce.MAX)
    return KeyedState({}, {"content": ops, "ids": ops}, device)


def duplicates_update(
    state: KeyedState,
    *,
    cu_seqlens: Tensor,
    columns: list[Tensor],
    seq_id: Tensor | None = None,
    step: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`duplicates_state`.
        cu_seqlens: ``[B + 1]`` offsets.
        columns: ``[N]`` per-token columns to hash (e.g. ``new_logp`` and ``old_logp`` over all tokens).
        seq_id, step: ``[B]`` ids, or ``None``; the ``ids`` table is keyed by (step, seq_id) (seq_id alone without
            a step column).
        file_index, rows: locations.

    Memory: one row (4 float64) per distinct sequence in each table, 64 bytes per sequence in all: 64 MB for a
    million sequences. The tables are exact; no bounded sketch is used because a duplicate must be located.
    """
    n_seq = cu_seqlens.numel() - 1
    if n_seq == 0:
        return
    device = columns[0].device
    file, row = _locations(file_index, rows, n_seq, device)
    loc = file * _LOC_SCALE + row
    ones = torch.ones(n_seq, dtype=torch.float64, device=device)
    key = sequence_hash(columns, cu_seqlens)
    state.update(content=torch.stack([key, ones, loc, loc], dim=1))
    if seq_id is not None:
        ids = seq_id.to(device=device, dtype=torch.int64)
        if step is not None:
            st = step.to(device=device, dtype=torch.int64)
            k = ((ids % _HASH_P) * 1_000_003 + (st % _HASH_P) * 998_244_353) % _HASH_P
            k = k + _HASH_P * ((ids // _HASH_P + st * 31) % (1 << 21))
        else:
            k = ids
        state.update(ids=torch.stack([k.to(torch.float64), ones, loc, loc], dim=1))


def _dups(table: Tensor, limit: int = 8) -> tuple[int, int, list[dict[str, int]]]:
    if table.shape[0] == 0:
        return 0, 0, []
    counts = table[:, 1]
    rep = counts > 1
    extra = int((counts[rep] - 1).sum())
    where = []
    for r in table[rep][:limit].tolist():
        first, last = int(r[2]), int(r[3])
        where.append({"count": int(r[1]), "file": first >> 32, "row": first & 0xFFFFFFFF,
                      "other_file": last >> 32, "other_row": last & 0xFFFFFFFF})
    return extra, int(counts.sum()), where


def duplicates_compute(state: KeyedState) -> dict[str, Any]:
    """``diag/dup_content_extra`` (sequences whose hashed content repeats an earlier one: Σ(count − 1)),
    ``diag/dup_content_frac`` (that over all sequences), ``diag/dup_id_extra`` and ``diag/dup_id_frac`` for
    (step, seq_id) keys, and ``diag/dup_where`` (up to 8 repeated keys with two of their locations)."""
    out: dict[str, Any] = {}
    extra, total_seq, where = _dups(state["content"])
    if total_seq:
        out["diag/dup_content_extra"] = extra
        out["diag/dup_content_frac"] = extra / total_seq
    id_extra, id_total, id_where = _dups(state["ids"])
    if id_total:
        out["diag/dup_id_extra"] = id_extra
        out["diag/dup_id_frac"] = id_extra / id_total
    out["diag/dup_where"] = id_where or where
    return out


# -- groups: advantages against rewards --------------------------------------------------------------------------------
_GROUP_OPS = (Reduce.SUM,) * 6 + (Reduce.MIN, Reduce.MIN)
SCALE_TOLERANCE = 0.1
"""Tolerance on a group's log advantage scale (±10 %). The models account for the group size (the unbiased std's
factor √(n/(n − 1))), so only the std's ε (1e-6 to 1e-4 in the peers) and float rounding move a consistent group."""


def groups_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`groups_update`: a keyed table ``g`` with columns (n, Σr, Σr², ΣA, ΣA², ΣrA, step,
    group_id)."""
    return KeyedState({}, {"g": _GROUP_OPS}, device)


def groups_update(
    state: KeyedState,
    *,
    rewards: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    group_id: Tensor,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`groups_state`.
        rewards: ``[B]`` per-sequence rewards.
        advantages: ``[N]`` per-token advantages (per-sequence ones broadcast); a sequence's advantage is their mean
            over its loss-mask tokens, or over all its tokens when it has none (a sequence whose mask was emptied
            still belongs to its group's statistics).
        loss_mask: ``[N]`` bool.
        cu_seqlens: ``[B + 1]`` offsets.
        group_id: ``[B]`` group ids; the key is (step, group_id) when ``step`` is given, stored as
            ``step·2³² + group_id`` in float64 (exact for steps below 2²¹ and ids in [0, 2³²)).
        step: ``[B]`` steps, or ``None``.

    Sequences with a non-finite reward or advantage are left out. The float sums are float64 and merge by
    ``scatter_reduce``, so they are independent of batching up to summation order (1e-15 relative).
    """
    n_seq = cu_seqlens.numel() - 1
    if n_seq == 0:
        return
    device = advantages.device
    seq = segment_ids(cu_seqlens, advantages.numel()).to(device)
    valid = loss_mask.to(torch.bool)
    adv = advantages.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    v_sum = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add_(0, seq, torch.where(valid, adv, zero))
    v_n = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, valid.to(torch.int64))
    all_sum = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add_(0, seq, adv)
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(device)
    a = torch.where(v_n > 0, v_sum / v_n.clamp_min(1), all_sum / lengths.clamp_min(1))
    r = rewards.to(device=device, dtype=torch.float64)
    keep = (lengths > 0) & torch.isfinite(a) & torch.isfinite(r)
    gid = group_id.to(device=device, dtype=torch.int64)
    st = step.to(device=device, dtype=torch.int64) if step is not None else torch.zeros_like(gid)
    key = (st * (1 << 32) + gid).to(torch.float64)
    rows = torch.stack(
        [key, torch.ones_like(r), r, r * r, a, a * a, r * a, st.to(torch.float64), gid.to(torch.float64)], dim=1
    )
    state.update(g=rows[keep])


def groups_compute(state: KeyedState, *, limit: int = 8) -> dict[str, Any]:
    """Per-group consistency of advantages with rewards, over groups of at least 2 sequences.

    Keys:

    - ``diag/groups_n``: groups; ``diag/groups_spread_n``: groups whose rewards differ;
    - ``diag/adv_sign_flip_frac``: spread groups where cov(r, A) < 0 (higher reward, lower advantage);
    - ``diag/adv_uncentred_frac``: groups whose mean A is not 0 (|mean A| > 1e-3 + 0.05·sd A);
    - ``diag/adv_scale_exponent``: the least-squares slope of log(cov(r, A)/var(r)) against log sd(r) over spread
      groups with positive cov: −1 when A is divided by the group std, 0 when it is not or by a batch-wide std, −2
      when divided by the variance; absent with fewer than 4 such groups or a range of log sd below 0.05;
    - ``diag/adv_scale_outlier_frac``: the fraction of those groups whose log scale log(cov/var) is more than
        :data:`SCALE_TOLERANCE` off the best of the legitimate models (A = c·(r − mean)/sd with the population or the
      unbiased sd, or A = c·(r − mean), c one constant fitted by the median): one worker normalising differently;
    - ``diag/adv_group_std_mean``: the mean population sd of A in spread groups;
    - ``diag/adv_where``: up to ``limit`` groups, sign-flipped first, then uncentred.
    """
    table = state["g"]
    out: dict[str, Any] = {}
    if table.shape[0] == 0:
        return out
    n = table[:, 1]
    big = n >= 2
    t = table[big]
    n = t[:, 1]
    mr, ma = t[:, 2] / n, t[:, 4] / n
    vr = (t[:, 3] / n - mr * mr).clamp_min(0)
    va = (t[:, 5] / n - ma * ma).clamp_min(0)
    cov = t[:, 6] / n - mr * ma
    spread = vr > 1e-12
    out["diag/groups_n"] = int(t.shape[0])
    out["diag/groups_spread_n"] = int(spread.sum())
    if t.shape[0] == 0:
        return out
    flipped = spread & (cov < 0)
    uncentred = ma.abs() > 1e-3 + 0.05 * va.sqrt()
    if int(spread.sum()):
        out["diag/adv_sign_flip_frac"] = int(flipped.sum()) / int(spread.sum())
        out["diag/adv_group_std_mean"] = float(va[spread].sqrt().mean())
    out["diag/adv_uncentred_frac"] = int(uncentred.sum()) / int(t.shape[0])
    fit = spread & (cov > 0)
    if int(fit.sum()) >= 4:
        lx = 0.5 * torch.log(vr[fit])
        ly = torch.log(cov[fit] / vr[fit])
        vx = float(((lx - lx.mean()) ** 2).mean())
        if float(lx.max() - lx.min()) >= 0.05 and vx > 0:
            out["diag/adv_scale_exponent"] = float(((lx - lx.mean()) * (ly - ly.mean())).mean()) / vx
        # the legitimate scalings: A ∝ (r − mean)/sd (log scale + log sd constant) or A ∝ r − mean (log scale
        # constant); groups off the better-fitting one by more than SCALE_TOLERANCE are inconsistent
        nf = n[fit]
        lx_unbiased = lx + 0.5 * torch.log(nf / (nf - 1))
        candidates = [(ly + z - (ly + z).median()).abs() for z in (lx, lx_unbiased)] + [(ly - ly.median()).abs()]
        resid = min(candidates, key=lambda r: float(r.median()))
        out["diag/adv_scale_outlier_frac"] = int((resid > SCALE_TOLERANCE).sum()) / int(fit.sum())
    where: list[dict[str, Any]] = []
    for mask, why in ((flipped, "sign"), (uncentred & ~flipped, "uncentred")):
        for r in t[mask][:limit].tolist():
            if len(where) < limit:
                where.append({"step": int(r[7]), "group_id": int(r[8]), "problem": why})
    out["diag/adv_where"] = where
    return out


# -- per step --------------------------------------------------------------------------------------------------------
_STEP_COLUMNS = (
    "n_tok", "n_old", "sum_abs", "n_lag0", "sum_abs_lag0", "sum_exp_lag0", "n_ent", "sum_ent", "sum_neg_new",
    "n_seq", "n_eos_known", "n_no_eos", "n_lag", "sum_lag", "n_clip_known", "n_clip", "n_prox", "sum_prox_abs",
    "n_rew", "sum_rew", "n_tail_lag0",
)
_STEP_OPS = (Reduce.SUM,) * len(_STEP_COLUMNS) + (Reduce.MAX, Reduce.MAX)
_STEP_LAG_OPS = (Reduce.SUM, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.MIN)
_STEP_LAG_BINS = 64
"""Lags 0 … 63 of the (step, lag) table; larger lags share bin 63."""
LAG0_SEQ_MIN_TOKENS = 4
"""``lag0_seq_max`` in :func:`by_step_compute` considers sequences with at least this many lag-0 tokens."""


def by_step_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`by_step_update`: a keyed table ``s`` keyed by step."""
    return KeyedState({}, {"s": _STEP_OPS, "sl": _STEP_LAG_OPS}, device)


def by_step_update(
    state: KeyedState,
    *,
    step: Tensor,
    new_logp: Tensor,
    cu_seqlens: Tensor,
    old_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    lag: Tensor | None = None,
    eos: Tensor | None = None,
    advantages: Tensor | None = None,
    base_logp: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    prox_logp: Tensor | None = None,
    rewards: Tensor | None = None,
) -> None:
    """Fold one batch of **valid tokens** into ``state``.

    Args:
        state: from :func:`by_step_state`.
        step: ``[B]`` step per sequence.
        new_logp, old_logp, entropy: ``[N]`` valid-token values (the latter two may be ``None``).
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        lag: ``[N]`` lag ``current_version − versions`` per valid token (negative: not generated), or ``None``.
        eos: ``[B]`` EOS flags, or ``None``.
        advantages, base_logp: ``[N]`` per-token advantages and the PPO ratio's base (``prox_logp`` if the dump has
            it, else ``old_logp``) for the clip fraction, or ``None``.
        epsilon, epsilon_high: the clip range (``clip/ratio``'s rule: r > 1 + ε_high with A > 0 or r < 1 − ε with
            A < 0, ε_high defaulting to ε).
        prox_logp: ``[N]`` proximal log-probs for the step's own policy change mean |new − prox|, or ``None``.
        rewards: ``[B]`` per-sequence rewards (the step's mean reward, which tells convergence from collapse), or
            ``None``.
    """
    n_seq = cu_seqlens.numel() - 1
    if n_seq == 0:
        return
    n = new_logp.numel()
    device = new_logp.device
    seq = segment_ids(cu_seqlens, n).to(device)
    st = step.to(device=device, dtype=torch.int64)
    keys, inv_seq = torch.unique(st, sorted=True, return_inverse=True)
    n_keys = keys.numel()
    inv_tok = inv_seq.index_select(0, seq)

    def tok_sum(values: Tensor) -> Tensor:
        return torch.zeros(n_keys, dtype=torch.float64, device=device).index_add_(0, inv_tok, values.to(torch.float64))

    cols = {name: torch.zeros(n_keys, dtype=torch.float64, device=device) for name in _STEP_COLUMNS}
    new = _float(new_logp)
    cols["n_tok"] = tok_sum(torch.ones(n, device=device))
    cols["sum_neg_new"] = tok_sum(-new)
    if old_logp is not None:
        diff = (new - _float(old_logp)).abs()
        cols["n_old"] = cols["n_tok"]
        cols["sum_abs"] = tok_sum(diff)
        if lag is not None:
            at0 = (lag == 0).to(torch.float64)
            cols["n_lag0"] = tok_sum(at0)
            cols["sum_abs_lag0"] = tok_sum(diff * at0)
            cols["sum_exp_lag0"] = tok_sum(torch.exp(diff.to(torch.float64)) * at0)
            # Importance weights outside [1/2, 2] at lag 0: engine/trainer disagreement, not policy change.
            cols["n_tail_lag0"] = tok_sum((diff.to(torch.float64) > math.log(2.0)).to(torch.float64) * at0)
    if entropy is not None:
        cols["n_ent"] = cols["n_tok"]
        cols["sum_ent"] = tok_sum(_float(entropy))
    seq_ones = torch.ones(n_seq, dtype=torch.float64, device=device)
    cols["n_seq"] = torch.zeros(n_keys, dtype=torch.float64, device=device).index_add_(0, inv_seq, seq_ones)
    if rewards is not None:
        cols["n_rew"] = cols["n_seq"]
        cols["sum_rew"] = torch.zeros(n_keys, dtype=torch.float64, device=device).index_add_(
            0, inv_seq, rewards.to(device=device, dtype=torch.float64))
    max_lag = torch.full((n_keys,), -math.inf, dtype=torch.float64, device=device)
    if eos is not None:
        cols["n_eos_known"] = cols["n_seq"]
        no_eos = (eos.to(device) == 0).to(torch.float64)
        cols["n_no_eos"] = torch.zeros(n_keys, dtype=torch.float64, device=device).index_add_(0, inv_seq, no_eos)
    if lag is not None:
        gen = lag >= 0
        cols["n_lag"] = tok_sum(gen)
        cols["sum_lag"] = tok_sum(torch.where(gen, lag, 0))
        if bool(gen.any()):
            max_lag = max_lag.scatter_reduce(0, inv_tok[gen], lag[gen].to(torch.float64), reduce="amax")
    if prox_logp is not None:
        cols["n_prox"] = cols["n_tok"]
        cols["sum_prox_abs"] = tok_sum((new - _float(prox_logp)).abs())
    if advantages is not None and base_logp is not None:
        ratio = torch.exp(new - _float(base_logp))
        adv = _float(advantages)
        high = 1.0 + (epsilon if epsilon_high is None else epsilon_high)
        clipped = ((ratio > high) & (adv > 0)) | ((ratio < 1.0 - epsilon) & (adv < 0))
        cols["n_clip_known"] = cols["n_tok"]
        cols["n_clip"] = tok_sum(clipped)
    seq_max = torch.full((n_keys,), -math.inf, dtype=torch.float64, device=device)
    if old_logp is not None and lag is not None:
        at0 = lag == 0
        d0 = torch.where(at0, (new - _float(old_logp)).abs().to(torch.float64), 0.0)
        s_sum = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add_(0, seq, d0)
        s_n = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, at0.to(torch.int64))
        ok = s_n >= LAG0_SEQ_MIN_TOKENS
        if bool(ok.any()):
            seq_max = seq_max.scatter_reduce(0, inv_seq[ok], (s_sum / s_n.clamp_min(1))[ok], reduce="amax")
    rows = torch.stack([keys.to(torch.float64), *[cols[c] for c in _STEP_COLUMNS], max_lag, seq_max], dim=1)
    state.update(s=rows)
    if old_logp is not None and lag is not None:
        state.update(sl=_step_lag_rows(st, seq, new, _float(old_logp), lag, n_seq))


def _step_lag_rows(step: Tensor, seq: Tensor, new: Tensor, old: Tensor, lag: Tensor, n_seq: int) -> Tensor:
    """Rows ``[key, n_tokens, Σ|Δ|, max seq mean |Δ|, step, lag]`` of the (step, lag) table: a sequence counts
    under the lag of its first generated valid token (a sequence is generated by one version in the simulator and
    in AReaL; mixed sequences take their first lag), and only with ≥ LAG0_SEQ_MIN_TOKENS such tokens."""
    device = new.device
    gen = lag >= 0
    if not bool(gen.any()):
        return torch.zeros((0, 6), dtype=torch.float64, device=device)
    n = new.numel()
    idx = torch.arange(n, device=device)
    big = torch.iinfo(torch.int64).max
    first = torch.full((n_seq,), big, dtype=torch.int64, device=device).scatter_reduce(
        0, seq, torch.where(gen, idx, big), reduce="amin"
    )
    has = first < big
    seq_lag = torch.where(has, lag.index_select(0, first.clamp_max(n - 1)), -1).clamp_max(_STEP_LAG_BINS - 1)
    same = gen & (lag.clamp_max(_STEP_LAG_BINS - 1) == seq_lag.index_select(0, seq))
    diff = torch.where(same, (new - old).abs().to(torch.float64), 0.0)
    s_sum = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add_(0, seq, diff)
    s_n = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, same.to(torch.int64))
    keep = has & (s_n > 0)
    s_mean = s_sum / s_n.clamp_min(1)
    s_max = torch.where(s_n >= LAG0_SEQ_MIN_TOKENS, s_mean, -math.inf)
    st = step[keep].to(torch.float64)
    lg = seq_lag[keep].to(torch.float64)
    key = st * _STEP_LAG_BINS + lg
    return torch.stack([key, s_n[keep].to(torch.float64), s_sum[keep], s_max[keep], st, lg], dim=1)


def by_step_compute(state: KeyedState) -> dict[str, Any]:
    """``diag/by_step``: one row per step, in step order, ``{step, n_tokens, abs_diff_mean, lag0_n_tokens,
    lag0_abs_diff_mean, lag0_mult_prob_error, entropy_mean, neg_logp_mean, n_sequences, no_eos_frac, lag_mean,
    lag_max, clip_frac, lag0_seq_max, prox_abs_diff_mean, reward_mean, lag0_tail_frac}`` (``lag0_tail_frac``:
    the lag-0 tokens whose weight exp(new − old) lies outside [1/2, 2]; ``prox_abs_diff_mean``: mean |new − prox|,
    the policy's own change over one version; ``lag0_seq_max``: the largest per-sequence mean |new − old| over the lag-0
    tokens of sequences with ≥ LAG0_SEQ_MIN_TOKENS of them: the worst engine of the step, which a broken worker
    sets whatever its share of the batch); and ``diag/by_step_lag``: one row per (step, lag) ``{step, lag,
    n_tokens, abs_diff_mean, seq_max}`` over the sequences of that lag (a sequence's lag is its first generated valid
    token's; lags ≥ 63 share 63), ``seq_max`` the largest sequence mean |new − old| (≥ LAG0_SEQ_MIN_TOKENS tokens);
    a figure whose inputs are absent is ``None``."""
    rows = []
    for r in state["s"].tolist():
        c = dict(zip(("step", *_STEP_COLUMNS, "lag_max", "lag0_seq_max"), r))

        def ratio(num: str, den: str, c: dict[str, float] = c) -> float | None:
            return c[num] / c[den] if c[den] > 0 else None

        rows.append({
            "step": int(c["step"]),
            "n_tokens": int(c["n_tok"]),
            "abs_diff_mean": ratio("sum_abs", "n_old"),
            "lag0_n_tokens": int(c["n_lag0"]),
            "lag0_abs_diff_mean": ratio("sum_abs_lag0", "n_lag0"),
            "lag0_mult_prob_error": ratio("sum_exp_lag0", "n_lag0"),
            "entropy_mean": ratio("sum_ent", "n_ent"),
            "neg_logp_mean": ratio("sum_neg_new", "n_tok"),
            "n_sequences": int(c["n_seq"]),
            "no_eos_frac": ratio("n_no_eos", "n_eos_known"),
            "lag_mean": ratio("sum_lag", "n_lag"),
            "lag_max": None if c["lag_max"] == -math.inf else int(c["lag_max"]),
            "clip_frac": ratio("n_clip", "n_clip_known"),
            "lag0_seq_max": None if c["lag0_seq_max"] == -math.inf else c["lag0_seq_max"],
            "prox_abs_diff_mean": ratio("sum_prox_abs", "n_prox"),
            "reward_mean": ratio("sum_rew", "n_rew"),
            "lag0_tail_frac": ratio("n_tail_lag0", "n_lag0"),
        })
    by_lag = []
    for r in state["sl"].tolist():
        _key, n_tok, s_abs, s_max, st, lg = r
        by_lag.append({"step": int(st), "lag": int(lg), "n_tokens": int(n_tok), "abs_diff_mean": s_abs / n_tok,
                       "seq_max": None if s_max == -math.inf else s_max})
    return {"diag/by_step": rows, "diag/by_step_lag": by_lag}


# -- lags: mismatch at lag 0 and the proximal approximation --------------------------------------------------------
def lags_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`lags_update` (bins: lags 0 … MAX_DIAG_LAG − 1, then overflow)."""
    bins = (MAX_DIAG_LAG + 1,)
    specs = {
        "n": count(bins), "sum_abs": total(bins), "n_prox": count(bins), "sum_prox_err": total(bins),
        "sum_exp0": total(), "max_abs0": maximum(), "n_seq0": count(), "n_seq0_big": count(),
        "lag_max": maximum(), "top": top_rows(top_k, len(TOP_FIELDS)),
        "sx0": total(), "sy0": total(), "sxx0": total(), "sxy0": total(),
    }
    return MetricState(specs, device)


BIG_SEQ_MISMATCH = 0.1
"""A lag-0 sequence counts as "big mismatch" when its mean |new − old| exceeds this (nats), about 10× the
healthy bf16 level (``docs/findings.md``, GRP202)."""


def lags_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    lag: Tensor,
    cu_seqlens: Tensor,
    prox_logp: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of **valid tokens** into ``state``.

    Args:
        state: from :func:`lags_state`.
        new_logp, old_logp, prox_logp: ``[N]`` valid-token log-probs (``prox_logp`` optional).
        lag: ``[N]`` int lag ``current_version − versions``; tokens with a negative lag (not generated) are skipped.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        file_index, rows, step: locations for the ``top`` table of lag-0 sequences by mean |new − old| (``value``:
            their lag-0 tokens).

    The proximal error is |prox − (old + α(new − old))| with α = (k − 1)/k for k ≥ 1 and 0 at k = 0, AReaL's
    ``loglinear`` approximation (``compute_prox_logp_approximations``; v_prox = v_θ − 1).
    """
    n = new_logp.numel()
    if n == 0:
        return
    device = new_logp.device
    new, old = _float(new_logp).to(torch.float64), _float(old_logp).to(torch.float64)
    lag = lag.to(device=device, dtype=torch.int64)
    gen = lag >= 0
    diff = (new - old).abs()
    b = lag.clamp(0, MAX_DIAG_LAG)
    zeros = torch.zeros(MAX_DIAG_LAG + 1, dtype=torch.float64, device=device)
    counts = torch.zeros(MAX_DIAG_LAG + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, b[gen], torch.ones_like(b[gen]))
    state.update(n=counts, sum_abs=zeros.clone().index_add_(0, b[gen], diff[gen]))
    if bool(gen.any()):
        state.update(lag_max=lag[gen].max().to(torch.float64))
    if prox_logp is not None:
        k = lag.to(torch.float64)
        alpha = torch.where(k >= 1, (k - 1) / k.clamp_min(1), torch.zeros_like(k))
        err = (_float(prox_logp).to(torch.float64) - (old + alpha * (new - old))).abs()
        state.update(n_prox=counts, sum_prox_err=zeros.clone().index_add_(0, b[gen], err[gen]))
    at0 = lag == 0
    x0, y0 = new[at0], old[at0]
    state.update(sum_exp0=torch.exp(diff[at0]).sum(), sx0=x0.sum(), sy0=y0.sum(), sxx0=(x0 * x0).sum(),
                 sxy0=(x0 * y0).sum())
    if bool(at0.any()):
        state.update(max_abs0=diff[at0].max())
    n_seq = cu_seqlens.numel() - 1
    seq = segment_ids(cu_seqlens, n).to(device)
    s_sum = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add_(0, seq, torch.where(at0, diff, 0.0))
    s_n = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, at0.to(torch.int64))
    has = s_n > 0
    s_mean = s_sum / s_n.clamp_min(1)
    state.update(n_seq0=has.sum(), n_seq0_big=(has & (s_mean > BIG_SEQ_MISMATCH)).sum())
    file, row = _locations(file_index, rows, n_seq, device)
    state.update(top=_top_table(s_mean, has, file, row, step, s_n))


def lags_compute(state: MetricState, *, tolerance: float = 0.01) -> dict[str, Any]:
    """``diag/lag0_n_tokens``, ``diag/lag0_abs_diff_mean``, ``diag/lag0_abs_diff_max``, ``diag/lag0_mult_prob_error``
    (NeMo RL's mean exp(|new − old|) over lag-0 tokens), ``diag/lag0_old_vs_new_slope`` (the least-squares slope
    of old on new over lag-0 tokens, where policy drift cannot tilt it), ``diag/lag0_big_seq_frac`` (lag-0
    sequences with mean |new − old| > :data:`BIG_SEQ_MISMATCH`), ``diag/lag0_top``; ``diag/by_lag`` rows
    ``{lag, n_tokens, abs_diff_mean, prox_loglinear_error}`` (the last bin, ``overflow``, holds lags ≥ MAX_DIAG_LAG);
    with ``prox_logp``: ``diag/prox_loglinear_safe_lag`` (the largest k ≥ 1 with every observed lag in [1, k] at a
    mean error ≤ ``tolerance``, 0 when lag 1 already exceeds it; compare-prox's ``max_safe_lag`` rule) and
    ``diag/prox_beyond_safe_frac`` (generated tokens with a lag above it / generated tokens with lag ≥ 1)."""
    n = state["n"].tolist()
    total_n = sum(n)
    if total_n == 0:
        return {}
    sums = state["sum_abs"].tolist()
    n_prox = state["n_prox"].tolist()
    perr = state["sum_prox_err"].tolist()
    out: dict[str, Any] = {"diag/lag_max": int(float(state["lag_max"]))}
    if n[0]:
        out["diag/lag0_n_tokens"] = n[0]
        out["diag/lag0_abs_diff_mean"] = sums[0] / n[0]
        out["diag/lag0_abs_diff_max"] = float(state["max_abs0"])
        out["diag/lag0_mult_prob_error"] = float(state["sum_exp0"]) / n[0]
        mx, my = float(state["sx0"]) / n[0], float(state["sy0"]) / n[0]
        vx = float(state["sxx0"]) / n[0] - mx * mx
        if vx > 1e-12 * max(1.0, mx * mx):
            out["diag/lag0_old_vs_new_slope"] = (float(state["sxy0"]) / n[0] - mx * my) / vx
    if int(state["n_seq0"]):
        out["diag/lag0_big_seq_frac"] = int(state["n_seq0_big"]) / int(state["n_seq0"])
        out["diag/lag0_n_seq"] = int(state["n_seq0"])
    out["diag/lag0_top"] = _table_rows(state["top"])
    rows = []
    for k in range(MAX_DIAG_LAG + 1):
        if n[k]:
            row: dict[str, Any] = {"lag": k, "n_tokens": n[k], "abs_diff_mean": sums[k] / n[k]}
            if k == MAX_DIAG_LAG:
                row["overflow"] = True
            row["prox_loglinear_error"] = perr[k] / n_prox[k] if n_prox[k] else None
            rows.append(row)
    out["diag/by_lag"] = rows
    if sum(n_prox[1:]):
        safe = 0
        for k in range(1, MAX_DIAG_LAG):
            if n_prox[k] == 0:
                continue
            if perr[k] / n_prox[k] > tolerance:
                break
            safe = k
        out["diag/prox_loglinear_safe_lag"] = safe
        beyond = sum(n_prox[safe + 1:])
        out["diag/prox_beyond_safe_frac"] = beyond / sum(n_prox[1:])
    return out


# -- everything at once ----------------------------------------------------------------------------------------------
def diagnosis_state(device: torch.device | str | None = None, top_k: int = 8) -> dict[str, MetricState]:
    """The states of every family, by name (merge each with its own ``merge_``)."""
    return {
        "shift": shift_state(device, top_k), "relation": relation_state(device, top_k),
        "zeros": zeros_state(device, top_k), "equality": equality_state(device),
        "duplicates": duplicates_state(device), "groups": groups_state(device), "by_step": by_step_state(device),
        "lags": lags_state(device, top_k),
    }


def diagnosis_update(
    states: dict[str, MetricState],
    batch: TokenBatch,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> None:
    """Fold one :class:`~grpo_cli.core.batch.TokenBatch` (whole sequences, boolean ``loss_mask``) into ``states``,
    running each family whose columns the batch has.

    Args:
        states: from :func:`diagnosis_state`.
        batch: whole sequences with every column the dump has.
        epsilon, epsilon_high: the clip range of the per-step clip fraction (``--epsilon``, ``--epsilon-high``).
    """
    rows, fi = batch.rows, batch.file_index
    cu = batch.cu_seqlens
    step = batch.step
    cols = {name: getattr(batch, name) for name in LOGP_COLUMNS}
    zeros_update(states["zeros"], loss_mask=batch.loss_mask, cu_seqlens=cu, columns=cols, versions=batch.versions,
                 file_index=fi, rows=rows, step=step)
    hashed = [batch.new_logp] + ([batch.old_logp] if batch.old_logp is not None else [])
    duplicates_update(cast(KeyedState, states["duplicates"]), cu_seqlens=cu, columns=hashed, seq_id=batch.seq_id,
                      step=step, file_index=fi, rows=rows)
    if batch.old_logp is not None:
        shift_update(states["shift"], new_logp=batch.new_logp, old_logp=batch.old_logp, loss_mask=batch.loss_mask,
                     cu_seqlens=cu, file_index=fi, rows=rows, step=step)
    v = batch.valid()
    vcu = v.cu_seqlens
    equality_update(states["equality"], columns={"new": v.new_logp, "old": v.old_logp, "prox": v.prox_logp,
                                                 "ref": v.ref_logp})
    lag = None
    if v.versions is not None and v.current_version is not None:
        current = broadcast_current_version(v.current_version, v.versions, cu_seqlens=vcu)
        lag = torch.where(v.versions >= 0, current.to(torch.int64) - v.versions.to(torch.int64), -1)
    if v.old_logp is not None:
        relation_update(states["relation"], new_logp=v.new_logp, old_logp=v.old_logp, cu_seqlens=vcu,
                        file_index=fi, rows=rows, step=step)
        if lag is not None:
            lags_update(states["lags"], new_logp=v.new_logp, old_logp=v.old_logp, lag=lag, cu_seqlens=vcu,
                        prox_logp=v.prox_logp, file_index=fi, rows=rows, step=step)
    if batch.rewards is not None and batch.advantages is not None and batch.group_id is not None:
        groups_update(cast(KeyedState, states["groups"]), rewards=batch.rewards, advantages=batch.advantages,
                      loss_mask=batch.loss_mask, cu_seqlens=cu, group_id=batch.group_id, step=step)
    if step is not None:
        base = v.prox_logp if v.prox_logp is not None else v.old_logp
        by_step_update(cast(KeyedState, states["by_step"]), step=step, new_logp=v.new_logp, cu_seqlens=vcu,
                       old_logp=v.old_logp, entropy=v.entropy, lag=lag, eos=v.eos, advantages=v.advantages,
                       base_logp=base, epsilon=epsilon, epsilon_high=epsilon_high, prox_logp=v.prox_logp,
                       rewards=v.rewards)


def diagnosis_compute(states: dict[str, MetricState]) -> dict[str, Any]:
    """Every ``diag/*`` figure the states support."""
    out: dict[str, Any] = {}
    out.update(shift_compute(states["shift"]))
    out.update(relation_compute(states["relation"]))
    out.update(zeros_compute(states["zeros"]))
    out.update(equality_compute(states["equality"]))
    out.update(duplicates_compute(states["duplicates"]))  # type: ignore[arg-type]  # a KeyedState
    out.update(groups_compute(states["groups"]))  # type: ignore[arg-type]  # a KeyedState
    if states["by_step"]["s"].shape[0]:
        out.update(by_step_compute(states["by_step"]))  # type: ignore[arg-type]  # a KeyedState
    out.update(lags_compute(states["lags"]))
    return out
