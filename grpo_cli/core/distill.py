"""AReaL's joint knowledge distillation (``grpo_loss_fn`` with a ``teacher_logp``, in AReaL's
``areal/engine/ppo/actor.py``).

With ``m`` the loss mask, ``N = max(Σm, 1)``, ℓθ the policy, ℓT the teacher and ℓb the behaviour log-probs:

* ``rl_loss_weight > 0``: ``loss = w_rl·loss_RL + w_d·Σ m·(ℓθ − ℓT) / N`` — the single-sample (k1) estimate of the
  reverse KL(π_θ ‖ π_T) on tokens sampled from π_θ, added to the RL loss;
* ``rl_loss_weight = 0``: ``loss = −w_d·Σ m·exp(ℓθ − ℓb)·(ℓT − sg(ℓθ)) / N`` — the RL loss is dropped and the
  reverse KL is importance-sampled from the behaviour policy, a policy gradient with reward ``ℓT − ℓθ``:
  ``∂loss/∂ℓθ_t = −w_d·m_t·exp(ℓθ_t − ℓb_t)·(ℓT_t − ℓθ_t)/N`` (``sg`` = stop-gradient).

AReaL's defaults are ``rl_loss_weight = 1.0`` and ``distill_loss_weight = 0.005``. Elementwise math runs in the
log-probs' dtype (float16 through float32), sums in float64; masked positions are neutralised with ``torch.where``,
so garbage there (NaN teacher log-probs on prompt tokens) never reaches the loss or its gradient. Padded ``[B, T]``
and packed ``[N]`` inputs are the same to these elementwise formulas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_real, check_same_shape, compute_dtype, masked_sum64

__all__ = [
    "DEFAULT_DISTILL_LOSS_WEIGHT",
    "DEFAULT_RL_LOSS_WEIGHT",
    "distill_loss",
    "distill_loss_terms",
    "joint_distill_loss",
]

DEFAULT_RL_LOSS_WEIGHT = 1.0
"""AReaL's ``rl_loss_weight`` default."""
DEFAULT_DISTILL_LOSS_WEIGHT = 0.005
"""AReaL's ``distill_loss_weight`` default."""


def distill_loss_terms(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    rl_loss_weight: float = DEFAULT_RL_LOSS_WEIGHT,
    distill_loss_weight: float = DEFAULT_DISTILL_LOSS_WEIGHT,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(numerator, count, stats)`` of the distillation term: ``numerator / max(count, 1)`` is :func:`distill_loss`.

    ``numerator`` is a float64 scalar carrying the gradient to ``logprobs``; ``count`` the raw float64 number of
    valid tokens (so terms of batches of whole sequences add up). ``stats``: ``rkl`` = ``ℓθ − ℓT`` per token
    (detached, 0 at masked positions; AReaL's ``rkl_loss`` statistic), ``rkl_sum`` its float64 sum, and with
    ``rl_loss_weight = 0`` ``importance_weight`` = ``exp(ℓθ − ℓb)`` (detached, 0 at masked positions).
    """
    w_rl = check_real(rl_loss_weight, "rl_loss_weight", minimum=0.0)
    w_d = check_real(distill_loss_weight, "distill_loss_weight", minimum=0.0)
    if not isinstance(logprobs, Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    check_same_shape("logprobs", logprobs, teacher_logprobs=teacher_logprobs, loss_mask=loss_mask,
                     old_logprobs=old_logprobs)
    if w_rl == 0.0 and old_logprobs is None:
        raise ValueError("old_logprobs is required when rl_loss_weight == 0 (the importance-sampled form)")
    m = as_bool_mask(loss_mask.to(logprobs.device))
    cd = compute_dtype(logprobs.dtype)
    zero = torch.zeros((), dtype=cd, device=logprobs.device)
    lp = logprobs.to(cd)
    teacher = torch.where(m, teacher_logprobs.to(device=lp.device, dtype=cd), zero)
    rkl = torch.where(m, lp - teacher, zero)
    stats: dict[str, Any] = {"rkl": rkl.detach(), "rkl_sum": masked_sum64(rkl.detach(), m)}
    if w_rl == 0.0:
        assert old_logprobs is not None
        old = torch.where(m, old_logprobs.to(device=lp.device, dtype=cd), zero)
        weight = torch.exp(torch.where(m, lp - old, zero))  # exp(ℓθ − ℓb), carries the gradient
        # −w_d·r·(ℓT − sg ℓθ): only the weight is differentiated (AReaL's importance-sampled reverse KL).
        per_token = -w_d * weight * (teacher - lp.detach())
        stats["importance_weight"] = torch.where(m, weight.detach(), zero)
    else:
        per_token = w_d * rkl
    return masked_sum64(per_token, m), m.sum().to(torch.float64), stats


def distill_loss(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    rl_loss_weight: float = DEFAULT_RL_LOSS_WEIGHT,
    distill_loss_weight: float = DEFAULT_DISTILL_LOSS_WEIGHT,
) -> tuple[Tensor, dict[str, Any]]:
    """AReaL's distillation term alone: ``w_d·Σm(ℓθ − ℓT)/N``, or its importance-sampled form when ``w_rl = 0``.

    Args:
        logprobs: π_θ log-probs (carry the gradient), padded ``[B, T]`` or packed ``[N]``.
        teacher_logprobs: teacher log-probs of the same tokens.
        loss_mask: bool or 0/1 mask of the tokens in the loss.
        old_logprobs: behaviour log-probs, required when ``rl_loss_weight == 0``.
        rl_loss_weight: w_rl (≥ 0); 0 selects the importance-sampled form.
        distill_loss_weight: w_d (≥ 0).

    Returns:
        ``(loss, stats)`` with ``loss`` a scalar in ``logprobs``' dtype and ``stats`` as in
        :func:`distill_loss_terms`.

    Example (w_d = 1: mean of ℓθ − ℓT over the valid tokens, (−1 − (−2) + 0)/2):
        >>> lp, teacher = torch.tensor([-1.0, -1.0, -5.0]), torch.tensor([-2.0, -1.0, 9.0])
        >>> distill_loss(lp, teacher, torch.tensor([1, 1, 0]), distill_loss_weight=1.0)[0].item()
        0.5
    """
    num, den, stats = distill_loss_terms(
        logprobs,
        teacher_logprobs,
        loss_mask,
        old_logprobs=old_logprobs,
        rl_loss_weight=rl_loss_weight,
        distill_loss_weight=distill_loss_weight,
    )
    return (num / den.clamp(min=1.0)).to(logprobs.dtype), stats


def joint_distill_loss(
    rl_loss: Tensor,
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    rl_loss_weight: float = DEFAULT_RL_LOSS_WEIGHT,
    distill_loss_weight: float = DEFAULT_DISTILL_LOSS_WEIGHT,
) -> tuple[Tensor, dict[str, Any]]:
    """AReaL's joint loss: ``w_rl·rl_loss + distill_loss(...)``, or the distillation term alone when ``w_rl = 0``.

    ``rl_loss`` is the scalar RL loss of the same tokens (e.g. :func:`~grpo_cli.core.ppo.ppo_actor_loss`).

    Example:
        >>> lp, teacher, m = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([1])
        >>> joint_distill_loss(torch.tensor(0.5), lp, teacher, m, rl_loss_weight=2.0,
        ...                    distill_loss_weight=0.25)[0].item()  # 2·0.5 + 0.25·2
        1.5
    """
    if not isinstance(rl_loss, Tensor):
        raise TypeError(f"rl_loss must be a torch.Tensor, got {type(rl_loss).__name__}")
    kd, stats = distill_loss(
        logprobs,
        teacher_logprobs,
        loss_mask,
        old_logprobs=old_logprobs,
        rl_loss_weight=rl_loss_weight,
        distill_loss_weight=distill_loss_weight,
    )
    w_rl = check_real(rl_loss_weight, "rl_loss_weight", minimum=0.0)
    if w_rl == 0.0:
        return kd, stats
    return (w_rl * rl_loss.to(kd.dtype) + kd), stats
