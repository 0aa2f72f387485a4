"""Layout helpers for the estimators: per-sequence values onto tokens, outcome rewards at the last
valid token, and AReaL's next-token roll."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask
from grpo_cli.core.rewards import as_float, check_per_sequence, result_dtype, token_layout

__all__ = ["outcome_to_token_rewards", "roll_to_next_token", "sequence_to_tokens"]


def sequence_to_tokens(per_sequence: Tensor, loss_mask: Tensor, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """One value per sequence over its valid tokens, 0 elsewhere (verl ``scores.unsqueeze(-1) * mask``).

    Example:
        >>> sequence_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 1, 0]])).tolist()
        [[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]
    """
    mask = as_bool_mask(loss_mask)
    _, _, seq, n_seq = token_layout(mask, cu_seqlens, None, "sequence_to_tokens")
    values = as_float(check_per_sequence(per_sequence, n_seq, "per_sequence", mask.device), "per_sequence")
    return torch.where(mask, values[seq], 0.0).to(result_dtype(values))


def outcome_to_token_rewards(scores: Tensor, loss_mask: Tensor, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Token rewards: each score at its sequence's last valid token (verl ``token_level_rewards``), else 0.

    A sequence without valid tokens gets no reward.

    Example:
        >>> mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]])
        >>> outcome_to_token_rewards(torch.tensor([2.0, 5.0]), mask).tolist()
        [[0.0, 0.0, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0]]
    """
    mask = as_bool_mask(loss_mask)
    position, _, seq, n_seq = token_layout(mask, cu_seqlens, None, "outcome_to_token_rewards")
    values = as_float(check_per_sequence(scores, n_seq, "scores", mask.device), "scores")
    pos = position.expand(mask.shape)
    seq_full = seq.expand(mask.shape)
    last_valid = torch.full((n_seq,), -1, dtype=torch.int64, device=mask.device)
    last_valid.scatter_reduce_(0, seq_full.reshape(-1), torch.where(mask, pos, -1).reshape(-1), reduce="amax")
    at_last = mask & (pos == last_valid[seq_full])
    return torch.where(at_last, values[seq], 0.0).to(result_dtype(values))


def roll_to_next_token(x: Tensor, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """AReaL's next-token alignment ``torch.roll(x, −1, dims=−1)``, per row (padded) or per sequence (packed).

    Position ``t`` then holds token ``t + 1``'s value and the last position wraps around to the first token's
    value (a prompt token, mask 0, in AReaL's rows).

    Example:
        >>> roll_to_next_token(torch.tensor([1, 2, 3, 7, 8]), cu_seqlens=torch.tensor([0, 3, 5])).tolist()
        [2, 3, 1, 8, 7]
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed 1-D input, got a padded [B, T] tensor")
        return torch.roll(x, shifts=-1, dims=-1)
    position, length, _, _ = token_layout(x, cu_seqlens, None, "roll_to_next_token")
    start = torch.arange(x.numel(), device=x.device) - position
    return x[start + torch.remainder(position + 1, torch.clamp(length, min=1))]
