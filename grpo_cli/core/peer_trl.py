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
    masked_max,
    masked_mean,
    prepare,
    row_means,
    where,
)
from grpo_cli.core.kl import kl_estimate

__all__ = [
    "trl_bound_is_ratio",
    "trl_cispo_clip_ratio",
    "trl_clip_indicators",
    "trl_clip_ratio_metrics",
    "trl_logged_kl",
    "trl_sampling_metrics",
]


def _trl_coef(log_prob: Tensor, old_log_prob: Tensor, m: Tensor, cd: torch.dtype, level: str) -> Tensor:
    """TRL's ``coef_1``: ``exp(ℓ − ℓ_old)`` per token, or the sequence mean log-ratio broadcast (no clamp)."""
    log_ratio = where(m, log_prob.to(cd) - old_log_prob.detach().to(cd))
    if level == "token":
        return torch.exp(log_ratio)
    if level != "sequence":
        raise ValueError(f"Unknown importance sampling level: {level}. Possible values are 'token' and 'sequence'.")
    n = m.sum(-1, keepdim=True).to(F64).clamp(min=1.0)
    seq = (log_ratio.to(F64).sum(-1, keepdim=True) / n).to(cd)
    return torch.exp(seq).expand_as(log_ratio)


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
    lp = where(m, log_prob.detach().to(cd))
    k3 = kl_estimate(lp, where(m, ref_log_prob.detach().to(cd)), "k3")
    if use_bias_correction_kl and old_log_prob is not None:
        k3 = k3 * _trl_coef(lp, old_log_prob, m, cd, importance_sampling_level)
    return masked_mean(k3, m)


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
    (A > 0)`` (``GRPOTrainer._compute_loss``), for any broadcastable shapes: the batch figures
    (:func:`trl_clip_ratio_metrics`) and the streaming ``--names trl`` group both call it.

    Example:
        >>> low, high = trl_clip_indicators(torch.tensor([0.5, 1.5]), torch.tensor([-1.0, 1.0]), 0.2, 0.2)
        >>> low.tolist(), high.tolist()
        ([True, False], [False, True])
    """
    return (coef < 1 - epsilon_low) & (advantages < 0), (coef > 1 + epsilon_high) & (advantages > 0)


def trl_bound_is_ratio(ratio: Tensor, mode: str, clip_min: float | None, clip_max: float | None) -> Tensor:
    """TRL's vLLM importance-sampling ratio after its bounds (``_generate_and_score_completions``): ``*_truncate``
    clamps to ``[clip_min, clip_max]``, ``*_mask`` sets ratios outside to 0 (a missing bound is no bound). The
    batch figures (:func:`trl_sampling_metrics`) and the streaming ``--names trl`` group both call it.

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


def _trl_indicator_means(x: Tensor, m: Tensor) -> tuple[float, Tensor]:
    """TRL's ``global_masked_mean`` and ``masked_seq_mean`` of an indicator ``x`` (``[B, 1]`` or ``[B, T]``): a
    ``[B, 1]`` one is one value per sequence (every row counts, the mask is not read); a wider one is masked token
    means (``masked_seq_mean``: NaN for a row without a valid token)."""
    if x.shape[1] == 1:
        rows = x.to(F64).reshape(-1)
        return (float(rows.mean()) if rows.numel() else 0.0), rows
    n = m.sum(-1)
    return masked_mean(x, m), row_means(x, m)[n > 0]


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
    m, cd = prepare(log_prob, mask, old_log_prob=old_log_prob)
    coef = _trl_coef(log_prob.detach(), old_log_prob, m, cd, importance_sampling_level)
    if importance_sampling_level == "sequence":
        coef = coef[:, :1]  # TRL's (B, 1) sequence ratio
    adv = _trl_advantages(advantages, log_prob).detach().to(cd)
    low, high = trl_clip_indicators(coef, adv, eps_lo, eps_hi)
    low_mean, low_seq = _trl_indicator_means(low, m)
    high_mean, high_seq = _trl_indicator_means(high, m)
    region_mean, _ = _trl_indicator_means(low | high, m)
    low_seq, high_seq = low_seq[~torch.isnan(low_seq)], high_seq[~torch.isnan(high_seq)]
    return {
        "low_mean": low_mean,
        "high_mean": high_mean,
        "region_mean": region_mean,
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
    m, cd = prepare(log_prob, mask, old_log_prob=old_log_prob)
    coef = _trl_coef(log_prob.detach(), old_log_prob, m, cd, importance_sampling_level)
    if importance_sampling_level == "sequence":
        coef = coef[:, :1]
    clipped = (coef > eps_hi) & (_trl_advantages(advantages, log_prob).detach().to(cd) > 0)
    return _trl_indicator_means(clipped, m)[0]


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
    old, samp = old_log_prob.detach().to(cd), sampling_log_prob.detach().to(cd)
    diff = torch.nan_to_num(where(m, old - samp), nan=0.0)
    sequence = mode.startswith("sequence")
    log_w = diff.to(F64).sum(-1, keepdim=True).to(cd) if sequence else diff
    ratio = trl_bound_is_ratio(torch.exp(log_w), mode, clip_min, clip_max)
    delta = (old - samp).abs()
    keep = m & ~torch.isnan(delta)
    n = int(keep.sum())
    out = {
        "sampling_logp_difference/mean": masked_mean(delta, keep) if n else 0.0,
        "sampling_logp_difference/max": masked_max(delta, keep) if n else 0.0,
    }
    flat = ratio.reshape(-1).to(F64) if sequence else ratio[m].to(F64)
    empty = flat.numel() == 0
    out["importance_sampling_ratio/min"] = 0.0 if empty else float(flat.min())
    out["importance_sampling_ratio/mean"] = 0.0 if empty else float(flat.mean())
    out["importance_sampling_ratio/max"] = 0.0 if empty else float(flat.max())
    return ratio, out
