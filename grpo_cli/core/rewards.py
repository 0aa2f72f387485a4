"""Reward shaping as AReaL's PPO actor does it before computing advantages.

Mirrors the first steps of ``PPOActor._compute_advantages`` (``areal/trainer/ppo/actor.py``; the
helpers live in ``areal/utils/functional/functional.py`` and ``areal/utils/data.py``):

* :func:`reward_overlong_penalty` — AReaL's ``reward_overlong_penalty`` (DAPO's soft overlong punishment);
* :func:`shape_rewards` — bias, scaling and clip of the scalar task reward;
* :func:`kl_regularized_rewards` — the token rewards ``−kl_ctl · KL(old ‖ ref)`` with the scalar reward placed
  at ``max(seqlen − 2, 0)`` and zero at ``seqlen − 1``.

Token tensors are padded ``[B, T]`` (one sequence per row) or packed ``[N]`` with ``cu_seqlens`` ``[B + 1]``.
Elementwise math runs in the input dtype (float16/bfloat16 through float32, as AReaL's ``.float()``); results
are float32, or float64 when an input is float64. Masked positions are neutralised with ``torch.where``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_real, validate_cu_seqlens
from grpo_cli.core.kl import kl_estimate
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids

__all__ = [
    "KL_ESTIMATORS",
    "KL_REWARD_CLAMP",
    "kl_regularized_rewards",
    "reward_overlong_penalty",
    "shape_rewards",
]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""The estimators AReaL's ``KLEstimator`` accepts (``kl_estimator`` config field)."""

KL_REWARD_CLAMP: float = 10.0
"""AReaL's ``KLEstimator(apply_clamp=True)`` clamps every per-token estimate to ``[−10, 10]``."""


# ----------------------------------------------------------------------------------------------------
# dtype and layout helpers (shared with grpo_cli.core.advantages)
# ----------------------------------------------------------------------------------------------------


def result_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any given tensor is float64, else float32 (AReaL returns float32 everywhere)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def as_float(x: Tensor, name: str) -> Tensor:
    """``x`` as a real floating tensor for elementwise math (float16/bfloat16/integers → float32)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise ValueError(f"{name} must be real, got {x.dtype}")
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.to(torch.float32)


def check_per_sequence(x: Tensor, n_seq: int, name: str, device: torch.device) -> Tensor:
    """A 1-D ``[B]`` tensor on ``device``; ``ValueError`` for any other shape."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 1 or x.shape[0] != n_seq:
        raise ValueError(f"{name} must have shape ({n_seq},) (one value per sequence), got {tuple(x.shape)}")
    return x.to(device)


def token_layout(
    ref: Tensor, cu_seqlens: Tensor | None, seqlens: Tensor | None, what: str
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Per-token (position in its sequence, sequence length, sequence index), and the sequence count.

    The three tensors broadcast against ``ref``: padded ``[B, T]`` gives ``[1, T]``, ``[B, 1]``, ``[B, 1]``;
    packed ``[N]`` gives three ``[N]`` tensors. Padded rows have length ``seqlens[b]`` (AReaL's
    ``attention_mask.sum(-1)``), ``T`` when ``seqlens`` is None; packed lengths come from ``cu_seqlens``.
    """
    dev = ref.device
    if ref.ndim == 2:
        if cu_seqlens is not None:
            raise ValueError(f"{what}: cu_seqlens is only for packed 1-D input, got a padded [B, T] tensor")
        n_seq, width = ref.shape
        if seqlens is None:
            lengths = torch.full((n_seq,), width, dtype=torch.int64, device=dev)
        else:
            lengths = check_per_sequence(seqlens, n_seq, "seqlens", dev)
            if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
                raise ValueError(f"seqlens must be an integer tensor, got {lengths.dtype}")
            lengths = lengths.to(torch.int64)
            if n_seq and bool(((lengths < 0) | (lengths > width)).any()):
                raise ValueError(f"seqlens must lie in [0, {width}] (the padded width), got {lengths.tolist()}")
        position = torch.arange(width, device=dev).unsqueeze(0)
        return position, lengths.unsqueeze(1), torch.arange(n_seq, device=dev).unsqueeze(1), n_seq
    if ref.ndim != 1:
        raise ValueError(f"{what}: expected padded [B, T] or packed [N] tokens, got ndim={ref.ndim}")
    if cu_seqlens is None:
        raise ValueError(
            f"{what}: cu_seqlens is required for packed 1-D tokens; "
            "for one sequence pass cu_seqlens=torch.tensor([0, n_tokens])"
        )
    if seqlens is not None:
        raise ValueError(f"{what}: seqlens is only for padded input; packed lengths come from cu_seqlens")
    cu = validate_cu_seqlens(cu_seqlens.to(dev), ref.numel())
    seq = segment_ids(cu, ref.numel())
    position = torch.arange(ref.numel(), device=dev) - cu[seq]
    return position, lengths_from_cu_seqlens(cu)[seq], seq, cu.numel() - 1


def sequence_lengths(ref: Tensor, cu_seqlens: Tensor | None, seqlens: Tensor | None) -> Tensor:
    """``[B]`` int64 sequence lengths for padded (``seqlens`` or ``T``) or packed (``cu_seqlens``) tokens."""
    if ref.ndim == 2:
        _, lengths, _, _ = token_layout(ref, cu_seqlens, seqlens, "sequence_lengths")
        return lengths.squeeze(1)
    cu = validate_cu_seqlens(cu_seqlens.to(ref.device), ref.numel()) if cu_seqlens is not None else None
    if cu is None:
        raise ValueError("cu_seqlens is required for packed 1-D tokens")
    return lengths_from_cu_seqlens(cu)


def default_no_eos(ref: Tensor, lengths: Tensor, no_eos: Tensor | None) -> Tensor:
    """Per-sequence "ended without EOS" flags.

    Given flags are validated; otherwise AReaL's rule for padded rows — a row that fills the padded width
    (``seqlen == T``) had no EOS — and, for packed input where no padded width exists, ``False`` (every
    sequence ended with EOS).
    """
    n_seq = lengths.numel()
    if no_eos is not None:
        flags = check_per_sequence(no_eos, n_seq, "no_eos", lengths.device)
        return as_bool_mask(flags, "no_eos")
    if ref.ndim == 2:
        return lengths == ref.shape[1]
    return torch.zeros(n_seq, dtype=torch.bool, device=lengths.device)


# ----------------------------------------------------------------------------------------------------
# scalar reward shaping
# ----------------------------------------------------------------------------------------------------


def reward_overlong_penalty(
    rewards: Tensor,
    response_lengths: Tensor,
    *,
    overlong_tokens: int,
    overlong_penalty_factor: float,
    max_response_length: int = 1024,
) -> Tensor:
    """AReaL's ``reward_overlong_penalty`` (functional.py; DAPO's soft overlong punishment).

    ``r_i + min(−(len_i − (max_response_length − overlong_tokens)) / overlong_tokens · factor, 0)``: zero
    while ``len_i ≤ max − overlong_tokens``, ``−factor`` at ``len_i = max``, unbounded below beyond it.

    Args:
        rewards: ``[B]`` scalar task rewards.
        response_lengths: ``[B]`` generated-token counts, i.e. ``Σ loss_mask`` per sequence (rolling the mask,
            as AReaL does before the loss, does not change that sum).
        overlong_tokens: width of the penalty ramp (> 0).
        overlong_penalty_factor: penalty at ``len = max_response_length``.
        max_response_length: AReaL's ``actor.max_new_tokens`` (default 1024).

    Returns:
        ``[B]`` penalised rewards (float32, float64 for float64 rewards); the input is not modified.

    Example:
        >>> reward_overlong_penalty(torch.zeros(4), torch.tensor([900, 950, 1024, 1100]),
        ...                         overlong_tokens=128, overlong_penalty_factor=1.0).tolist()
        [-0.03125, -0.421875, -1.0, -1.59375]
    """
    r = as_float(rewards, "rewards")
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(r.shape)}")
    lengths = check_per_sequence(response_lengths, r.shape[0], "response_lengths", r.device)
    if isinstance(overlong_tokens, bool) or not isinstance(overlong_tokens, int) or overlong_tokens <= 0:
        raise ValueError(f"overlong_tokens must be a positive int, got {overlong_tokens!r}")
    if isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length <= 0:
        raise ValueError(f"max_response_length must be a positive int, got {max_response_length!r}")
    factor = check_real(overlong_penalty_factor, "overlong_penalty_factor")
    dtype = result_dtype(r)
    # AReaL: exceed = len − (max − overlong_tokens); penalty = min(−exceed / overlong_tokens · factor, 0).
    exceed = lengths.to(dtype) - float(max_response_length - overlong_tokens)
    penalty = torch.clamp(-exceed / overlong_tokens * factor, max=0.0)
    return r.to(dtype) + penalty


def shape_rewards(
    rewards: Tensor,
    *,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float | None = 20.0,
) -> Tensor:
    """AReaL's reward shaping (``PPOActor._compute_advantages``): ``clip((r + bias)·scaling, ±clip)``.

    Args:
        rewards: scalar rewards of any shape (usually ``[B]``).
        reward_bias: added first (AReaL default 0.0).
        reward_scaling: multiplies the biased reward (default 1.0).
        reward_clip: symmetric clip bound (default 20.0, must be ≥ 0); ``None`` disables clipping.

    Returns:
        The shaped rewards (float32, float64 for float64 input).

    Example (AReaL's ``gsm8k_grpo.yaml``: bias −0.5, scaling 10):
        >>> shape_rewards(torch.tensor([0.0, 1.0, 3.0]), reward_bias=-0.5, reward_scaling=10.0).tolist()
        [-5.0, 5.0, 20.0]
    """
    r = as_float(rewards, "rewards")
    bias = check_real(reward_bias, "reward_bias")
    scaling = check_real(reward_scaling, "reward_scaling")
    dtype = result_dtype(r)
    shaped = (r.to(dtype) + bias) * scaling
    if reward_clip is None:
        return shaped
    clip = check_real(reward_clip, "reward_clip", minimum=0.0)
    return torch.clamp(shaped, min=-clip, max=clip)


# ----------------------------------------------------------------------------------------------------
# KL-regularised token rewards
# ----------------------------------------------------------------------------------------------------


def kl_regularized_rewards(
    scores: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    loss_mask: Tensor,
    *,
    kl_ctl: float = 0.1,
    kl_estimator: str = "k1",
    cu_seqlens: Tensor | None = None,
    seqlens: Tensor | None = None,
    no_eos: Tensor | None = None,
    mask_no_eos_with_zero: bool = False,
) -> tuple[Tensor, Tensor]:
    """AReaL's KL-regularised token rewards (``PPOActor._compute_advantages``, step 4).

    ``kl_rewards_t = −kl_ctl · clamp(KL_k(old_t, ref_t), ±10)`` on valid tokens (0 elsewhere, as AReaL
    multiplies both log-probs by the mask first); ``tot_rewards`` = ``kl_rewards`` with position
    ``seqlen − 1`` set to 0 and the scalar score added at ``max(seqlen − 2, 0)`` — the last position whose
    next-token-aligned mask is 1. With ``mask_no_eos_with_zero`` a sequence without EOS gets 0 instead of its
    score.

    All token tensors are next-token aligned as AReaL's are at this point (``loss_mask`` rolled by −1).

    Args:
        scores: ``[B]`` (shaped) scalar rewards.
        old_logp: behaviour log-probs, ``[B, T]`` or packed ``[N]``; may be None only when ``kl_ctl == 0``.
        ref_logp: reference log-probs; None means zeros, which is what AReaL uses without a reference model
            (the pitfall: with the default ``kl_ctl`` 0.1 that adds ``−0.1 · clamp(old_logp, ±10)`` per
            token).
        loss_mask: bool or 0/1 mask, same shape.
        kl_ctl: KL coefficient (AReaL default 0.1).
        kl_estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        cu_seqlens: ``[B + 1]`` offsets for packed input.
        seqlens: padded only: ``[B]`` true row lengths (AReaL's ``attention_mask.sum(-1)``); default ``T``.
        no_eos: ``[B]`` flags for ``mask_no_eos_with_zero``; default AReaL's rule (padded: ``seqlen == T``;
            packed: none).
        mask_no_eos_with_zero: AReaL's option of the same name.

    Returns:
        ``(tot_rewards, kl_rewards)``, both shaped like ``loss_mask`` (float32, or float64 for float64
        inputs).

    Example:
        >>> tot, kl = kl_regularized_rewards(torch.tensor([1.0]), torch.tensor([[0.0, -1.0, -1.0, 0.0]]),
        ...     torch.tensor([[0.0, -1.5, -0.5, 0.0]]), torch.tensor([[0, 1, 1, 0]]), kl_ctl=0.1)
        >>> [round(v, 6) for v in tot[0].tolist()]
        [0.0, -0.05, 1.05, 0.0]
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"Invalid KL estimator: {kl_estimator!r}. Valid choices: {', '.join(KL_ESTIMATORS)}")
    ctl = check_real(kl_ctl, "kl_ctl")
    if not isinstance(mask_no_eos_with_zero, bool):
        raise TypeError(f"mask_no_eos_with_zero must be a bool, got {type(mask_no_eos_with_zero).__name__}")
    mask = as_bool_mask(loss_mask)
    dev = mask.device
    position, length, seq, n_seq = token_layout(mask, cu_seqlens, seqlens, "kl_regularized_rewards")
    score = as_float(check_per_sequence(scores, n_seq, "scores", dev), "scores")
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        if t is not None and (not isinstance(t, Tensor) or t.shape != mask.shape):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must have the loss_mask shape {tuple(mask.shape)}, got {shape}")
    dtype = result_dtype(score, old_logp, ref_logp)

    zero = torch.zeros((), dtype=dtype, device=dev)
    if ctl == 0.0:
        kl_rewards = torch.zeros(mask.shape, dtype=dtype, device=dev)
    else:
        if old_logp is None:
            raise ValueError("old_logp is required for KL-regularised rewards when kl_ctl != 0")
        old = as_float(old_logp.to(dev), "old_logp")
        ref = torch.zeros_like(old) if ref_logp is None else as_float(ref_logp.to(dev), "ref_logp")
        # AReaL multiplies both log-probs by the mask, so masked positions give KL(0, 0) = 0; torch.where
        # keeps garbage there from turning into NaN. AReaL's KLEstimator(kl_estimator, apply_clamp=True) is
        # k1/k2/k3 of Δ = old − ref clamped to ±10.
        old_valid = torch.where(mask, old, 0.0).to(dtype)
        ref_valid = torch.where(mask, ref, 0.0).to(dtype)
        kl = kl_estimate(old_valid, ref_valid, kl_estimator, clamp=KL_REWARD_CLAMP)
        kl_rewards = torch.where(mask, -ctl * kl, zero)

    lengths = sequence_lengths(mask, cu_seqlens, seqlens)
    eos_free = default_no_eos(mask, lengths, no_eos)
    if mask_no_eos_with_zero:
        score = torch.where(eos_free, torch.zeros_like(score), score)
    score_tok = score.to(dtype)[seq]
    # AReaL: rewards[b, seqlen − 1] = 0, then rewards[b, max(seqlen − 2, 0)] += score (empty sequences get
    # none).
    last = position == length - 1
    reward_at = (position == torch.clamp(length - 2, min=0)) & (length > 0)
    tot_rewards = torch.where(last, zero, kl_rewards) + torch.where(reward_at, score_tok, zero)
    return tot_rewards, kl_rewards
