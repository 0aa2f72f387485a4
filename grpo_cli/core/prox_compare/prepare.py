"""The method-independent work on one batch (:func:`prox_compare_prepare`): flattened inputs, lags and
their bins, the compared tokens, every method's approximation, and the truth's loss terms and rejection outcome."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.prox import broadcast_current_version, compute_prox_logp_approximations
from grpo_cli.core.prox_compare._common import DEFAULT_MAX_LAG, bin_counts, check_methods, masked_max
from grpo_cli.core.rejection import RejectionSamplingConfig, apply_rejection_sampling
from grpo_cli.core.staleness import lag_bins

__all__ = ["ProxCompareBatch", "prox_compare_prepare", "rejection_changes"]

# A clamp upper bound that never binds on a finite float32 weight: clamping to it reproduces the untruncated
# weight, so a token is truncated exactly where the configured clamp changes its weight.
_FREE_UPPER = float(torch.finfo(torch.float32).max)


def rejection_changes(
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | None,
    config: RejectionSamplingConfig,
) -> Tensor:
    """Tokens whose behaviour weight rejection sampling changes: AReaL's ``filtered_fraction`` numerator per token.

    ``action="mask"``: valid tokens that :func:`~grpo_cli.core.rejection.apply_rejection_sampling` drops.
    ``action="clamp"``: valid tokens whose weight the clamp changes, found by comparing with the same call under a
    bound that never binds (so the untruncated weight is AReaL's own, token or sequence level).

    Returns:
        A bool tensor shaped like ``loss_mask``.

    Example:
        >>> cfg = RejectionSamplingConfig(upper=2.0)  # token level, mask, ratio
        >>> rejection_changes(torch.tensor([0.0, 1.0]), torch.zeros(2), torch.tensor([True, True]), None, cfg)
        tensor([False,  True])
    """
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    kept, weight, _ = apply_rejection_sampling(proximal_logprobs, old_logprobs, mask, cu_seqlens, config)
    if config.action == "mask":
        return mask & ~kept
    with warnings.catch_warnings():  # re-validation repeats the token-level agg warning the user already saw
        warnings.simplefilter("ignore", UserWarning)
        free = replace(config, upper=_FREE_UPPER, lower=None)
    _, untruncated, _ = apply_rejection_sampling(proximal_logprobs, old_logprobs, mask, cu_seqlens, free)
    return mask & (weight != untruncated)


def _flatten_inputs(
    tensors: dict[str, Tensor | None], current_version: int | Tensor, cu_seqlens: Tensor | None
) -> tuple[dict[str, Tensor | None], int | Tensor, Tensor]:
    """Padded ``[B, T]`` → packed ``[B·T]`` with row offsets; packed input needs ``cu_seqlens``."""
    new = tensors["new_logp"]
    assert new is not None
    if new.ndim == 2:
        b, t = new.shape
        cu = torch.arange(b + 1, dtype=torch.int64, device=new.device) * t
        flat = {k: (None if v is None else v.reshape(-1)) for k, v in tensors.items()}
        if isinstance(current_version, Tensor) and current_version.ndim == 2:
            current_version = current_version.reshape(-1)
        return flat, current_version, cu
    if new.ndim != 1:
        raise ValueError(f"expected packed [N] or padded [B, T] tensors, got shape {tuple(new.shape)}")
    if cu_seqlens is None:
        raise ValueError("packed 1-D input needs cu_seqlens (pass torch.tensor([0, N]) for a single sequence)")
    return tensors, current_version, cu_seqlens.to(device=new.device, dtype=torch.int64)


@dataclass(frozen=True)
class ProxCompareBatch:
    """What every method's comparison shares on one batch (:func:`prox_compare_prepare`): the flattened inputs,
    lags and their bins, the compared tokens, every method's approximation, and the truth's loss terms and
    rejection outcome.

    Computing it once lets :func:`prox_compare_fold` be called per method (``compare-prox`` runs one metric
    group per method, in threads) without repeating it; the fields are read-only.
    """

    new: Tensor
    old: Tensor
    truth: Tensor
    approximations: dict[str, Tensor]
    valid: Tensor
    compared: Tensor
    cu_seqlens: Tensor
    n_compared: Tensor
    lag_max: Tensor
    lag_bin: Tensor
    lag_counts: Tensor
    present: list[int]
    n_outside: Tensor
    rejection_sampling: RejectionSamplingConfig | None
    changed_truth: Tensor | None
    advantages: Tensor | None
    eps_clip: float
    loss_kwargs: dict[str, Any]
    loss_truth: tuple[Tensor, Tensor, dict[str, Any]] | None


def prox_compare_prepare(
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    prox_logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    cu_seqlens: Tensor | None = None,
    loss_mask: Tensor | None = None,
    advantages: Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    max_lag: int = DEFAULT_MAX_LAG,
    methods: Iterable[str] | None = None,
) -> ProxCompareBatch:
    """The part of :func:`prox_compare_update` that every method shares (same arguments, plus the state's
    ``max_lag`` and the ``methods`` whose approximations to compute: default all)."""
    tensors, current_version, cu = _flatten_inputs(
        {"new_logp": new_logp, "old_logp": old_logp, "prox_logp": prox_logp, "versions": versions,
         "loss_mask": loss_mask, "advantages": advantages},
        current_version,
        cu_seqlens,
    )
    new, old, truth, ver = (tensors[k] for k in ("new_logp", "old_logp", "prox_logp", "versions"))
    assert new is not None and old is not None and truth is not None and ver is not None
    raw_mask, adv = tensors["loss_mask"], tensors["advantages"]
    if raw_mask is None:
        valid = torch.ones(new.shape, dtype=torch.bool, device=new.device)
    else:
        valid = raw_mask if raw_mask.dtype == torch.bool else raw_mask != 0

    # v_θ per token, once: a length-B tensor is per sequence, anything else goes to broadcast_current_version as is.
    per_sequence = isinstance(current_version, Tensor) and current_version.ndim == 1 and (
        current_version.numel() == cu.numel() - 1
    )
    v_theta = broadcast_current_version(current_version, ver, cu_seqlens=cu if per_sequence else None)
    # Lag k = v_θ − v_b (AReaL's sample_staleness_theta); bins as grpo_cli.core.staleness: k for 0 ≤ k < max_lag,
    # max_lag for k ≥ max_lag, max_lag + 1 for k < 0.
    lag = v_theta - ver
    if lag.is_floating_point():  # fractional versions: the bin of ⌊k⌋
        lag = torch.floor(torch.nan_to_num(lag, nan=-1.0))
    lag = lag.to(torch.int64)
    lag_bin = lag_bins(lag, max_lag)
    compared = valid & (ver >= 0)
    n_compared = compared.sum()
    lag_counts = bin_counts(lag_bin, compared, max_lag + 2)
    changed_truth = None
    if rejection_sampling is not None:
        changed_truth = rejection_changes(truth, old, valid, cu, rejection_sampling)
    loss_kwargs: dict[str, Any] = {
        "eps_clip_higher": eps_clip_higher,
        "c_clip": c_clip,
        "rejection_sampling": rejection_sampling,
        "importance_sampling_level": importance_sampling_level,
        "cu_seqlens": cu,
    }
    loss_truth = None
    if adv is not None:
        loss_truth = ppo_actor_loss_terms(new, truth, old, adv, eps_clip, valid, **loss_kwargs)
    return ProxCompareBatch(
        new=new, old=old, truth=truth, valid=valid, compared=compared,
        approximations=compute_prox_logp_approximations(old, new, ver, v_theta, check_methods(methods)),
        cu_seqlens=cu, n_compared=n_compared, lag_max=masked_max(lag, compared), lag_bin=lag_bin,
        lag_counts=lag_counts, present=torch.nonzero(lag_counts).flatten().tolist(),
        n_outside=new.numel() - n_compared,  # tokens whose errors are 0 (prox_approximation_errors' contract)
        rejection_sampling=rejection_sampling, changed_truth=changed_truth, advantages=adv, eps_clip=eps_clip,
        loss_kwargs=loss_kwargs, loss_truth=loss_truth,
    )
