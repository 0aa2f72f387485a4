"""Per-token KL estimators k1, k2, k3 and abs (Schulman's estimators, as AReaL's ``KLEstimator`` and verl).

verl's ``kl_penalty`` (``verl/trainer/ppo/core_algos.py``) also accepts each kind with a ``+`` suffix
(``k1+``, ``k3+``, ``abs+``, ``k2+``): a straight-through estimator whose value is the base estimator's and
whose gradient is k2's, ``½(ℓ − ℓ_base)²`` (an unbiased gradient of the KL; J. Schulman, "Approximating KL
divergence", 2020). :func:`kl_estimate` accepts them as :data:`KL_STRAIGHT_THROUGH_KINDS`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import check_real, check_same_shape

__all__ = ["KL_KINDS", "KL_STRAIGHT_THROUGH_KINDS", "k3_of_log_weight", "kl_estimate", "kl_from_log_ratio"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
KL_STRAIGHT_THROUGH_KINDS: tuple[str, ...] = ("k1+", "k2+", "k3+", "abs+")
"""verl's ``+`` kinds: the value of the base kind, the gradient of k2 (``k2+`` is plain k2)."""


def k3_of_log_weight(log_weight: Tensor) -> Tensor:
    """Schulman's k3 ``eˣ − 1 − x`` of ``x = log(q/p)`` at tokens sampled from ``p``: an estimate of KL(p ‖ q).

    The one place k3 is written: :func:`kl_from_log_ratio` (``x = −delta``), the figures ``kl/k3`` (``x = new −
    old``), ``kl_ref/k3`` (``x = ref − new``) and the peers' ``k3``/``kl_div_dual``/``kl`` all call it.
    ``expm1`` keeps it accurate near ``x = 0``, where ``exp(x) − 1 − x`` cancels catastrophically.

    Example:
        >>> k3_of_log_weight(torch.tensor([1.0])).item()  # e − 1 − 1
        0.7182817459106445
    """
    return torch.expm1(log_weight) - log_weight


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
        return k3_of_log_weight(-delta)  # expm1(−d) − (−d): the same bits as expm1(−d) + d (IEEE a − (−b) = a + b)
    if kind == "abs":
        return delta.abs()
    raise ValueError(f"Unknown KL estimator '{kind}'; choose one of {KL_KINDS}")


def kl_estimate(log_probs: Tensor, log_probs_base: Tensor, kind: str, clamp: float | None = None) -> Tensor:
    """Per-token KL estimate between a policy and a base policy (AReaL ``KLEstimator``, ``areal/utils/data.py``).

    ``delta = float32(log_probs) - float32(log_probs_base)`` (float64 stays float64; half types go through
    float32 as AReaL does), then the estimator of ``kind`` (see :func:`kl_from_log_ratio`), then, when
    ``clamp`` is given, clamping to ``[-clamp, clamp]`` (AReaL clamps to ±10 when ``apply_clamp`` is on).
    Works on any layout (padded, packed) since it is elementwise; gradients flow into both inputs.

    A ``kind`` with a ``+`` suffix (:data:`KL_STRAIGHT_THROUGH_KINDS`, verl ``kl_penalty``) is straight-through:
    the value is the (clamped) base estimator's, the gradient that of ``k2 = ½·delta²``, i.e. ``delta`` with
    respect to ``log_probs``, also where the clamp is active. verl's ``low_var_kl``/``k3`` is ``kind="k3"``
    with ``clamp=10`` (verl also bounds ``delta`` to ±20 first, which cannot change a value clamped to 10).

    Args:
        log_probs: log-probs of the sampled tokens under the policy (samples come from this policy for k3).
        log_probs_base: log-probs of the same tokens under the base (reference/behaviour) policy.
        kind: ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"`` or one of them with a ``+`` suffix.
        clamp: ``None`` (no clamp) or a positive bound.

    Raises:
        ValueError: an unknown ``kind`` (AReaL raises ``ValueError`` too), mismatched shapes, ``clamp <= 0``.

    Example:
        >>> kl_estimate(torch.tensor([0.0]), torch.tensor([-1.0]), "k3").item()  # e^-1 - 1 + 1
        0.3678794503211975
        >>> lp = torch.tensor([0.0], requires_grad=True)
        >>> kl = kl_estimate(lp, torch.tensor([-1.0]), "k3+"); kl.backward()
        >>> round(kl.item(), 6), lp.grad.item()  # k3's value, k2's gradient delta = 1
        (0.367879, 1.0)
    """
    if kind not in KL_KINDS and kind not in KL_STRAIGHT_THROUGH_KINDS:
        raise ValueError(f"Unknown KL estimator '{kind}'; choose one of {KL_KINDS + KL_STRAIGHT_THROUGH_KINDS}")
    straight_through = kind.endswith("+")
    base_kind = kind[:-1] if straight_through else kind
    check_same_shape("log_probs", log_probs, log_probs_base=log_probs_base)
    bound = None if clamp is None else check_real(clamp, "clamp", minimum=0.0, strict=True)
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, log_probs_base.dtype), torch.float32)
    delta = log_probs.to(dtype) - log_probs_base.to(dtype)
    out = kl_from_log_ratio(delta, base_kind)
    if bound is not None:
        out = out.clamp(-bound, bound)
    if straight_through and base_kind != "k2":
        k2 = delta * delta / 2
        out = k2 - k2.detach() + out.detach()
    return out
