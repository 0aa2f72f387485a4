"""Advantage estimators: AReaL's normalisation and token-level GAE, and the GRPO-family peers.

Each function mirrors one framework function (AReaL's ``areal/utils/functional.py`` and
``areal/engine/ppo/actor.py``, verl's ``verl/trainer/ppo/core_algos.py``):

================================  ==========================================================================
grpo-cli                          mirrors
================================  ==========================================================================
:class:`NormConfig`               AReaL ``NormConfig`` (cli_args.py)
:func:`normalize`                 AReaL ``Normalization.__call__`` (data.py) — ``reward_norm`` / ``adv_norm``
:func:`gae_advantages`            AReaL ``_compute_token_level_gae`` (gae.py; in ``_compute_advantages``)
:func:`compute_advantages`        AReaL ``PPOActor._compute_advantages`` (shaping, KL rewards, GAE, adv_norm)
:func:`grpo_advantages`           verl ``compute_grpo_outcome_advantage`` (TRL/OpenRLHF/slime: other ε)
:func:`drgrpo_advantages`         verl GRPO with ``norm_adv_by_std_in_grpo=False``; OpenRLHF ``dr_grpo``
:func:`rloo_advantages`           verl ``compute_rloo_outcome_advantage``; OpenRLHF ``rloo``
:func:`reinforce_pp_advantages`   verl ``compute_reinforce_plus_plus_outcome_advantage``
:func:`masked_whiten`             verl ``verl_F.masked_whiten``
================================  ==========================================================================

Layouts: per-token inputs are padded ``[B, T]`` (one sequence per row) or packed ``[N]`` with ``cu_seqlens``;
per-sequence estimators take rewards ``[B]`` and integer ``group_ids`` ``[B]`` (any values, groups need not be
contiguous). Statistics are accumulated in float64 with ``torch.unique`` + ``index_add_`` (no Python loop over
sequences; GAE and return-to-go loop over time steps, as every peer does). Results are float32 (AReaL's output
dtype), or float64 when an input is float64. Nothing here is differentiable by design (advantages are
constants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor

from grpo_cli._choices import ADVANTAGE_ESTIMATORS
from grpo_cli.core._loss_common import as_bool_mask, check_real, validate_cu_seqlens
from grpo_cli.core.conventions import check_convention
from grpo_cli.core.packing import lengths_from_cu_seqlens, packed_to_padded, padded_to_packed, segment_sum
from grpo_cli.core.rewards import (
    KL_ESTIMATORS,
    as_float,
    check_per_sequence,
    default_no_eos,
    kl_regularized_rewards,
    result_dtype,
    reward_overlong_penalty,
    sequence_lengths,
    shape_rewards,
    token_layout,
)

__all__ = [
    "REINFORCE_PP_CONVENTIONS",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "NormConfig",
    "Normalization",
    "compute_advantages",
    "drgrpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "masked_whiten",
    "normalize",
    "outcome_to_token_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "roll_to_next_token",
    "sequence_to_tokens",
]


_NORM_LEVELS = ("batch", "group", None)
_F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------


def _group_index(
    n_rows: int,
    device: torch.device,
    group_ids: Tensor | None,
    group_sizes: Sequence[int] | Tensor | None,
    group_size: int | None,
) -> tuple[Tensor, int]:
    """(dense group index ``[B]`` int64, group count) from ids, contiguous sizes, or a fixed group size."""
    if group_ids is not None and group_sizes is not None:
        raise ValueError("pass group_ids or group_sizes, not both")
    if group_ids is not None:
        ids = check_per_sequence(group_ids, n_rows, "group_ids", device)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got {ids.dtype}")
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return inverse.to(torch.int64), uniq.numel()
    if group_sizes is not None:
        sizes = torch.as_tensor(group_sizes, device=device)
        if sizes.ndim != 1 or sizes.is_floating_point() or sizes.dtype == torch.bool:
            raise ValueError(f"group_sizes must be a 1-D sequence of ints, got {group_sizes!r}")
        sizes = sizes.to(torch.int64)
        if bool((sizes <= 0).any()):
            raise ValueError(f"group_sizes must be all positive, got {sizes.tolist()}")
        if int(sizes.sum()) != n_rows:
            raise ValueError(f"group_sizes sum ({int(sizes.sum())}) must equal the batch size ({n_rows})")
        return torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes), sizes.numel()
    if group_size is None:
        raise ValueError("group_ids is required")
    # AReaL's fixed slicing leaves rows past bs // group_size with mean 0 and std 0 (output ≈ x/eps); refuse.
    if n_rows % group_size:
        raise ValueError(
            f"batch size {n_rows} is not a multiple of group_size {group_size}; pass group_ids or group_sizes"
        )
    return torch.arange(n_rows, device=device) // group_size, n_rows // group_size


def _segment_add(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Float64 per-segment sums of ``values`` (already neutralised) by ``index``."""
    return torch.zeros(n, dtype=_F64, device=values.device).index_add_(0, index, values.to(_F64))


def _to_padded(x: Tensor, cu: Tensor) -> Tensor:
    return packed_to_padded(x, cu, pad_value=0)


def _check_token_tensor(t: Tensor | None, mask: Tensor, name: str) -> Tensor | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != loss_mask shape {tuple(mask.shape)}")
    return as_float(t.to(mask.device), name)


# ----------------------------------------------------------------------------------------------------
# AReaL Normalization
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormConfig:
    """AReaL's ``NormConfig`` (``areal/api/cli_args.py``) for ``reward_norm`` and ``adv_norm``.

    Attributes:
        mean_level: ``"batch"`` (default), ``"group"`` or ``None`` (no centering; ``"none"`` is accepted).
        mean_leave1out: subtract the mean of the *other* elements (RLOO-style baseline).
        std_level: ``"batch"`` (default), ``"group"`` or ``None`` (std 1 and eps 0).
        std_unbiased: divide by ``N − 1`` (default True since AReaL v0.3.4) rather than ``N``.
        eps: added to the std (default 1e-5).
        group_size: rows per group when neither ``group_ids`` nor ``group_sizes`` is given (default 1).
    """

    mean_level: str | None = "batch"
    mean_leave1out: bool = False
    std_level: str | None = "batch"
    std_unbiased: bool = True
    eps: float = 1e-5
    group_size: int = 1

    def __post_init__(self) -> None:
        for name in ("mean_level", "std_level"):
            level = getattr(self, name)
            if isinstance(level, str) and level.lower() == "none":
                object.__setattr__(self, name, None)
            elif level not in _NORM_LEVELS:
                raise ValueError(f"{name} must be one of 'batch', 'group', None; got {level!r}")
        for name in ("mean_leave1out", "std_unbiased"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "eps", check_real(self.eps, "eps", minimum=0.0))
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")


def normalize(
    x: Tensor,
    loss_mask: Tensor | None = None,
    config: NormConfig | None = None,
    *,
    group_ids: Tensor | None = None,
    group_sizes: Sequence[int] | Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """AReaL's ``Normalization(config)(x, loss_mask, group_sizes=...)``: ``(x − mean) · m / (std + eps)``.

    Semantics (areal.md §2.2), all statistics in float64 and token-weighted (each valid token counts once):

    * mean — ``batch``: ``S/N`` over all valid elements (0 when ``N = 0``); ``group``: the same per group;
      ``None``: 0. Leave-one-out: ``(S − x_i)/(N − 1)`` on valid elements, ``S/N`` on masked ones, 0 when
      ``N ≤ 1``; a group of one row uses ``x`` itself as its mean (output 0, AReaL's newest behaviour).
    * std around each element's own mean: ``sqrt(Σ m·(x − mean_i)² / (N − 1))`` if ``std_unbiased`` (1 when
      ``N ≤ 1``, and 1 for a one-row group), else ``/ N`` (1 when ``N = 0``); ``std_level=None``: std 1, eps
      0.
    * output ``(x − mean)·m / (std + eps)`` (0 at masked positions); a mask with no valid element returns
      ``x`` unchanged, as AReaL does.

    Groups are rows (sequences): ``group_ids`` ``[B]`` (any integers, not necessarily contiguous),
    ``group_sizes`` (AReaL's contiguous ``traj_group_sizes``), or ``config.group_size`` consecutive rows (the
    batch size must then be a multiple of it; AReaL would divide the leftover rows by eps).

    Args:
        x: ``[B]`` per-sequence values (``reward_norm``), padded ``[B, T]`` or packed ``[N]`` tokens
            (``adv_norm``).
        loss_mask: bool or 0/1, shaped like ``x``; None means every element is valid.
        config: the :class:`NormConfig` (default ``NormConfig()``: batch mean, batch unbiased std, eps 1e-5).
        group_ids: ``[B]`` integer group id per sequence.
        group_sizes: contiguous group sizes summing to ``B``.
        cu_seqlens: ``[B + 1]`` offsets when ``x`` is packed tokens.

    Returns:
        Normalised values shaped like ``x`` (float32, float64 for float64 input).

    Example (GRPO's reward_norm, group mean and std with two rollouts per prompt):
        >>> cfg = NormConfig(mean_level="group", std_level="group", eps=0.0)
        >>> x, ids = torch.tensor([1.0, 3.0, 0.0, 4.0]), torch.tensor([7, 2, 7, 2])
        >>> normalize(x, config=cfg, group_ids=ids).tolist()
        [0.7071067690849304, -0.7071067690849304, -0.7071067690849304, 0.7071067690849304]
    """
    cfg = NormConfig() if config is None else config
    if not isinstance(cfg, NormConfig):
        raise TypeError(f"config must be a NormConfig, got {type(config).__name__}")
    xf = as_float(x, "x")
    dev = xf.device
    dtype = result_dtype(xf)
    if xf.ndim == 1 and cu_seqlens is None:  # per-sequence values
        n_rows = xf.shape[0]
        row = torch.arange(n_rows, device=dev)
    elif xf.ndim == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed 1-D input, got a padded [B, T] tensor")
        n_rows, width = xf.shape
        row = torch.arange(n_rows, device=dev).repeat_interleave(width)
    elif xf.ndim == 1:
        cu = validate_cu_seqlens(cast(Tensor, cu_seqlens).to(dev), xf.numel())  # None is the branch above
        n_rows = cu.numel() - 1
        row = torch.repeat_interleave(torch.arange(n_rows, device=dev), lengths_from_cu_seqlens(cu))
    else:
        raise ValueError(f"x must be [B], [B, T] or packed [N], got shape {tuple(xf.shape)}")

    if loss_mask is None:
        m = torch.ones(xf.numel(), dtype=torch.bool, device=dev)
    else:
        mask = as_bool_mask(loss_mask.to(dev))
        if mask.shape != xf.shape:
            raise ValueError(f"loss_mask shape {tuple(mask.shape)} != x shape {tuple(xf.shape)}")
        m = mask.reshape(-1)
    x64 = xf.reshape(-1).to(_F64)
    zero = torch.zeros((), dtype=_F64, device=dev)
    one = torch.ones((), dtype=_F64, device=dev)
    x_valid = torch.where(m, x64, zero)
    m64 = m.to(_F64)

    group_tok: Tensor | None = None
    single_row_tok: Tensor | None = None
    n_groups = 0
    if cfg.mean_level == "group" or cfg.std_level == "group":
        inverse, n_groups = _group_index(n_rows, dev, group_ids, group_sizes, cfg.group_size)
        group_tok = inverse[row]
        rows_per_group = torch.bincount(inverse, minlength=n_groups)
        single_row_tok = (rows_per_group == 1)[group_tok]
    batch_tok = torch.zeros_like(row)

    def segments(level: str) -> tuple[Tensor, int, Tensor | None]:
        """(segment of each token, segment count, one-row-group flag per token or None at batch level)."""
        return (cast(Tensor, group_tok), n_groups, single_row_tok) if level == "group" else (batch_tok, 1, None)

    # Step 1: mean (AReaL Normalization._compute_mean).
    if cfg.mean_level is None:
        mean = torch.zeros_like(x64)
    else:
        seg, n_seg, single = segments(cfg.mean_level)
        total = _segment_add(x_valid, seg, n_seg)[seg]
        count = _segment_add(m64, seg, n_seg)[seg]
        if cfg.mean_leave1out:
            others = (total - x_valid) / torch.clamp(count - m64, min=1.0)
            mean = torch.where(count > 1, torch.where(m, others, total / torch.clamp(count, min=1.0)), zero)
            if single is not None:  # one-row group: no peer to leave out, so the row is its own baseline
                mean = torch.where(single, x_valid, mean)
        else:
            mean = torch.where(count > 0, total / torch.clamp(count, min=1.0), zero)
    centered = torch.where(m, x64 - mean, zero)

    # Step 2: std around each element's own mean (AReaL Normalization._compute_std).
    if cfg.std_level is None:
        out = centered  # std 1 and eps 0
    else:
        seg, n_seg, single = segments(cfg.std_level)
        sum_sq = _segment_add(centered.square(), seg, n_seg)[seg]
        count = _segment_add(m64, seg, n_seg)[seg]
        if cfg.std_unbiased:
            std = torch.where(count > 1, torch.sqrt(sum_sq / torch.clamp(count - 1, min=1.0)), one)
            if single is not None:  # AReaL: a one-row group with the unbiased std gets std 1
                std = torch.where(single, one, std)
        else:
            std = torch.where(count > 0, torch.sqrt(sum_sq / torch.clamp(count, min=1.0)), one)
        out = centered / (std + cfg.eps)
    if loss_mask is not None:  # AReaL returns x unchanged when nothing is valid
        out = torch.where(m.any(), out, x64)
    return out.reshape(xf.shape).to(dtype)


class Normalization:
    """AReaL's ``Normalization``: ``Normalization(cfg)(x, loss_mask, group_ids=...)`` is :func:`normalize`.

    Example:
        >>> Normalization(NormConfig(std_level=None))(torch.tensor([1.0, 2.0, 6.0])).tolist()
        [-2.0, -1.0, 3.0]
    """

    def __init__(self, config: NormConfig) -> None:
        if not isinstance(config, NormConfig):
            raise TypeError(f"config must be a NormConfig, got {type(config).__name__}")
        self.config = config

    def __call__(
        self,
        x: Tensor,
        loss_mask: Tensor | None = None,
        *,
        group_ids: Tensor | None = None,
        group_sizes: Sequence[int] | Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        return normalize(x, loss_mask, self.config, group_ids=group_ids, group_sizes=group_sizes, cu_seqlens=cu_seqlens)

    def __repr__(self) -> str:
        return f"Normalization({self.config!r})"


# ----------------------------------------------------------------------------------------------------
# Token-level GAE (AReaL)
# ----------------------------------------------------------------------------------------------------


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
    zero = torch.zeros((), dtype=_F64, device=rewards.device)
    # AReaL starts the loop at T − 2 (the last position of a row is never an action after the mask roll); with
    # per-row lengths that is "positions ≥ L − 1 are skipped".
    active = mask & (torch.arange(width, device=rewards.device).unsqueeze(0) < (lengths - 1).unsqueeze(1))
    last = torch.clamp(lengths - 1, min=0).unsqueeze(1)
    # Bootstrap with V at the row's last position only when the sequence was cut off (no EOS).
    next_value = torch.where(no_eos & (lengths > 0), values.gather(1, last).squeeze(1), zero)
    last_gae = torch.zeros(n_seq, dtype=_F64, device=rewards.device)
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
    r = cast(Tensor, _check_token_tensor(rewards, mask, "rewards"))  # rewards is required
    v = _check_token_tensor(values, mask, "values")
    gamma = check_real(discount, "discount")
    lam = check_real(gae_lambda, "gae_lambda")
    dtype = result_dtype(r, v)
    lengths = sequence_lengths(mask, cu_seqlens, seqlens)
    eos_free = default_no_eos(mask, lengths, no_eos)
    r64 = r.to(_F64)
    v64 = torch.zeros_like(r64) if v is None else v.to(_F64)
    if mask.ndim == 2:
        adv = _gae_padded(r64, v64, mask, lengths, eos_free, gamma, lam)
    else:
        cu = validate_cu_seqlens(cast(Tensor, cu_seqlens).to(mask.device), mask.numel())  # checked by sequence_lengths
        adv_padded = _gae_padded(
            _to_padded(r64, cu), _to_padded(v64, cu), _to_padded(mask, cu), lengths, eos_free, gamma, lam
        )
        adv = padded_to_packed(adv_padded, lengths)[0]
    return adv.to(dtype), (adv + v64).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Full AReaL pipeline
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageConfig:
    """The ``PPOActorConfig`` fields AReaL's ``_compute_advantages`` reads, with its defaults (areal.md §5).

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


# ----------------------------------------------------------------------------------------------------
# Per-sequence (outcome) estimators
# ----------------------------------------------------------------------------------------------------


def _outcome_groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, torch.dtype]:
    """(rewards float64, dense group index, rows per group, reward sum per group, output dtype)."""
    r = as_float(rewards, "rewards")
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B] (one scalar per sequence), got shape {tuple(r.shape)}")
    inverse, n_groups = _group_index(r.shape[0], r.device, group_ids, None, None)
    r64 = r.to(_F64)
    count = _segment_add(torch.ones_like(r64), inverse, n_groups)
    total = _segment_add(r64, inverse, n_groups)
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
    sum_sq = _segment_add((r64 - (total / count)[inverse]).square(), inverse, count.numel())
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


# ----------------------------------------------------------------------------------------------------
# REINFORCE++ (verl)
# ----------------------------------------------------------------------------------------------------


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
    x = cast(Tensor, _check_token_tensor(values, mask, "values"))  # values is required
    eps = check_real(eps, "eps", minimum=0.0)
    if not isinstance(unbiased, bool) or not isinstance(shift_mean, bool):
        raise TypeError("unbiased and shift_mean must be bools")
    dtype = result_dtype(x)
    x64 = torch.where(mask, x.to(_F64), 0.0)
    n = mask.sum().to(_F64)
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
    r = cast(Tensor, _check_token_tensor(token_rewards, mask, "token_rewards"))  # token_rewards is required
    g = check_real(gamma, "gamma")
    dtype = result_dtype(r)
    r64 = torch.where(mask, r.to(_F64), 0.0)
    if mask.ndim == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed 1-D input, got a padded [B, T] tensor")
        returns = _return_to_go_padded(r64, mask, g, carry)
    elif mask.ndim == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for packed 1-D tokens")
        cu = validate_cu_seqlens(cu_seqlens.to(mask.device), mask.numel())
        padded = _return_to_go_padded(_to_padded(r64, cu), _to_padded(mask, cu), g, carry)
        returns = padded_to_packed(padded, lengths_from_cu_seqlens(cu))[0]
    else:
        raise ValueError(f"expected padded [B, T] or packed [N] tokens, got ndim={mask.ndim}")
    advantages = masked_whiten(returns, mask, eps=eps)
    return advantages.to(dtype), returns.to(dtype)


# ----------------------------------------------------------------------------------------------------
# Layout helpers for the estimators
# ----------------------------------------------------------------------------------------------------


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
