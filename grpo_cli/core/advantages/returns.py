"""verl's REINFORCE++ (return-to-go over token rewards, then batch whitening) and ``masked_whiten``."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_real, validate_cu_seqlens
from grpo_cli.core.advantages._common import F64, check_token_tensor, to_padded
from grpo_cli.core.conventions import check_convention
from grpo_cli.core.packing import lengths_from_cu_seqlens, padded_to_packed
from grpo_cli.core.rewards import result_dtype

__all__ = ["REINFORCE_PP_CONVENTIONS", "masked_whiten", "reinforce_pp_advantages"]


def masked_whiten(
    values: Tensor, loss_mask: Tensor, *, unbiased: bool = True, eps: float = 1e-8, shift_mean: bool = True
) -> Tensor:
    """verl's ``masked_whiten``: ``(x − μ) · rsqrt(σ² + eps)`` over every valid element of the batch.

    μ and σ² are float64 masked statistics; σ² is Bessel-corrected when ``unbiased`` (verl). OpenRLHF whitens
    with the biased variance and ``rsqrt(max(σ², 1e-8))`` instead. Differences from verl: the result is 0 at
    masked positions (verl's callers multiply by the mask), and with ≤ 1 valid element the variance is taken
    as 0 where verl raises.

    Example:
        >>> masked_whiten(torch.tensor([1.0, 3.0, 99.0]), torch.tensor([1, 1, 0]), eps=0.0).tolist()
        [-0.7071067690849304, 0.7071067690849304, 0.0]
    """
    mask = as_bool_mask(loss_mask)
    x = cast(Tensor, check_token_tensor(values, mask, "values"))  # values is required
    eps = check_real(eps, "eps", minimum=0.0)
    if not isinstance(unbiased, bool) or not isinstance(shift_mean, bool):
        raise TypeError("unbiased and shift_mean must be bools")
    dtype = result_dtype(x)
    x64 = torch.where(mask, x.to(F64), 0.0)
    n = mask.sum().to(F64)
    mean = x64.sum() / torch.clamp(n, min=1.0)
    centered = torch.where(mask, x64 - mean, 0.0)
    # With ≤ 1 valid element the centred sum is 0, so the clamped denominator gives variance 0 (verl raises).
    var = centered.square().sum() / torch.clamp(n - 1 if unbiased else n, min=1.0)
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0).to(dtype)


def _return_to_go_padded(rewards: Tensor, mask: Tensor, gamma: float, carry: bool = False) -> Tensor:
    """verl REINFORCE++ returns on ``[B, T]``.

    ``carry=False`` (verl up to 0.8): ``G_t = r_t + γ·m_{t+1}·G_{t+1}``, the running return resets after a
    masked position. ``carry=True`` (verl 0.9): a masked position passes the running return through unchanged
    (no discount, no reward) and gets ``G_t = 0``; a valid one gets ``G_t = r_t + γ·G_next``.
    """
    n_seq, width = rewards.shape
    returns = torch.zeros_like(rewards)
    running = torch.zeros(n_seq, dtype=rewards.dtype, device=rewards.device)
    r_t, m_t = rewards.t(), mask.t()
    for t in range(width - 1, -1, -1):
        if carry:
            # verl 0.9 compute_reinforce_plus_plus_outcome_advantage: observation tokens carry running_return.
            new = r_t[t] + gamma * running
            returns[:, t] = torch.where(m_t[t], new, 0.0)
            running = torch.where(m_t[t], new, running)
            continue
        running = r_t[t] + gamma * running
        returns[:, t] = running
        running = torch.where(m_t[t], running, 0.0)  # verl <= 0.8: running_return *= response_mask[:, t]
    return returns


REINFORCE_PP_CONVENTIONS: tuple[str, ...] = ("verl", "verl<=0.8")
"""``convention`` values of :func:`reinforce_pp_advantages`: verl 0.9 (carries the return across masked
spans) and verl up to 0.8 (resets it there, grpo-cli's default)."""


def reinforce_pp_advantages(
    token_rewards: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
    cu_seqlens: Tensor | None = None,
    convention: str | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (verl ``compute_reinforce_plus_plus_outcome_advantage``): return-to-go, batch whitening.

    ``G_t = r_t + γ·G_{t+1}`` backwards within each sequence. Across a masked span inside a response (tool or
    observation tokens) the conventions differ:

    - ``None`` (grpo-cli) or ``"verl<=0.8"``: the running return resets at masked positions (verl up to 0.8,
      ``running_return * response_mask``); the masked position itself gets ``r_t + γ·G_{t+1}``.
    - ``"verl"`` (verl 0.9, the current release): the running return is carried through masked positions
      unchanged and the masked positions get ``G_t = 0``, so a reward after a tool call reaches the tokens
      before it. Mask ``[1, 0, 1, 1]``, reward 1 at the last token, γ = 1: ``[1, 0, 1, 1]`` (grpo-cli
      ``[0, 1, 1, 1]``).

    Then ``A = masked_whiten(G)`` over all valid tokens of the
    batch (unbiased variance, ``rsqrt(σ² + eps)``), 0 at masked positions. Rewards at masked positions count
    as 0. slime's ``reinforce_plus_plus`` needs ``--normalize-advantages`` for the same whitening; OpenRLHF's
    ``reinforce`` whitens with the biased variance.

    Args:
        token_rewards: padded ``[B, T]`` or packed ``[N]`` token rewards (an outcome score at the last valid
            token: :func:`outcome_to_token_rewards`).
        loss_mask: bool or 0/1 response mask.
        gamma: discount γ (verl ``algorithm.gamma``, default 1.0).
        eps: whitening epsilon (1e-8).
        cu_seqlens: ``[B + 1]`` offsets for packed input.
        convention: ``None``, ``"verl"`` or ``"verl<=0.8"`` (see above and :mod:`grpo_cli.core.conventions`).

    Returns:
        ``(advantages, returns)`` shaped like ``token_rewards``.

    Example:
        >>> rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        >>> reinforce_pp_advantages(rewards, torch.ones(2, 2), gamma=0.5)[1].tolist()
        [[0.5, 1.0], [0.0, 0.0]]
    """
    carry = check_convention(convention, REINFORCE_PP_CONVENTIONS, "reinforce_pp_advantages") == "verl"
    mask = as_bool_mask(loss_mask)
    r = cast(Tensor, check_token_tensor(token_rewards, mask, "token_rewards"))  # token_rewards is required
    g = check_real(gamma, "gamma")
    dtype = result_dtype(r)
    r64 = torch.where(mask, r.to(F64), 0.0)
    if mask.ndim == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed 1-D input, got a padded [B, T] tensor")
        returns = _return_to_go_padded(r64, mask, g, carry)
    elif mask.ndim == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for packed 1-D tokens")
        cu = validate_cu_seqlens(cu_seqlens.to(mask.device), mask.numel())
        padded = _return_to_go_padded(to_padded(r64, cu), to_padded(mask, cu), g, carry)
        returns = padded_to_packed(padded, lengths_from_cu_seqlens(cu))[0]
    else:
        raise ValueError(f"expected padded [B, T] or packed [N] tokens, got ndim={mask.ndim}")
    advantages = masked_whiten(returns, mask, eps=eps)
    return advantages.to(dtype), returns.to(dtype)
