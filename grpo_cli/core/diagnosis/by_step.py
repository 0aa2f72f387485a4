"""The **by_step** family: per training step, |new − old| overall and at lag 0, entropy, EOS, lag, clip
and reward figures, and a (step, lag) table of per-sequence mismatch."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import as_float, key_sums, sums_by
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import segment_count, segment_ids, segment_span, segment_sum
from grpo_cli.core.state import Reduce

__all__ = ["LAG0_SEQ_MIN_TOKENS", "by_step_compute", "by_step_state", "by_step_update"]

_STEP_COLUMNS = (
    "n_tok", "n_old", "sum_abs", "n_lag0", "sum_abs_lag0", "n_ent", "sum_ent", "sum_neg_new",
    "n_seq", "n_eos_known", "n_no_eos", "n_lag", "sum_lag", "n_clip_known", "n_clip", "n_prox", "sum_prox_abs",
    "n_rew", "sum_rew", "n_ref", "eq_ref_new", "eq_ref_old", "eq_ref_prox",
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
    ref_logp: Tensor | None = None,
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
        ref_logp: ``[N]`` reference log-probs, or ``None``: per step, the tokens where it equals ``new``/``old``/
            ``prox`` bitwise (and is not 0), which a reference that is the policy's initial weights does only in the
            first steps.
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

    cols = {name: torch.zeros(n_keys, dtype=torch.float64, device=device) for name in _STEP_COLUMNS}
    per_token: dict[str, Tensor] = {}  # every per-token column summed by step, all summed by one reduction
    new = as_float(new_logp)
    per_token["n_tok"] = torch.ones((), device=device).expand(n)
    per_token["sum_neg_new"] = -new
    if old_logp is not None:
        diff = (new - as_float(old_logp)).abs()
        per_token["sum_abs"] = diff
        if lag is not None:
            at0 = (lag == 0).to(torch.float64)
            per_token["n_lag0"] = at0
            per_token["sum_abs_lag0"] = diff * at0
    if entropy is not None:
        per_token["sum_ent"] = as_float(entropy)
    if lag is not None:
        gen = lag >= 0
        per_token["n_lag"] = gen
        per_token["sum_lag"] = torch.where(gen, lag, 0)
    if prox_logp is not None:
        per_token["sum_prox_abs"] = (new - as_float(prox_logp)).abs()
    if ref_logp is not None:
        ref_nonzero = ref_logp != 0
        for name, other in (("new", new_logp), ("old", old_logp), ("prox", prox_logp)):
            if other is not None:
                per_token[f"eq_ref_{name}"] = (ref_logp == other) & ref_nonzero
    if advantages is not None and base_logp is not None:
        ratio = torch.exp(new - as_float(base_logp))
        adv = as_float(advantages)
        high = 1.0 + (epsilon if epsilon_high is None else epsilon_high)
        per_token["n_clip"] = ((ratio > high) & (adv > 0)) | ((ratio < 1.0 - epsilon) & (adv < 0))
    values = torch.empty(len(per_token), n, dtype=torch.float64, device=device)
    for row, column in zip(values, per_token.values()):
        row.copy_(column)
    for name, sums in zip(per_token, key_sums(values, inv_seq, cu_seqlens, n_keys)):
        cols[name] = sums
    for count, source in (("n_old", "sum_abs"), ("n_ent", "sum_ent"), ("n_prox", "sum_prox_abs"),
                          ("n_ref", "eq_ref_new"), ("n_clip_known", "n_clip")):
        if source in per_token:
            cols[count] = cols["n_tok"]
    seq_ones = torch.ones(n_seq, dtype=torch.float64, device=device)
    cols["n_seq"] = sums_by(inv_seq, seq_ones, n_keys)
    if rewards is not None:
        cols["n_rew"] = cols["n_seq"]
        cols["sum_rew"] = sums_by(inv_seq, rewards.to(device=device, dtype=torch.float64), n_keys)
    max_lag = torch.full((n_keys,), -math.inf, dtype=torch.float64, device=device)
    if eos is not None:
        cols["n_eos_known"] = cols["n_seq"]
        no_eos = (eos.to(device) == 0).to(torch.float64)
        cols["n_no_eos"] = sums_by(inv_seq, no_eos, n_keys)
    if lag is not None:
        inv_tok = inv_seq.index_select(0, seq)
        lag_or_none = torch.where(gen, lag.to(torch.float64), -math.inf)
        max_lag = max_lag.scatter_reduce(0, inv_tok, lag_or_none, reduce="amax")
    seq_max = torch.full((n_keys,), -math.inf, dtype=torch.float64, device=device)
    if old_logp is not None and lag is not None:
        at0 = lag == 0
        d0 = torch.where(at0, (new - as_float(old_logp)).abs().to(torch.float64), 0.0)
        s_sum = segment_sum(d0, cu_seqlens, torch.float64)
        s_n = segment_count(at0, cu_seqlens)
        ok = s_n >= LAG0_SEQ_MIN_TOKENS
        if bool(ok.any()):
            seq_max = seq_max.scatter_reduce(0, inv_seq[ok], (s_sum / s_n.clamp_min(1))[ok], reduce="amax")
    rows = torch.stack([keys.to(torch.float64), *[cols[c] for c in _STEP_COLUMNS], max_lag, seq_max], dim=1)
    state.update(s=rows)
    if old_logp is not None and lag is not None:
        state.update(sl=_step_lag_rows(st, seq, cu_seqlens, new, as_float(old_logp), lag))


def _step_lag_rows(step: Tensor, seq: Tensor, cu_seqlens: Tensor, new: Tensor, old: Tensor, lag: Tensor) -> Tensor:
    """Rows ``[key, n_tokens, Σ|Δ|, max seq mean |Δ|, step, lag]`` of the (step, lag) table: a sequence counts
    under the lag of its first generated valid token (a sequence is generated by one version in the simulator and
    in AReaL; mixed sequences take their first lag), and only with ≥ LAG0_SEQ_MIN_TOKENS such tokens."""
    device = new.device
    gen = lag >= 0
    if not bool(gen.any()):
        return torch.zeros((0, 6), dtype=torch.float64, device=device)
    n = new.numel()
    first = segment_span(gen, cu_seqlens)[1]
    has = first < torch.iinfo(torch.int64).max
    seq_lag = torch.where(has, lag.index_select(0, first.clamp_max(n - 1)), -1).clamp_max(_STEP_LAG_BINS - 1)
    same = gen & (lag.clamp_max(_STEP_LAG_BINS - 1) == seq_lag.index_select(0, seq))
    diff = torch.where(same, (new - old).abs().to(torch.float64), 0.0)
    s_sum = segment_sum(diff, cu_seqlens, torch.float64)
    s_n = segment_count(same, cu_seqlens)
    keep = has & (s_n > 0)
    s_mean = s_sum / s_n.clamp_min(1)
    s_max = torch.where(s_n >= LAG0_SEQ_MIN_TOKENS, s_mean, -math.inf)
    st = step[keep].to(torch.float64)
    lg = seq_lag[keep].to(torch.float64)
    key = st * _STEP_LAG_BINS + lg
    return torch.stack([key, s_n[keep].to(torch.float64), s_sum[keep], s_max[keep], st, lg], dim=1)


def by_step_compute(state: KeyedState) -> dict[str, Any]:
    """``diag/by_step``: one row per step, in step order, ``{step, n_tokens, abs_diff_mean, lag0_n_tokens,
    lag0_abs_diff_mean, entropy_mean, neg_logp_mean, n_sequences, no_eos_frac, lag_mean,
    lag_max, clip_frac, lag0_seq_max, prox_abs_diff_mean, reward_mean, n_ref, ref_equal_new, ref_equal_old,
    ref_equal_prox}`` (``ref_equal_*``: tokens where ``ref_logp`` equals that column bitwise and is not 0, of
    ``n_ref``; ``prox_abs_diff_mean``: mean |new − prox|,
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
            "n_ref": int(c["n_ref"]),
            **{f"ref_equal_{name}": int(c[f"eq_ref_{name}"]) for name in ("new", "old", "prox")},
        })
    by_lag = []
    for r in state["sl"].tolist():
        _key, n_tok, s_abs, s_max, st, lg = r
        by_lag.append({"step": int(st), "lag": int(lg), "n_tokens": int(n_tok), "abs_diff_mean": s_abs / n_tok,
                       "seq_max": None if s_max == -math.inf else s_max})
    return {"diag/by_step": rows, "diag/by_step_lag": by_lag}
