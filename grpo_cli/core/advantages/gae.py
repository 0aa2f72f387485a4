"""AReaL's token-level GAE (``_compute_token_level_gae``) and its whole ``PPOActor._compute_advantages``
pipeline (overlong penalty, shaping, ``reward_norm``, KL token rewards, GAE, ``adv_norm``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_real, validate_cu_seqlens
from grpo_cli.core.advantages._common import F64, check_token_tensor, to_padded
from grpo_cli.core.advantages.normalization import NormConfig, normalize
from grpo_cli.core.packing import padded_to_packed, segment_sum
from grpo_cli.core.rewards import (
    KL_ESTIMATORS,
    default_no_eos,
    kl_regularized_rewards,
    result_dtype,
    reward_overlong_penalty,
    sequence_lengths,
    shape_rewards,
)

__all__ = ["AdvantageConfig", "compute_advantages", "gae_advantages"]


def _gae_padded(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    lengths: Tensor,
    no_eos: Tensor,
    discount: float,
    gae_lambda: float,
) -> Tensor:
    """AReaL's backward GAE loop on ``[B, T]`` float64 rows of true length ``lengths``; returns advantages."""
    n_seq, width = rewards.shape
    zero = torch.zeros((), dtype=F64, device=rewards.device)
    # AReaL starts the loop at T − 2 (the last position of a row is never an action after the mask roll); with
    # per-row lengths that is "positions ≥ L − 1 are skipped".
    active = mask & (torch.arange(width, device=rewards.device).unsqueeze(0) < (lengths - 1).unsqueeze(1))
    last = torch.clamp(lengths - 1, min=0).unsqueeze(1)
    # Bootstrap with V at the row's last position only when the sequence was cut off (no EOS).
    next_value = torch.where(no_eos & (lengths > 0), values.gather(1, last).squeeze(1), zero)
    last_gae = torch.zeros(n_seq, dtype=F64, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    c = discount * gae_lambda
    r_t, v_t, m_t = rewards.t(), values.t(), active.t()  # iterate over time with cheap row views
    for t in range(width - 2, -1, -1):
        delta = r_t[t] + discount * next_value - v_t[t]  # δ_t = r_t + γ V_next − V_t
        new_gae = delta + c * last_gae  # A_t = δ_t + γλ A_{t+1}
        # Masked positions carry both V_next and the running advantage unchanged (AReaL/verl multi-turn skip).
        next_value = torch.where(m_t[t], v_t[t], next_value)
        last_gae = torch.where(m_t[t], new_gae, last_gae)
        advantages[:, t] = last_gae
    return advantages


def gae_advantages(
    rewards: Tensor,
    values: Tensor | None,
    loss_mask: Tensor,
    *,
    discount: float = 1.0,
    gae_lambda: float = 1.0,
    no_eos: Tensor | None = None,
    seqlens: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """AReaL's token-level GAE (``_compute_token_level_gae``): backward over ``t``, masked positions skipped.

    ``δ_t = r_t + γ·V_next − V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, updated only where ``m_t``; ``V_next`` and
    the running advantage carry over masked positions unchanged, so a masked position reports the advantage of
    the next valid one (AReaL's values there — compare advantages only where the mask is 1). ``V_next`` starts
    at ``V[seqlen − 1]`` for sequences without EOS and at 0 otherwise; the last position of each sequence has
    advantage 0. ``returns = advantages + values`` everywhere (values at masked positions included, as AReaL).

    Args:
        rewards: token rewards (``tot_rewards`` of :func:`~grpo_cli.core.rewards.kl_regularized_rewards`),
            padded ``[B, T]`` or packed ``[N]``; next-token aligned like the mask.
        values: critic values, same shape; None means 0 (no critic, the GRPO setting).
        loss_mask: bool or 0/1 mask (next-token aligned, AReaL's rolled ``loss_mask``).
        discount: γ (AReaL ``discount``, default 1.0).
        gae_lambda: λ (AReaL ``gae_lambda``, default 1.0); only a float (AReaL [N] also accepts a function).
        no_eos: ``[B]`` "cut off without EOS" flags; default AReaL's rule (padded: ``seqlen == T``; packed:
            none).
        seqlens: padded only: true row lengths (AReaL's ``attention_mask.sum(-1)``); default ``T``, which is
            exactly AReaL (its bootstrap reads ``V[:, T − 1]``; rows without EOS fill the width anyway).
        cu_seqlens: ``[B + 1]`` offsets for packed input.

    Returns:
        ``(advantages, returns)`` shaped like ``rewards`` (float32, float64 for float64 inputs).

    Example (γ = λ = 1, no critic: every action gets the sum of the rewards from it to the end):
        >>> rewards, mask = torch.tensor([[0.0, 0.5, 2.0, 0.0]]), torch.tensor([[0, 1, 1, 0]])
        >>> gae_advantages(rewards, None, mask)[0].tolist()
        [[2.5, 2.5, 2.0, 0.0]]
    """
    mask = as_bool_mask(loss_mask)
    r = cast(Tensor, check_token_tensor(rewards, mask, "rewards"))  # rewards is required
    v = check_token_tensor(values, mask, "values")
    gamma = check_real(discount, "discount")
    lam = check_real(gae_lambda, "gae_lambda")
    dtype = result_dtype(r, v)
    lengths = sequence_lengths(mask, cu_seqlens, seqlens)
    eos_free = default_no_eos(mask, lengths, no_eos)
    r64 = r.to(F64)
    v64 = torch.zeros_like(r64) if v is None else v.to(F64)
    if mask.ndim == 2:
        adv = _gae_padded(r64, v64, mask, lengths, eos_free, gamma, lam)
    else:
        cu = validate_cu_seqlens(cast(Tensor, cu_seqlens).to(mask.device), mask.numel())  # checked by sequence_lengths
        adv_padded = _gae_padded(
            to_padded(r64, cu), to_padded(v64, cu), to_padded(mask, cu), lengths, eos_free, gamma, lam
        )
        adv = padded_to_packed(adv_padded, lengths)[0]
    return adv.to(dtype), (adv + v64).to(dtype)



@dataclass(frozen=True)
class AdvantageConfig:
    """The ``PPOActorConfig`` fields (``areal/api/cli_args.py``) AReaL's ``_compute_advantages`` reads.

    Attributes:
        reward_bias, reward_scaling, reward_clip: scalar reward shaping (0.0, 1.0, 20.0).
        reward_norm: :class:`NormConfig` applied to the shaped scalar rewards, or None (default).
        overlong_reward_penalty: apply :func:`~grpo_cli.core.rewards.reward_overlong_penalty` first (False).
        overlong_tokens, overlong_penalty_factor: required when the penalty is on.
        max_new_tokens: ``max_response_length`` of the penalty (1024).
        mask_no_eos_with_zero: sequences without EOS get reward 0 (False).
        kl_ctl: KL coefficient (0.1 — set 0.0 for GRPO runs without a reference model, as AReaL's examples
            do).
        kl_estimator: ``"k1"`` (default), ``"k2"``, ``"k3"``.
        discount, gae_lambda: γ and λ (1.0, 1.0).
        adv_norm: :class:`NormConfig` applied to the token advantages, or None (default).
    """

    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: NormConfig | None = None
    overlong_reward_penalty: bool = False
    overlong_tokens: int | None = None
    overlong_penalty_factor: float | None = None
    max_new_tokens: int = 1024
    mask_no_eos_with_zero: bool = False
    kl_ctl: float = 0.1
    kl_estimator: str = "k1"
    discount: float = 1.0
    gae_lambda: float = 1.0
    adv_norm: NormConfig | None = None

    def __post_init__(self) -> None:
        for name in ("reward_bias", "reward_scaling", "kl_ctl", "discount", "gae_lambda"):
            check_real(getattr(self, name), name)
        check_real(self.reward_clip, "reward_clip", minimum=0.0)
        for name in ("reward_norm", "adv_norm"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, NormConfig):
                raise TypeError(f"{name} must be a NormConfig or None, got {type(value).__name__}")
        for name in ("overlong_reward_penalty", "mask_no_eos_with_zero"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {self.kl_estimator!r}")
        if self.overlong_reward_penalty and (self.overlong_tokens is None or self.overlong_penalty_factor is None):
            raise ValueError("overlong_reward_penalty needs overlong_tokens and overlong_penalty_factor")


def compute_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    group_sizes: Sequence[int] | Tensor | None = None,
    no_eos: Tensor | None = None,
    seqlens: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    config: AdvantageConfig | None = None,
) -> dict[str, Tensor]:
    """AReaL's ``PPOActor._compute_advantages``, end to end.

    Overlong penalty → shaping → ``reward_norm`` → KL token rewards → token-level GAE → ``adv_norm``.

    Token tensors must already be next-token aligned as AReaL's are after its roll (use
    :func:`roll_to_next_token` on token-aligned dump columns: ``loss_mask`` and the behaviour log-probs; AReaL
    does not roll ``ref_logp``/``values``, which come out of its forward passes next-token aligned).

    Args:
        rewards: ``[B]`` raw task rewards.
        loss_mask: next-token-aligned mask, padded ``[B, T]`` or packed ``[N]``.
        old_logp, ref_logp: behaviour and reference log-probs for the KL reward (``ref_logp`` None = zeros).
        values: critic values (None = 0).
        group_ids, group_sizes: groups for ``group``-level normalisation (else ``NormConfig.group_size``).
        no_eos, seqlens, cu_seqlens: as in :func:`gae_advantages`.
        config: the :class:`AdvantageConfig` (AReaL defaults when None).

    Returns:
        ``{"rewards": [B] shaped/normalised scores, "kl_rewards", "tot_rewards", "advantages", "returns"}``.
    """
    cfg = AdvantageConfig() if config is None else config
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"config must be an AdvantageConfig, got {type(config).__name__}")
    mask = as_bool_mask(loss_mask)
    scores = rewards
    if cfg.overlong_reward_penalty:
        # AReaL sums the unrolled mask; a roll by −1 within each sequence does not change the sum.
        if mask.ndim == 2:
            response_lengths = mask.sum(-1)
        else:
            if cu_seqlens is None:
                raise ValueError("cu_seqlens is required for packed 1-D tokens")
            cu = validate_cu_seqlens(cu_seqlens.to(mask.device), mask.numel())
            response_lengths = segment_sum(mask.to(torch.int64), cu)
        scores = reward_overlong_penalty(
            scores,
            response_lengths,
            overlong_tokens=cast(int, cfg.overlong_tokens),
            overlong_penalty_factor=cast(float, cfg.overlong_penalty_factor),
            max_response_length=cfg.max_new_tokens,
        )
    scores = shape_rewards(
        scores, reward_bias=cfg.reward_bias, reward_scaling=cfg.reward_scaling, reward_clip=cfg.reward_clip
    )
    if cfg.reward_norm is not None:
        scores = normalize(scores, None, cfg.reward_norm, group_ids=group_ids, group_sizes=group_sizes)
    tot_rewards, kl_rewards = kl_regularized_rewards(
        scores,
        old_logp,
        ref_logp,
        mask,
        kl_ctl=cfg.kl_ctl,
        kl_estimator=cfg.kl_estimator,
        cu_seqlens=cu_seqlens,
        seqlens=seqlens,
        no_eos=no_eos,
        mask_no_eos_with_zero=cfg.mask_no_eos_with_zero,
    )
    advantages, returns = gae_advantages(
        tot_rewards,
        values,
        mask,
        discount=cfg.discount,
        gae_lambda=cfg.gae_lambda,
        no_eos=no_eos,
        seqlens=seqlens,
        cu_seqlens=cu_seqlens,
    )
    if cfg.adv_norm is not None:
        advantages = normalize(
            advantages,
            mask,
            cfg.adv_norm,
            group_ids=group_ids,
            group_sizes=group_sizes,
            cu_seqlens=cu_seqlens,
        )
    return {
        "rewards": scores,
        "kl_rewards": kl_rewards,
        "tot_rewards": tot_rewards,
        "advantages": advantages,
        "returns": returns,
    }
