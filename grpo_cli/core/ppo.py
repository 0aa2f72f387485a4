"""AReaL's actor losses: decoupled PPO (token or GSPO sequence ratios, asymmetric and dual clip), SAPO, CISPO.

Reference: AReaL ``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn``, the GSPO sequence ratio,
``sapo_loss_fn`` and ``cispo_loss_fn``. Every loss is ``numerator / denominator`` with ``numerator = Σ_valid L``
(float64) and ``denominator = N0``, the valid-token count taken *before* rejection sampling. The ``*_terms`` functions
return both (the denominator as the raw count, so terms add up over batches of whole sequences); the loss
functions divide by ``max(N0, 1)`` as AReaL does. Inputs are padded ``[B, T]`` or packed ``[N]`` with
``cu_seqlens`` (needed for sequence-level work on packed input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
    check_same_shape,
    compute_dtype,
    fill_outside,
    flat_layout,
    masked_sum64,
    seq_count,
    seq_ids,
    seq_sum64,
    sigmoid,
)
from grpo_cli.core.conventions import check_convention
from grpo_cli.core.rejection import RejectionSamplingConfig, apply_rejection_sampling

__all__ = [
    "PPO_CONVENTIONS",
    "cispo_loss",
    "cispo_loss_terms",
    "ppo_actor_loss",
    "ppo_actor_loss_terms",
    "sapo_loss",
    "sapo_loss_terms",
    "sequence_ratio_and_advantages",
]

_IS_LEVELS = ("token", "sequence")
PPO_CONVENTIONS: tuple[str, ...] = ("areal",)
"""``convention`` values of :func:`ppo_actor_loss`: ``"areal"`` is AReaL 1.0.4, whose token ratio and clip masks
(statistics only) use the mask *after* rejection sampling; grpo-cli's default uses the mask before it, as AReaL's
later ``ppo_actor_loss_fn`` does (``stat_loss_mask``)."""


def _check_level(level: str) -> None:
    if level not in _IS_LEVELS:
        raise ValueError(f"Invalid importance_sampling_level: {level}. Must be 'token' or 'sequence'.")


def sequence_ratio_and_advantages(
    log_ratio: Tensor, advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor]:
    """GSPO sequence ratio and mean advantage broadcast to tokens.

    AReaL ``_compute_sequence_level_ratio_and_advantages``.

    Per sequence ``s`` (rows of ``[B, T]``, ``cu_seqlens`` segments of ``[N]``) with ``n_s = max(Σm, 1)``:
    ``ρ_s = exp(Σ_m log_ratio / n_s)`` and ``Ā_s = Σ_m A / n_s``; every valid token gets ``(ρ_s, Ā_s)``,
    every other token ``(0, 0)``. Gradients reach each valid token's log-ratio through ``ρ_s``
    (``∂ρ_s/∂log_ratio_t = ρ_s / n_s``). Masked advantages never enter ``Ā`` (AReaL PR #1346).

    Raises:
        ValueError: packed 1-D input without ``cu_seqlens``, mismatched shapes, a bad mask.
    """
    m = as_bool_mask(loss_mask, "loss_mask")
    check_same_shape("log_ratio", log_ratio, advantages=advantages, loss_mask=m)
    cu = flat_layout(log_ratio, cu_seqlens, need_segments=True, what="sequence-level importance sampling")
    assert cu is not None
    mflat = m.reshape(-1)
    lr, adv = log_ratio.reshape(-1), advantages.reshape(-1)
    ids = seq_ids(cu, lr.numel())
    n_s = seq_count(mflat, cu).clamp(min=1).to(torch.float64)
    rho = torch.exp(seq_sum64(lr, mflat, cu) / n_s).to(lr.dtype)[ids]
    a_bar = (seq_sum64(adv, mflat, cu) / n_s).to(adv.dtype)[ids]
    ratio = fill_outside(mflat, rho, torch.zeros_like(rho))
    adv_out = fill_outside(mflat, a_bar, torch.zeros_like(a_bar))
    return ratio.reshape(log_ratio.shape), adv_out.reshape(advantages.shape)


def _prepare(
    logprobs: Tensor,
    others: dict[str, Tensor | None],
    loss_mask: Tensor,
) -> tuple[Tensor, torch.dtype, dict[str, Tensor | None]]:
    """Bool mask, working dtype and working-dtype copies of the other per-token inputs."""
    if not isinstance(logprobs, Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    if logprobs.ndim not in (1, 2):
        raise ValueError(f"Expected 1D (packed) or 2D (padded) tensors, got ndim={logprobs.ndim}")
    m = as_bool_mask(loss_mask, "loss_mask")
    check_same_shape("logprobs", logprobs, loss_mask=m, **others)
    cd = compute_dtype(logprobs.dtype)
    return m, cd, {k: None if v is None else v.to(cd) for k, v in others.items()}


def _behave_stats(
    prox: Tensor, behave: Tensor, weight: Tensor, mask_after: Tensor, filtered_fraction: float
) -> dict[str, Any]:
    behave_mask = (weight > 0) & mask_after
    kl = torch.where(
        behave_mask, prox.detach() - behave.detach(), torch.zeros((), dtype=prox.dtype, device=prox.device)
    )
    return {
        "behave_approx_kl": kl,
        "behave_imp_weight": weight.detach(),
        "behave_mask": behave_mask,
        "filtered_fraction": filtered_fraction,
    }


def ppo_actor_loss_terms(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    loss_mask: Tensor,
    *,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
    convention: str | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(numerator, denominator, stats)`` of :func:`ppo_actor_loss` (float64 scalars; raw ``N0``)."""
    conv = check_convention(convention, PPO_CONVENTIONS, "ppo_actor_loss")
    _check_level(importance_sampling_level)
    eps_lo = check_real(eps_clip, "eps_clip", minimum=0.0)
    eps_hi = eps_lo if eps_clip_higher is None else check_real(eps_clip_higher, "eps_clip_higher", minimum=0.0)
    if c_clip is not None and check_real(c_clip, "c_clip") <= 1.0:
        raise ValueError(f"c_clip must be > 1.0 (dual clipping), got {c_clip}")
    m, cd, t = _prepare(
        logprobs,
        {"proximal_logprobs": proximal_logprobs, "old_logprobs": old_logprobs, "advantages": advantages},
        loss_mask,
    )
    lp, prox, adv = logprobs.to(cd), t["proximal_logprobs"], t["advantages"]
    assert prox is not None and adv is not None
    zero = torch.zeros((), dtype=cd, device=lp.device)
    # N0 before rejection sampling (AReaL PR #1088): rejected tokens stay in the denominator.
    n0 = m.sum().to(torch.float64)
    m_stat = m
    if rejection_sampling is not None:
        m, w_b, filtered_fraction = apply_rejection_sampling(prox, old_logprobs, m, cu_seqlens, rejection_sampling)
        if conv == "areal":
            m_stat = m  # AReaL 1.0.4: ratio and clip masks on the post-filter mask

    # Neutralise off-mask entries before exp so garbage there cannot give inf·0 = NaN gradients.
    log_ratio = fill_outside(m_stat, lp - prox, zero)
    if importance_sampling_level == "sequence":
        ratio, adv_used = sequence_ratio_and_advantages(log_ratio, fill_outside(m, adv, zero), m, cu_seqlens)
    else:
        ratio = fill_outside(m_stat, torch.exp(log_ratio), zero)
        adv_used = fill_outside(m_stat, adv, zero)

    # AReaL ``ppo_actor_loss_fn``: L = max(-A·r, -A·clip(r, 1-ε, 1+ε_hi)); clip mask = strict L1 < L2.
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    loss1 = -adv_used * ratio
    loss2 = -adv_used * clipped_ratio
    clip_mask = loss1.detach() < loss2.detach()
    per_token = torch.maximum(loss1, loss2)
    if c_clip is not None:
        # Dual clip: L3 = sign(A)·c·A = c·|A|, only ever binding for A < 0 with r > c.
        loss3 = torch.sign(adv_used) * c_clip * adv_used
        dual_clip_mask = loss3.detach() < per_token.detach()
        per_token = torch.minimum(per_token, loss3)
    else:
        dual_clip_mask = torch.zeros_like(clip_mask)

    stats: dict[str, Any] = {}
    if rejection_sampling is not None:
        w_b = w_b.to(cd)
        stats.update(_behave_stats(prox, old_logprobs.to(cd), w_b, m, filtered_fraction))
        per_token = per_token * w_b
    numerator = masked_sum64(per_token, m)
    n_total = float(m_stat.numel())
    n_valid = float(n0)
    stats = {
        "loss": per_token.detach(),
        "importance_weight": ratio.detach(),
        "approx_kl": (lp - prox).detach(),
        "clip_mask": clip_mask & m_stat,
        "dual_clip_mask": dual_clip_mask & m_stat,
        "n_total_tokens": n_total,
        "n_valid_tokens": n_valid,
        "n_masked_tokens": n_total - n_valid,
        "masked_token_ratio": 1.0 - n_valid / max(n_total, 1.0),
        **stats,
    }
    return numerator, n0, stats


def ppo_actor_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    loss_mask: Tensor,
    *,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
    convention: str | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """AReaL's decoupled PPO actor loss (``ppo_actor_loss_fn`` in ``areal/utils/functional/functional.py``).

    ``N0 = count(m)`` before rejection sampling; with ``rejection_sampling`` the mask narrows to ``m'`` and
    the behaviour weight ``w_b = π_prox/π_behave`` (from :func:`apply_rejection_sampling`) multiplies the
    loss. Ratio ``r = exp(ℓθ - ℓp)`` per token (on the pre-filter mask) or the GSPO sequence geometric mean
    (``importance_sampling_level="sequence"``, on ``m'``, with the sequence-mean advantage).
    ``L = max(-A·r, -A·clip(r, 1-ε, 1+ε_hi))``; with ``c_clip``: ``L = min(L, c·|A|)``.
    ``loss = Σ_{m'} L·w_b / max(N0, 1)``.

    Args:
        logprobs: π_θ log-probs (carry the gradient), ``[B, T]`` or ``[N]``.
        proximal_logprobs: π_prox log-probs (the ratio's base).
        old_logprobs: π_behave log-probs (only used by rejection sampling).
        advantages: per-token advantages.
        eps_clip: ε (lower clip, and upper when ``eps_clip_higher`` is None).
        loss_mask: bool or 0/1 mask of the tokens in the loss.
        eps_clip_higher: ε_hi for the upper clip (DAPO clip-higher).
        c_clip: dual-clip constant ``> 1`` or None.
        rejection_sampling: a :class:`RejectionSamplingConfig` or None.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        cu_seqlens: ``[B + 1]`` offsets for packed input (needed for sequence-level work).
        convention: ``None`` (grpo-cli: token ratio and clip masks on the pre-filter mask, as AReaL after
            1.0.4) or ``"areal"`` (AReaL 1.0.4: on the post-filter mask, so ``importance_weight`` is 0 and no
            clip is counted at rejected tokens). Loss and gradient are the same.

    Returns:
        ``(loss, stats)``: ``loss`` a scalar in ``logprobs``' dtype; ``stats`` with per-token ``loss`` (after
        ``w_b``, before masking), ``importance_weight``, ``approx_kl`` (ℓθ − ℓp), ``clip_mask``,
        ``dual_clip_mask`` (both ∧ the pre-filter mask), Python floats ``n_total_tokens``,
        ``n_valid_tokens``, ``n_masked_tokens``, ``masked_token_ratio``, and with rejection sampling
        ``behave_imp_weight``, ``behave_approx_kl``, ``behave_mask`` and ``filtered_fraction``.

    Raises:
        ValueError: a bad ``importance_sampling_level``, ``c_clip <= 1``, negative ε, mismatched shapes,
            a mask that is not bool/0-1, packed sequence-level input without ``cu_seqlens``.

    Example:
        >>> lp = torch.log(torch.tensor([1.5, 0.5])); zero = torch.zeros(2)
        >>> m = torch.ones(2, dtype=torch.bool)
        >>> loss, st = ppo_actor_loss(lp, zero, zero, torch.tensor([1.0, -1.0]), 0.2, m)
        >>> round(loss.item(), 6), st["clip_mask"].tolist()  # (-1.2 + 0.8) / 2
        (-0.2, [True, True])
    """
    num, den, stats = ppo_actor_loss_terms(
        logprobs,
        proximal_logprobs,
        old_logprobs,
        advantages,
        eps_clip,
        loss_mask,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level,
        cu_seqlens=cu_seqlens,
        convention=convention,
    )
    return (num / den.clamp(min=1.0)).to(logprobs.dtype), stats


def sapo_loss_terms(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(numerator, denominator, stats)`` of :func:`sapo_loss` (float64 scalars; raw ``N0``)."""
    tp = check_real(tau_pos, "tau_pos")
    tn = check_real(tau_neg, "tau_neg")
    if tp <= 0 or tn <= 0:
        raise ValueError("SAPO temperatures (tau_pos, tau_neg) must be positive.")
    _check_level(importance_sampling_level)
    m, cd, t = _prepare(logprobs, {"old_logprobs": old_logprobs, "advantages": advantages}, loss_mask)
    lp, old, adv = logprobs.to(cd), t["old_logprobs"], t["advantages"]
    assert old is not None and adv is not None
    zero = torch.zeros((), dtype=cd, device=lp.device)
    n0 = m.sum().to(torch.float64)
    adv = fill_outside(m, adv.detach(), zero)
    log_ratio = fill_outside(m, lp - old, zero)
    if importance_sampling_level == "sequence":
        ratio, adv = sequence_ratio_and_advantages(log_ratio, adv, m, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    # SAPO (arXiv 2511.20347, AReaL ``sapo_loss_fn``): gate σ(τ(r-1))·4/τ, τ₊ for A > 0 and τ₋ otherwise; L = -gate·A.
    gate_pos = sigmoid(tp * (ratio - 1.0)) * (4.0 / tp)
    gate_neg = sigmoid(tn * (ratio - 1.0)) * (4.0 / tn)
    gate = torch.where(adv > 0, gate_pos, gate_neg)
    per_token = -gate * adv
    stats = {
        "loss": per_token.detach(),
        "importance_weight": ratio.detach(),
        "approx_kl": (lp - old).detach(),
        "clip_mask": torch.zeros_like(m),
        "dual_clip_mask": torch.zeros_like(m),
        "sapo_soft_gate": gate.detach(),
        "sapo_scaled_gate_pos": gate_pos.detach(),
        "sapo_scaled_gate_neg": gate_neg.detach(),
    }
    return masked_sum64(per_token, m), n0, stats


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """AReaL's SAPO loss (``sapo_loss_fn``, ``areal/utils/functional/functional.py``): soft sigmoid gates, no hard clip.

    ``r = exp(ℓθ − ℓold)`` (or the GSPO sequence ratio with the sequence-mean advantage);
    ``g± = σ(τ±·(r − 1))·4/τ±``, ``gate = g₊`` where ``A > 0`` else ``g₋``; ``L = −gate·A`` (A detached);
    ``loss = Σ_m L / max(N0, 1)``. ``dL/dℓθ = −4σ(1−σ)·r·A``, i.e. ``−A`` at ``r = 1`` for any τ.

    Stats: ``loss``, ``importance_weight`` (= r; 1 at masked tokens, whose log-ratio is neutralised),
    ``approx_kl`` (ℓθ − ℓold), all-False ``clip_mask``/``dual_clip_mask``, ``sapo_soft_gate``,
    ``sapo_scaled_gate_pos``, ``sapo_scaled_gate_neg``.

    Raises:
        ValueError: ``tau_pos <= 0`` or ``tau_neg <= 0`` ("must be positive"), a bad level, bad shapes/mask.

    Example:
        >>> loss, _ = sapo_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -2.0]), 1.0, 1.05,
        ...                     torch.ones(2, dtype=torch.bool))
        >>> round(loss.item(), 6)  # r = 1: gates 2 and 2/1.05 → (-2 + 2·2/1.05) / 2
        0.904762
    """
    num, den, stats = sapo_loss_terms(
        logprobs, old_logprobs, advantages, tau_pos, tau_neg, loss_mask, importance_sampling_level, cu_seqlens
    )
    return (num / den.clamp(min=1.0)).to(logprobs.dtype), stats


def cispo_loss_terms(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    eps_clip: float,
    loss_mask: Tensor,
    *,
    eps_clip_higher: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(numerator, denominator, stats)`` of :func:`cispo_loss` (float64 scalars; raw ``N0``)."""
    if eps_clip_higher is None or check_real(eps_clip_higher, "eps_clip_higher") <= 0:
        raise ValueError(
            "CISPO requires a positive eps_clip_higher; the asymmetric upper clip is the defining knob "
            f"(MiniMax-M1 Eq. 4-5). Got {eps_clip_higher!r}."
        )
    eps_hi = float(eps_clip_higher)
    eps_lo = check_real(eps_clip, "eps_clip", minimum=0.0)
    _check_level(importance_sampling_level)
    if importance_sampling_level != "token":
        raise ValueError("CISPO is token level only (importance_sampling_level='token').")
    if rejection_sampling is not None and old_logprobs is None:
        raise ValueError("old_logprobs is required when rejection_sampling is set")
    m, cd, t = _prepare(
        logprobs,
        {"proximal_logprobs": proximal_logprobs, "old_logprobs": old_logprobs, "advantages": advantages},
        loss_mask,
    )
    lp, prox, adv = logprobs.to(cd), t["proximal_logprobs"], t["advantages"]
    assert prox is not None and adv is not None
    zero = torch.zeros((), dtype=cd, device=lp.device)
    n0 = m.sum().to(torch.float64)
    m_stat = m
    if rejection_sampling is not None:
        assert old_logprobs is not None
        m, w_b, filtered_fraction = apply_rejection_sampling(prox, old_logprobs, m, cu_seqlens, rejection_sampling)
    adv = fill_outside(m, adv.detach(), zero)
    log_ratio = fill_outside(m, lp - prox, zero).detach()
    ratio = torch.exp(log_ratio)
    # The importance_weight statistic is exp(ℓθ − ℓp) on the pre-filter mask (0 elsewhere), as AReaL's
    # statistics mask: a token rejection sampling drops still shows its ratio, not 1.
    stat_log_ratio = fill_outside(m_stat, lp - prox, zero).detach()
    importance_weight = fill_outside(m_stat, torch.exp(stat_log_ratio), zero)
    # CISPO (MiniMax-M1 Eq. 4-5, AReaL ``cispo_loss_fn``): L = -sg(clip(r, 1-ε, 1+ε_hi))·A·ℓθ; gradient only via ℓθ.
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi).detach()
    per_token = -clipped * adv * fill_outside(m, lp, zero)
    stats: dict[str, Any] = {}
    if rejection_sampling is not None:
        w_b = w_b.to(cd)
        assert t["old_logprobs"] is not None
        stats.update(_behave_stats(prox, t["old_logprobs"], w_b, m, filtered_fraction))
        per_token = per_token * w_b
    stats = {
        "loss": per_token.detach(),
        "importance_weight": importance_weight,
        "approx_kl": (lp - prox).detach(),
        "clip_mask": (clipped != ratio) & m,
        "dual_clip_mask": torch.zeros_like(m),
        **stats,
    }
    return masked_sum64(per_token, m), n0, stats


def cispo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    eps_clip: float,
    loss_mask: Tensor,
    *,
    eps_clip_higher: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """AReaL's CISPO loss (``cispo_loss_fn``, MiniMax-M1) with ``ppo_actor_loss``'s arguments.

    ``r = exp(sg(ℓθ − ℓp))``, ``rc = sg(clip(r, 1 − ε, 1 + ε_hi))``, ``L = −rc·A·ℓθ`` (A detached), times
    ``w_b`` with rejection sampling; ``loss = Σ_{m'} L / max(N0, 1)`` with ``N0`` counted before rejection.
    The value is a REINFORCE-style surrogate (it depends on ℓθ itself), so it is not comparable to PPO loss
    values; its gradient is ``−rc·A·w_b / N0`` on valid tokens and nothing reaches ℓp or ℓb.

    Stats: ``loss``, ``importance_weight`` (unclipped ``exp(ℓθ − ℓp)`` on the mask *before* rejection sampling,
    0 elsewhere; averaged over that mask it is AReaL's figure), ``approx_kl`` (ℓθ − ℓp), ``clip_mask`` =
    ``(rc ≠ r) ∧ m'`` (post-filter), all-False ``dual_clip_mask``, and the behave keys with rejection.

    Raises:
        ValueError: ``eps_clip_higher`` None or ``<= 0`` (as AReaL), a sequence level, rejection sampling
            without ``old_logprobs``, bad shapes or mask.

    Example:
        >>> loss, st = cispo_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), None, torch.tensor([2.0]), 0.2,
        ...                       torch.tensor([True]), eps_clip_higher=0.28)
        >>> loss.item()  # -1·2·(-1)
        2.0
    """
    num, den, stats = cispo_loss_terms(
        logprobs,
        proximal_logprobs,
        old_logprobs,
        advantages,
        eps_clip,
        loss_mask,
        eps_clip_higher=eps_clip_higher,
        rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level,
        cu_seqlens=cu_seqlens,
    )
    return (num / den.clamp(min=1.0)).to(logprobs.dtype), stats
