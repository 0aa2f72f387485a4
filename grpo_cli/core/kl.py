"""Per-token KL estimators k1, k2, k3 and abs (Schulman's estimators, as AReaL's ``KLEstimator`` and verl)."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import check_real, check_same_shape

__all__ = ["KL_KINDS", "kl_estimate", "kl_from_log_ratio"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")


def kl_from_log_ratio(delta: Tensor, kind: str) -> Tensor:
    """Estimator value from ``delta = log p - log p_base`` in ``delta``'s dtype (differentiable).

    - ``k1 = delta`` (AReaL/verl ``k1``)
    - ``k2 = delta**2 / 2`` (AReaL/verl ``k2``/``mse``)
    - ``k3 = exp(-delta) - 1 + delta`` (AReaL ``k3``; verl ``low_var_kl`` before its clamp; twinkle/TRL's
      loss KL ``exp(ref - new) - (ref - new) - 1`` with ``delta = new - ref``)
    - ``abs = |delta|`` (verl ``abs``)
    """
    if kind == "k1":
        return delta
    if kind == "k2":
        return delta * delta / 2
    if kind == "k3":
        # expm1 keeps k3 accurate near delta = 0, where exp(-d) - 1 + d cancels catastrophically.
        return torch.expm1(-delta) + delta
    if kind == "abs":
        return delta.abs()
    raise ValueError(f"Unknown KL estimator '{kind}'; choose one of {KL_KINDS}")


def kl_estimate(log_probs: Tensor, log_probs_base: Tensor, kind: str, clamp: float | None = None) -> Tensor:
    """Per-token KL estimate between a policy and a base policy (AReaL ``KLEstimator``, reference §2.1).

    ``delta = float32(log_probs) - float32(log_probs_base)`` (float64 stays float64; half types go through
    float32 as AReaL does), then the estimator of ``kind`` (see :func:`kl_from_log_ratio`), then, when
    ``clamp`` is given, clamping to ``[-clamp, clamp]`` (AReaL clamps to ±10 when ``apply_clamp`` is on).
    Works on any layout (padded, packed) since it is elementwise; gradients flow into both inputs.

    Args:
        log_probs: log-probs of the sampled tokens under the policy (samples come from this policy for k3).
        log_probs_base: log-probs of the same tokens under the base (reference/behaviour) policy.
        kind: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        clamp: ``None`` (no clamp) or a positive bound.

    Raises:
        ValueError: an unknown ``kind`` (AReaL raises ``ValueError`` too), mismatched shapes, ``clamp <= 0``.

    Example:
        >>> kl_estimate(torch.tensor([0.0]), torch.tensor([-1.0]), "k3").item()  # e^-1 - 1 + 1
        0.3678794503211975
    """
    if kind not in KL_KINDS:
        raise ValueError(f"Unknown KL estimator '{kind}'; choose one of {KL_KINDS}")
    check_same_shape("log_probs", log_probs, log_probs_base=log_probs_base)
    bound = None if clamp is None else check_real(clamp, "clamp", minimum=0.0, strict=True)
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, log_probs_base.dtype), torch.float32)
    delta = log_probs.to(dtype) - log_probs_base.to(dtype)
    out = kl_from_log_ratio(delta, kind)
    if bound is not None:
        out = out.clamp(-bound, bound)
    return out
