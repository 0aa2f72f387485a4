"""TRL's logged figures (``trl/trainer/grpo_trainer.py``: ``GRPOTrainer._compute_loss``,
``_generate_and_score_completions``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_cli._choices import TRL_VLLM_IS_MODES
from grpo_cli.core._loss_common import (
    check_real,
)
from grpo_cli.core._peer_common import (
    F64,
    pack,
    packed_mean,
    prepare,
    sequence_means,
)
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_sum

__all__ = [
    "trl_bound_is_ratio",
    "trl_cispo_clip_ratio",
    "trl_clip_indicators",
    "trl_clip_ratio_metrics",
    "trl_clip_terms",
    "trl_clip_units",
    "trl_importance_ratio",
    "trl_kl_terms",
    "trl_logged_kl",
    "trl_sampling_metrics",
    "trl_sampling_terms",
]


def trl_importance_ratio(log_ratio: Tensor, cu_seqlens: Tensor, level: str) -> Tensor:
    """TRL's ``coef_1`` of packed valid tokens (``GRPOTrainer._compute_loss``, no clamp): ``exp(ℓ − ℓ_old)`` per
    token, or at ``level="sequence"`` exp of the sequence's mean log-ratio on each of its tokens. The batch
    functions and the streaming ``--names trl`` group both call it.

    Example:
        >>> trl_importance_ratio(torch.log(torch.tensor([2.0, 8.0])), torch.tensor([0, 2]), "sequence").tolist()
        [4.0, 4.0]
    """
    if level == "token":
        return torch.exp(log_ratio)
    if level != "sequence":
        raise ValueError(f"Unknown importance sampling level: {level}. Possible values are 'token' and 'sequence'.")
    mean = sequence_means(log_ratio, cu_seqlens)
    return torch.exp(broadcast_to_tokens(mean, cu_seqlens, log_ratio.numel()).to(log_ratio.dtype))


def trl_kl_terms(log_prob: Tensor, ref_log_prob: Tensor, coef: Tensor | None = None) -> Tensor:
    """TRL's per-token logged ``kl``: ``k3 = e^{ℓ_ref − ℓ} − (ℓ_ref − ℓ) − 1`` (:mod:`grpo_cli.core.kl`) times
    ``coef_1`` under ``use_bias_correction_kl`` (``coef`` None: TRL's on-policy shortcut, ``coef_1 = 1``). The
    batch function :func:`trl_logged_kl` and the streaming ``--names trl`` group both call it."""
    k3 = k3_of_log_weight(ref_log_prob - log_prob)
    return k3 if coef is None else k3 * coef


def trl_logged_kl(
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    ref_log_prob: Tensor,
    mask: Tensor,
    *,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = True,
) -> float:
    """TRL's logged ``kl``: the token mean of ``k3 = e^{ℓ_ref − ℓ} − (ℓ_ref − ℓ) − 1`` times ``coef_1``.

    TRL 1.16 ``GRPOTrainer._compute_loss`` logs ``global_masked_mean(per_token_kl)`` after the bias
    correction (``use_bias_correction_kl``, default True) has multiplied k3 by the ratio ``coef_1``
    (per token, or the sequence ratio under ``importance_sampling_level="sequence"``); ``old_log_prob=None``
    is TRL's on-policy shortcut (``coef_1 = 1``). An empty mask gives 0 (TRL divides by ``max(Σm, 1)``).

    Example:
        >>> lp = torch.tensor([[-1.0]]); old = lp - math.log(2.0)
        >>> round(trl_logged_kl(lp, old, torch.tensor([[-2.0]]), torch.ones(1, 1)), 6)  # 2·e^-1
        0.735759
    """
    m, cd = prepare(log_prob, mask, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob)
    cu, (lp, ref) = pack(m, log_prob.detach().to(cd), ref_log_prob.detach().to(cd))
    coef = None
    if use_bias_correction_kl and old_log_prob is not None:
        old = pack(m, old_log_prob.detach().to(cd))[1][0]
        coef = trl_importance_ratio(lp - old, cu, importance_sampling_level)
    return packed_mean(trl_kl_terms(lp, ref, coef))


def _trl_advantages(advantages: Tensor, log_prob: Tensor) -> Tensor:
    """TRL's advantages as ``_compute_loss`` holds them: ``[B]`` (base GRPO, one per completion) becomes ``[B, 1]``,
    ``[B, T]`` (a subclass's per-token advantages) stays."""
    if not isinstance(advantages, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(advantages).__name__}")
    if advantages.ndim == 1:
        if advantages.shape[0] != log_prob.shape[0]:
            raise ValueError(f"per-sequence advantages must have shape [{log_prob.shape[0]}], got "
                             f"{tuple(advantages.shape)}")
        return advantages.unsqueeze(1)
    if tuple(advantages.shape) != tuple(log_prob.shape):
        raise ValueError(f"advantages must have shape [B] or {tuple(log_prob.shape)}, got {tuple(advantages.shape)}")
    return advantages


def trl_clip_indicators(
    coef: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, Tensor]:
    """TRL's ``is_low_clipped = (coef_1 < 1 − ε_low) & (A < 0)`` and ``is_high_clipped = (coef_1 > 1 + ε_high) &
    (A > 0)`` (``GRPOTrainer._compute_loss``), for any broadcastable shapes (:func:`trl_clip_terms`).

    Example:
        >>> low, high = trl_clip_indicators(torch.tensor([0.5, 1.5]), torch.tensor([-1.0, 1.0]), 0.2, 0.2)
        >>> low.tolist(), high.tolist()
        ([True, False], [False, True])
    """
    return (coef < 1 - epsilon_low) & (advantages < 0), (coef > 1 + epsilon_high) & (advantages > 0)


def trl_bound_is_ratio(ratio: Tensor, mode: str, clip_min: float | None, clip_max: float | None) -> Tensor:
    """TRL's vLLM importance-sampling ratio after its bounds (``_generate_and_score_completions``): ``*_truncate``
    clamps to ``[clip_min, clip_max]``, ``*_mask`` sets ratios outside to 0 (a missing bound is no bound), for
    :func:`trl_sampling_terms`.

    Example:
        >>> r = torch.tensor([0.5, 2.0, 4.0])
        >>> trl_bound_is_ratio(r, "token_truncate", 0.6, 3.0).tolist()
        [0.6000000238418579, 2.0, 3.0]
        >>> trl_bound_is_ratio(r, "token_mask", 0.6, 3.0).tolist()
        [0.0, 2.0, 0.0]
    """
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def _row_first(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Each sequence's first packed value (0 for an empty sequence)."""
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(values.device)
    if values.numel() == 0:
        return torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device)
    first = values.index_select(0, cu_seqlens[:-1].to(values.device).clamp(max=values.numel() - 1))
    return torch.where(lengths > 0, first, torch.zeros_like(first))


def trl_clip_units(coef: Tensor, advantages: Tensor, cu_seqlens: Tensor, per_sequence: bool) -> tuple[Tensor, Tensor]:
    """The ``(coef_1, advantage)`` pairs TRL's clip indicators compare, from packed valid tokens: the tokens', or
    with ``per_sequence`` one pair per sequence (TRL's ``(B, 1)`` sequence ratio against its ``(B,)``
    advantages; an empty sequence has ratio ``exp(0) = 1``, is never clipped, and counts)."""
    if not per_sequence:
        return coef, advantages
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(coef.device)
    ones = torch.ones_like(lengths, dtype=coef.dtype)
    return torch.where(lengths > 0, _row_first(coef, cu_seqlens), ones), _row_first(advantages, cu_seqlens)


def trl_clip_terms(
    coef: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    per_sequence: bool,
) -> dict[str, Tensor]:
    """TRL's ``clip_ratio/*`` indicators of packed valid tokens and their per-sequence reductions. The batch
    function :func:`trl_clip_ratio_metrics` and the streaming ``--names trl`` group both call it.

    Args:
        coef: ``[N]`` TRL's ``coef_1`` (:func:`trl_importance_ratio`).
        advantages: ``[N]`` each token's advantage.
        cu_seqlens: ``[B + 1]`` offsets.
        epsilon_low, epsilon_high: TRL's ``epsilon_low``, ``epsilon_high``.
        per_sequence: one indicator per sequence (:func:`trl_clip_units`), else one per token.

    Returns:
        ``low``, ``high``: the indicators (:func:`trl_clip_indicators`) of the units ``low_mean``/``high_mean``
        average over; per sequence (float64) ``units`` (how many it has), ``low_count``, ``high_count`` and
        ``low_fraction``, ``high_fraction`` (TRL's ``masked_seq_mean``: NaN for a sequence without a unit).
    """
    c, a = trl_clip_units(coef, advantages, cu_seqlens, per_sequence)
    low, high = trl_clip_indicators(c, a, epsilon_low, epsilon_high)
    if per_sequence:
        low64, high64 = low.to(F64), high.to(F64)
        return {"low": low, "high": high, "units": torch.ones_like(c), "low_count": low64, "high_count": high64,
                "low_fraction": low64, "high_fraction": high64}
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(coef.device)
    has = lengths > 0
    denom = lengths.to(F64).clamp(min=1.0)
    low_seq, high_seq = segment_sum(low.to(F64), cu_seqlens, F64), segment_sum(high.to(F64), cu_seqlens, F64)
    nan = torch.full_like(low_seq, math.nan)
    return {"low": low, "high": high, "units": lengths.to(F64), "low_count": low_seq, "high_count": high_seq,
            "low_fraction": torch.where(has, low_seq / denom, nan),
            "high_fraction": torch.where(has, high_seq / denom, nan)}


def _clip_inputs(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor, level: str
) -> tuple[Tensor, Tensor, Tensor, bool]:
    """Packed ``coef_1``, per-token advantages and offsets of padded inputs, and whether TRL's indicators are one
    per sequence: its ``(B, 1)`` ratio (sequence level, or ``T = 1``) against ``(B, 1)`` advantages."""
    m, cd = prepare(log_prob, mask, old_log_prob=old_log_prob)
    adv = _trl_advantages(advantages, log_prob).detach().to(cd)
    cu, (lp, old, adv_tokens) = pack(m, log_prob.detach().to(cd), old_log_prob.detach().to(cd),
                                     adv.expand(m.shape))
    coef = trl_importance_ratio(lp - old, cu, level)
    per_sequence = (level == "sequence" or m.shape[1] == 1) and adv.shape[1] == 1
    return coef, adv_tokens, cu, per_sequence


def trl_clip_ratio_metrics(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
) -> dict[str, float]:
    """TRL's ``clip_ratio/*`` for the clipped losses (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``).

    ``low = [coef_1 < 1 − ε_low ∧ A < 0]``, ``high = [coef_1 > 1 + ε_high ∧ A > 0]``: ``low_mean``,
    ``high_mean``, ``region_mean`` (low ∨ high) are TRL's ``global_masked_mean`` and ``low_min``/``high_max`` the
    ``nanmin``/``nanmax`` over sequences of its ``masked_seq_mean``. What those average over follows the shape of
    the indicator, as in TRL 1.16 ``GRPOTrainer._compute_loss``: ``coef_1`` is ``[B, T]`` at token level and
    ``[B, 1]`` (the sequence ratio) at sequence level; ``advantages`` is ``[B]`` (TRL's base GRPO, unsqueezed to
    ``[B, 1]``) or ``[B, T]`` (per token). Their broadcast is ``[B, 1]`` only at sequence level with ``[B]``
    advantages (or when ``T = 1``): the means then run over sequences, every row counting. Otherwise it is
    ``[B, T]``, and the means are masked token means (a sequence without a valid token is NaN in
    ``masked_seq_mean`` and skipped) — at sequence level the sequence ratio is compared with each token's advantage.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]])); adv = torch.tensor([[1.0, -1.0]])
        >>> trl_clip_ratio_metrics(lp, torch.zeros(1, 2), adv, torch.ones(1, 2))["region_mean"]
        1.0
    """
    eps_lo = check_real(epsilon_low, "epsilon_low", minimum=0.0)
    eps_hi = eps_lo if epsilon_high is None else check_real(epsilon_high, "epsilon_high", minimum=0.0)
    coef, adv, cu, per_sequence = _clip_inputs(log_prob, old_log_prob, advantages, mask, importance_sampling_level)
    t = trl_clip_terms(coef, adv, cu, epsilon_low=eps_lo, epsilon_high=eps_hi, per_sequence=per_sequence)
    low_seq, high_seq = t["low_fraction"], t["high_fraction"]
    low_seq, high_seq = low_seq[~torch.isnan(low_seq)], high_seq[~torch.isnan(high_seq)]
    return {
        "low_mean": packed_mean(t["low"]),
        "high_mean": packed_mean(t["high"]),
        "region_mean": packed_mean(t["low"] | t["high"]),
        "low_min": float(low_seq.min()) if low_seq.numel() else math.nan,
        "high_max": float(high_seq.max()) if high_seq.numel() else math.nan,
    }


def trl_cispo_clip_ratio(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_high: float,
    importance_sampling_level: str = "token",
) -> float:
    """TRL's ``cispo_clip_ratio``: ``global_masked_mean`` of ``[coef_1 > ε_high ∧ A > 0]``.

    TRL's CISPO caps the ratio at the absolute ``epsilon_high`` (recommended 5.0), and only a positive
    advantage can be limited by that cap, so the indicator is gated by the advantage sign. The mean runs over
    sequences or tokens as in :func:`trl_clip_ratio_metrics` (``advantages`` ``[B]`` or ``[B, T]``).

    Example:
        >>> lp = torch.log(torch.tensor([[6.0, 6.0]])); adv = torch.tensor([[1.0, -1.0]])
        >>> trl_cispo_clip_ratio(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), epsilon_high=5.0)
        0.5
    """
    eps_hi = check_real(epsilon_high, "epsilon_high", minimum=0.0)
    coef, adv, cu, per_sequence = _clip_inputs(log_prob, old_log_prob, advantages, mask, importance_sampling_level)
    c, a = trl_clip_units(coef, adv, cu, per_sequence)
    return packed_mean((c > eps_hi) & (a > 0))


_TRL_IS_MODES = TRL_VLLM_IS_MODES


def trl_sampling_metrics(
    old_log_prob: Tensor,
    sampling_log_prob: Tensor,
    mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """TRL's vLLM importance-sampling ratio and its ``sampling/*`` figures (``_generate_and_score_completions``).

    ``Δ = (ℓ_old − ℓ_sampling)·m`` with NaN (a token vLLM could not score) as 0; token modes use ``exp(Δ)``
    per token, sequence modes ``exp(Σ_t Δ)`` per row (shape ``[B, 1]``); ``*_truncate`` clamps to
    ``[clip_min, clip_max]``, ``*_mask`` zeroes ratios outside. The defaults are TRL 1.16's ``GRPOConfig``
    (``vllm_importance_sampling_mode="sequence_mask"``, ``clip_min=None``, ``clip_max=3.0``). Figures:

    - ``sampling_logp_difference/mean`` and ``/max``: mean and max of ``|ℓ_old − ℓ_sampling|`` over valid tokens
      that are not NaN (0 when none);
    - ``importance_sampling_ratio/{min,mean,max}``: over valid tokens (token modes) or all rows (sequence
      modes), 0 when empty.

    Returns:
        ``(ratio, figures)``: the ratio ``[B, T]`` or ``[B, 1]`` as TRL multiplies it into the loss.

    Example:
        >>> old = torch.tensor([[-1.0, -2.0]]); samp = torch.tensor([[-1.5, -1.0]])
        >>> _, f = trl_sampling_metrics(old, samp, torch.ones(1, 2))
        >>> f["sampling_logp_difference/mean"], f["sampling_logp_difference/max"]
        (0.75, 1.0)
    """
    if mode not in _TRL_IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling level: {mode}. Possible values are {_TRL_IS_MODES}.")
    m, cd = prepare(old_log_prob, mask, sampling_log_prob=sampling_log_prob)
    cu, (old, samp) = pack(m, old_log_prob.detach().to(cd), sampling_log_prob.detach().to(cd))
    t = trl_sampling_terms(old, samp, cu, mode=mode, clip_min=clip_min, clip_max=clip_max)
    delta, flat = t["logp_difference"], t["ratio"]
    empty = flat.numel() == 0
    out = {
        "sampling_logp_difference/mean": packed_mean(delta),
        "sampling_logp_difference/max": float(delta.max()) if delta.numel() else 0.0,
        "importance_sampling_ratio/min": 0.0 if empty else float(flat.min()),
        "importance_sampling_ratio/mean": packed_mean(flat),
        "importance_sampling_ratio/max": 0.0 if empty else float(flat.max()),
    }
    if mode.startswith("sequence"):
        return flat.reshape(-1, 1), out
    ratio = trl_bound_is_ratio(torch.ones_like(old_log_prob, dtype=cd), mode, clip_min, clip_max)  # exp(0) off the mask
    ratio[m] = flat
    return ratio, out


def trl_sampling_terms(
    old_log_prob: Tensor,
    sampling_log_prob: Tensor,
    cu_seqlens: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> dict[str, Tensor]:
    """TRL's vLLM importance-sampling ratio of packed valid tokens and the values its ``sampling/*`` figures
    reduce (``_generate_and_score_completions``). The batch function :func:`trl_sampling_metrics` and the
    streaming ``--names trl`` group both call it.

    Returns:
        ``logp_difference``: ``|ℓ_old − ℓ_sampling|`` of the tokens where it is not NaN; ``ratio``: per token
        ``exp(Δ)`` (token modes) or per sequence ``exp(Σ Δ)`` (sequence modes; an empty sequence ``exp(0)``), after
        :func:`trl_bound_is_ratio`, ``Δ = ℓ_old − ℓ_sampling`` with NaN as 0.
    """
    if mode not in _TRL_IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling level: {mode}. Possible values are {_TRL_IS_MODES}.")
    delta = old_log_prob - sampling_log_prob
    difference = delta.abs()[~torch.isnan(delta)]
    zeroed = torch.nan_to_num(delta, nan=0.0)
    log_w = segment_sum(zeroed, cu_seqlens, F64).to(delta.dtype) if mode.startswith("sequence") else zeroed
    return {"logp_difference": difference, "ratio": trl_bound_is_ratio(torch.exp(log_w), mode, clip_min, clip_max)}
