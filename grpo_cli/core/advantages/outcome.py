"""The per-sequence (outcome) estimators that compare a reward with its group's: GRPO (mean and std),
Dr.GRPO (mean) and RLOO (mean of the others), as verl's ``core_algos.py`` and OpenRLHF compute them, and GRPO with
AReaL's token-weighted group statistics."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grpo_cli.core._loss_common import check_real
from grpo_cli.core.advantages._common import F64, group_index, segment_add
from grpo_cli.core.rewards import as_float, result_dtype

__all__ = ["drgrpo_advantages", "grpo_advantages", "rloo_advantages", "token_weighted_grpo_advantages"]


def _outcome_groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, torch.dtype]:
    """(rewards float64, dense group index, rows per group, reward sum per group, output dtype)."""
    r = as_float(rewards, "rewards")
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B] (one scalar per sequence), got shape {tuple(r.shape)}")
    inverse, n_groups = group_index(r.shape[0], r.device, group_ids, None, None)
    r64 = r.to(F64)
    count = segment_add(torch.ones_like(r64), inverse, n_groups)
    total = segment_add(r64, inverse, n_groups)
    return r64, inverse, count, total, result_dtype(r)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-6,
    std_unbiased: bool = True,
    scale_by_std: bool = True,
) -> Tensor:
    """GRPO group normalisation, verl's ``compute_grpo_outcome_advantage``: ``(r − μ_g) / (σ_g + ε)``.

    σ is the unbiased (``N − 1``) std by default, as verl, TRL, OpenRLHF and slime all use ``torch.std``;
    ``std_unbiased=False`` divides by ``N``. A one-sequence group gets μ = 0, σ = 1 (verl), so its advantage
    is ``r / (1 + ε)``. The peers differ in ε: verl/slime 1e-6 (default here), TRL 1e-4, OpenRLHF 1e-9;
    AReaL's ``NormConfig(group, group)`` uses 1e-5 and gives a one-row group 0 (see :func:`normalize`).
    ``scale_by_std=False`` is Dr.GRPO (:func:`drgrpo_advantages`).

    Args:
        rewards: ``[B]`` scalar rewards (verl sums token-level scores first).
        group_ids: ``[B]`` integer prompt/group id per sequence (any values, any order).
        eps: ε added to σ (≥ 0).
        std_unbiased: Bessel-corrected std (default True).
        scale_by_std: divide by ``σ + ε`` (verl ``norm_adv_by_std_in_grpo``, default True).

    Returns:
        ``[B]`` advantages (float32, float64 for float64 rewards); :func:`sequence_to_tokens` broadcasts them.

    Example:
        >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([5, 5, 9, 9]), eps=0.0).tolist()
        [0.7071067690849304, -0.7071067690849304, -0.7071067690849304, 0.7071067690849304]
    """
    eps = check_real(eps, "eps", minimum=0.0)
    for name, flag in (("std_unbiased", std_unbiased), ("scale_by_std", scale_by_std)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    r64, inverse, count, total, dtype = _outcome_groups(rewards, group_ids)
    single = count == 1
    mean = torch.where(single, 0.0, total / count)  # verl: a one-sequence group has μ = 0, σ = 1
    centered = r64 - mean[inverse]
    if not scale_by_std:
        return centered.to(dtype)
    sum_sq = segment_add((r64 - (total / count)[inverse]).square(), inverse, count.numel())
    denom = torch.clamp(count - 1, min=1.0) if std_unbiased else count
    std = torch.where(single, 1.0, torch.sqrt(sum_sq / denom))
    return (centered / (std[inverse] + eps)).to(dtype)


def drgrpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO: ``r − μ_g`` without the std (verl ``norm_adv_by_std_in_grpo=False``, OpenRLHF ``dr_grpo``).

    A one-sequence group keeps ``r`` (verl's μ = 0). Same as :func:`grpo_advantages` with
    ``scale_by_std=False``.

    Example:
        >>> drgrpo_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1])).tolist()
        [0.5, -0.5, 0.5]
    """
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, *, singleton: Literal["keep", "zero"] = "keep") -> Tensor:
    """RLOO, verl's ``compute_rloo_outcome_advantage``: ``r_i − mean(others) = (n·r_i − S_g)/(n − 1)``.

    OpenRLHF's ``rloo`` is the same formula. A one-sequence group has no others: ``singleton="keep"``
    (default, verl ``rloo``) returns ``r``; ``"zero"`` returns 0 (verl ``rloo_vectorized``, AReaL
    leave-one-out).

    Example:
        >>> rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 4.0]), torch.tensor([3, 3, 3, 8])).tolist()
        [-3.0, -1.5, 4.5, 4.0]
    """
    if singleton not in ("keep", "zero"):
        raise ValueError(f"singleton must be 'keep' or 'zero', got {singleton!r}")
    r64, inverse, count, total, dtype = _outcome_groups(rewards, group_ids)
    n = count[inverse]
    loo = r64 - (total[inverse] - r64) / torch.clamp(n - 1, min=1.0)
    keep = r64 if singleton == "keep" else torch.zeros_like(r64)
    return torch.where(n > 1, loo, keep).to(dtype)


def token_weighted_grpo_advantages(scores: Tensor, group: Tensor, n_tokens: Tensor, *, eps: float = 1e-5) -> Tensor:
    """GRPO with per-*token* group statistics, one value per sequence: AReaL's
    ``Normalization(mean_level="group", std_level="group")`` (``adv_norm``, ε 1e-5) over the valid tokens of each
    group, every token carrying its sequence's score (AReaL's ``gsm8k_grpo.yaml``: γ = λ = 1, no critic, no KL).

    A sequence weighs as many times as it has valid tokens, where :func:`grpo_advantages` weighs each once:
    ``(r_i − μ_g)/(σ_g + ε)`` with ``μ_g = Σ n_i r_i / N_g``, ``σ_g = sqrt(Σ n_i (r_i − μ_g)² / (N_g − 1))``
    (1 when ``N_g ≤ 1`` or the group has one sequence), ``N_g = Σ n_i`` the group's valid tokens. Equal to
    :func:`normalize` over the tokens, computed from ``[B]`` values instead of ``[N]``.

    Args:
        scores: ``[B]`` per-sequence scores.
        group: ``[B]`` dense group index (``0 … G − 1``).
        n_tokens: ``[B]`` valid tokens per sequence.
        eps: ε added to σ.

    Returns:
        ``[B]`` float64 advantages.

    Example:
        >>> token_weighted_grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 1]),
        ...                                eps=0.0).tolist()
        [0.5, -1.5]
    """
    n_groups = int(group.max()) + 1 if group.numel() else 0
    w = n_tokens.to(F64)
    x = scores.to(F64)
    n = torch.zeros(n_groups, dtype=F64, device=x.device).index_add_(0, group, w)
    s = torch.zeros(n_groups, dtype=F64, device=x.device).index_add_(0, group, w * x)
    mean = torch.where(n > 0, s / n.clamp(min=1.0), 0.0)[group]
    sq = torch.zeros(n_groups, dtype=F64, device=x.device).index_add_(0, group, w * (x - mean).square())
    rows = torch.bincount(group, minlength=n_groups)
    std = torch.where(n > 1, torch.sqrt(sq / (n - 1).clamp(min=1.0)), 1.0)
    std = torch.where(rows == 1, 1.0, std)[group]
    return (x - mean) / (std + eps)
