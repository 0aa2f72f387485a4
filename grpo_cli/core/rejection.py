"""AReaL's staleness filters: ``RejectionSamplingConfig`` / ``apply_rejection_sampling`` and M2PO masking.

References: AReaL's ``areal/utils/functional.py`` and ``areal/engine/ppo/actor.py`` (rejection sampling, M2PO) and
its config validation. Both work on padded ``[B, T]`` and packed ``[N]`` + ``cu_seqlens`` tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
    check_same_shape,
    flat_layout,
    seq_count,
    seq_ids,
)
from grpo_cli.core.kl import kl_from_log_ratio
from grpo_cli.core.packing import segment_max

__all__ = ["RejectionSamplingConfig", "apply_rejection_sampling", "m2po_mask"]

_LEVELS = ("token", "sequence")
_ACTIONS = ("mask", "clamp")
# AReaL [N]'s validator omits "binary_kl" although its help text lists it; we follow the validator.
_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
_AGGS = ("sum", "mean", "max")


@dataclass
class RejectionSamplingConfig:
    """Filter or clamp tokens/sequences by the divergence of the proximal from the behaviour policy.

    Same fields, defaults and validation as AReaL's ``RejectionSamplingConfig`` (``areal/api/cli_args.py``):

    Attributes:
        level: ``"token"`` or ``"sequence"`` granularity.
        action: ``"mask"`` (reject: drop from the loss numerator) or ``"clamp"`` (truncate the weight).
        metric: ``"ratio"`` (π_prox/π_behave), ``"kl_k1"``, ``"kl_k2"`` or ``"kl_k3"``.
        agg: sequence aggregation ``"sum"``, ``"mean"`` or ``"max"`` (ratio: in log space, so ``mean`` is the
            geometric mean; KL: arithmetic).
        upper: inclusive upper bound (default 5.0).
        lower: inclusive lower bound or ``None``; ``clamp`` turns ``None`` into 0.0.

    Raises:
        ValueError: an unknown choice, ``lower > upper``, ratio with ``upper <= 1`` or ``lower <= 0``,
            ``kl_k2``/``kl_k3`` with ``upper <= 0``, ``clamp`` with a KL metric.

    Warns:
        UserWarning: ``agg != "mean"`` at token level (ignored there).
    """

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got '{self.level}'")
        if self.action not in _ACTIONS:
            raise ValueError(f"action must be one of {_ACTIONS}, got '{self.action}'")
        if self.metric not in _METRICS:
            raise ValueError(f"metric must be one of {_METRICS}, got '{self.metric}'")
        if self.agg not in _AGGS:
            raise ValueError(f"agg must be one of {_AGGS}, got '{self.agg}'")
        self.upper = check_real(self.upper, "upper")
        if self.lower is not None:
            self.lower = check_real(self.lower, "lower")
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) cannot be greater than upper ({self.upper})")
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise ValueError(
                    "upper must be > 1.0 for 'ratio' metric (otherwise all non-identical policy tokens "
                    f"will be filtered), got {self.upper}"
                )
            if self.lower is not None and self.lower <= 0:
                raise ValueError(f"lower must be positive for 'ratio' metric, got {self.lower}")
        # kl_k1 may be negative, so only k2/k3 need a positive upper bound (as AReaL).
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ValueError(f"upper must be positive for '{self.metric}' metric, got {self.upper}")
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"action='clamp' only supports metric='ratio' (direct importance weight truncation). "
                f"Got metric='{self.metric}'. Use action='mask' for KL-based filtering."
            )
        if self.action == "clamp" and self.lower is None:
            self.lower = 0.0
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"agg='{self.agg}' is ignored when level='token'. "
                "Aggregation is only used for sequence-level filtering.",
                UserWarning,
                stacklevel=3,
            )


def _in_bounds(metric: Tensor, config: RejectionSamplingConfig) -> Tensor:
    # Inclusive on both sides; NaN fails every comparison, so a NaN metric is out of bounds.
    upper = torch.tensor(config.upper, dtype=metric.dtype, device=metric.device)
    if config.lower is None:
        return metric <= upper
    lower = torch.tensor(config.lower, dtype=metric.dtype, device=metric.device)
    return (metric >= lower) & (metric <= upper)


def apply_rejection_sampling(
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | None,
    config: RejectionSamplingConfig,
) -> tuple[Tensor, Tensor, float]:
    """AReaL's rejection sampling / truncation of the behaviour weight π_prox/π_behave.

    AReaL ``apply_rejection_sampling``, ``areal/utils/functional/functional.py``.

    1. ``delta = prox - behave`` in float32 (float64 stays float64), detached, non-finite values set to 0.
    2. Metric: ``ratio = exp(delta)``, or ``kl_k1/k2/k3`` of (prox, behave) from the *raw* inputs (a NaN
       metric fails the bounds check).
    3. Weight ``w = exp(delta)``.
    4. Sequence level (rows of ``[B, T]`` or ``cu_seqlens`` segments, ``n_s = max(Σm, 1)``): for ``ratio``
       the weight becomes the sequence geometric mean ``exp(Σ_m delta / n_s)`` on every token and the
       aggregation runs in log space (``sum`` → product of ratios, ``mean`` → geometric mean, ``max`` →
       largest ratio); for KL metrics it is arithmetic. ``max`` over a sequence without valid tokens is 0.
       ``mask``: a token is in bounds iff its sequence is; ``clamp``: out-of-bounds sequences get
       ``w ← clamp(w, lower, upper)``.
    5. Token level: ``mask`` checks each token's metric; ``clamp`` clamps every weight.
    6. ``mask``: new mask ``m ∧ in_bounds``, ``filtered_fraction = count(m ∧ ¬in) / max(count(m), 1)``;
       ``clamp``: mask unchanged, ``filtered_fraction = count(m ∧ w changed) / max(count(m), 1)``.
       Finally ``w ← where(new_mask, w, 0)``.

    Args:
        proximal_logprobs: π_prox log-probs, ``[B, T]`` or ``[N]``.
        old_logprobs: π_behave (inference engine) log-probs, same shape.
        loss_mask: bool or 0/1 mask, same shape.
        cu_seqlens: ``[B + 1]`` offsets for packed input (required for sequence level); ignored for 2-D.
        config: a :class:`RejectionSamplingConfig`.

    Returns:
        ``(mask, weight, filtered_fraction)``: the new mask (``loss_mask``'s dtype), the detached behaviour
        weight (float32 or float64) and a Python float.

    Raises:
        ValueError: mismatched shapes, ``ndim`` not 1 or 2, packed sequence level without ``cu_seqlens``.
        TypeError: ``config`` that is not a :class:`RejectionSamplingConfig`.

    Example:
        >>> m, w, ff = apply_rejection_sampling(torch.tensor([0.0, 2.0]), torch.zeros(2),
        ...                                     torch.tensor([True, True]), None, RejectionSamplingConfig())
        >>> m.tolist(), ff  # exp(2) = 7.39 > 5
        ([True, False], 0.5)
    """
    if not isinstance(config, RejectionSamplingConfig):
        raise TypeError(f"config must be a RejectionSamplingConfig, got {type(config).__name__}")
    check_same_shape("proximal_logprobs", proximal_logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    if proximal_logprobs.ndim not in (1, 2):
        raise ValueError(f"Expected 1D (packed) or 2D (padded) tensors, got ndim={proximal_logprobs.ndim}")
    m = as_bool_mask(loss_mask, "loss_mask")
    shape = proximal_logprobs.shape
    cu = flat_layout(
        proximal_logprobs,
        cu_seqlens,
        need_segments=config.level == "sequence",
        what="sequence-level filtering",
    )
    dtype = torch.promote_types(torch.promote_types(proximal_logprobs.dtype, old_logprobs.dtype), torch.float32)
    prox = proximal_logprobs.detach().reshape(-1).to(dtype)
    behave = old_logprobs.detach().reshape(-1).to(dtype)
    mflat = m.reshape(-1)
    zero = torch.zeros((), dtype=dtype, device=prox.device)

    raw_delta = prox - behave
    delta = torch.where(torch.isfinite(raw_delta), raw_delta, zero)
    use_log = config.metric == "ratio"
    metric = torch.exp(delta) if use_log else kl_from_log_ratio(raw_delta, config.metric.removeprefix("kl_"))
    weight = torch.exp(delta)
    original = weight
    lower = 0.0 if config.lower is None else config.lower

    if config.level == "sequence":
        assert cu is not None
        n_tok = mflat.numel()
        ids = seq_ids(cu, n_tok)
        counts = seq_count(mflat, cu)
        n_s = counts.clamp(min=1).to(torch.float64)
        values = delta if use_log else metric
        masked_values = torch.where(mflat, values, zero)
        seq_total = torch.zeros(cu.numel() - 1, dtype=torch.float64, device=prox.device)
        if n_tok:
            seq_total = seq_total.index_add(0, ids, masked_values.to(torch.float64))
        if use_log:
            weight = torch.exp(seq_total / n_s).to(dtype)[ids]
            original = weight
        if config.agg == "sum":
            seq_agg = seq_total.to(dtype)
        elif config.agg == "mean":
            seq_agg = (seq_total / n_s).to(dtype)
        else:
            seq_agg = segment_max(torch.where(mflat, values, torch.full_like(values, float("-inf"))), cu)
            seq_agg = torch.where(counts > 0, seq_agg, torch.zeros_like(seq_agg))
        seq_metric = torch.exp(seq_agg) if use_log else seq_agg
        seq_in = _in_bounds(seq_metric, config)
        if config.action == "mask":
            in_bounds = seq_in[ids]
        else:
            weight = torch.where((~seq_in)[ids], weight.clamp(lower, config.upper), weight)
    elif config.action == "mask":
        in_bounds = _in_bounds(metric, config)
    else:
        weight = weight.clamp(lower, config.upper)

    n_valid = int(mflat.sum())
    if config.action == "mask":
        new_mask_flat = mflat & in_bounds
        filtered = int((mflat & ~in_bounds).sum())
        new_mask = new_mask_flat.reshape(shape).to(loss_mask.dtype)
    else:
        new_mask_flat = mflat
        filtered = int((mflat & (original != weight)).sum())
        new_mask = loss_mask
    weight = torch.where(new_mask_flat, weight, zero).reshape(shape)
    return new_mask, weight, filtered / max(n_valid, 1)


def m2po_mask(old_logp: Tensor, prox_logp: Tensor, loss_mask: Tensor, m2_threshold: float) -> Tensor:
    """AReaL's M2PO token mask (``areal/trainer/ppo/actor.py``; arXiv 2510.01161): drop the largest second moments.

    ``M2 = (old - prox)**2`` over the valid tokens, sorted descending (stable, so ties keep token order).
    ``k`` is the first index whose tail mean ``mean(sorted[k:])`` is ``< m2_threshold`` (``n - 1`` when there
    is none, so the smallest always survives); the ``k`` largest are masked. NaN second moments sort first
    and are masked first. Local to the given batch (it is not a streaming-mergeable operation). Works on
    any layout: it only looks at the valid tokens.

    Args:
        old_logp: behaviour log-probs.
        prox_logp: proximal log-probs (AReaL's code uses π_prox, although its docs say π_θ).
        loss_mask: bool or 0/1 mask.
        m2_threshold: the threshold on the mean second moment (``<= 0`` keeps only one token).

    Returns:
        The new bool mask, ``loss_mask``'s shape (a copy of it when no token is valid).

    Example:
        >>> m = torch.ones(3, dtype=torch.bool)
        >>> m2po_mask(torch.tensor([0.0, 3.0, 0.1]), torch.zeros(3), m, 0.5).tolist()  # M2 = 0, 9, 0.01
        [True, False, True]
    """
    threshold = check_real(m2_threshold, "m2_threshold")
    check_same_shape("old_logp", old_logp, prox_logp=prox_logp, loss_mask=loss_mask)
    m = as_bool_mask(loss_mask, "loss_mask")
    mflat = m.reshape(-1)
    delta = (old_logp.detach().to(torch.float64) - prox_logp.detach().to(torch.float64)).reshape(-1)
    m2 = (delta * delta)[mflat]
    n = m2.numel()
    if n == 0:
        return m.clone()
    sorted_m2, order = torch.sort(m2, descending=True, stable=True)
    tail_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    tail_means = tail_sums / torch.arange(n, 0, -1, device=m2.device, dtype=torch.float64)
    below = torch.nonzero(tail_means < threshold)
    n_drop = int(below[0, 0]) if below.numel() else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool, device=m2.device)
    keep_sorted[:n_drop] = False
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    out = torch.zeros_like(mflat)
    out[mflat] = keep
    return out.reshape(m.shape)
