"""AReaL's ``NormConfig`` and ``Normalization`` (``cli_args.py``, ``data.py``): the
``reward_norm`` / ``adv_norm`` of its PPO actor, at batch or group level."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_real, validate_cu_seqlens
from grpo_cli.core.advantages._common import F64, group_index, segment_add
from grpo_cli.core.packing import lengths_from_cu_seqlens
from grpo_cli.core.rewards import as_float, result_dtype

__all__ = ["NormConfig", "Normalization", "normalize"]


_NORM_LEVELS = ("batch", "group", None)


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

    Semantics (AReaL ``Normalization``, ``areal/utils/data.py``), all statistics in float64 and token-weighted
    (each valid token counts once):

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
    x64 = xf.reshape(-1).to(F64)
    zero = torch.zeros((), dtype=F64, device=dev)
    one = torch.ones((), dtype=F64, device=dev)
    x_valid = torch.where(m, x64, zero)
    m64 = m.to(F64)

    group_tok: Tensor | None = None
    single_row_tok: Tensor | None = None
    n_groups = 0
    if cfg.mean_level == "group" or cfg.std_level == "group":
        inverse, n_groups = group_index(n_rows, dev, group_ids, group_sizes, cfg.group_size)
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
        total = segment_add(x_valid, seg, n_seg)[seg]
        count = segment_add(m64, seg, n_seg)[seg]
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
        sum_sq = segment_add(centered.square(), seg, n_seg)[seg]
        count = segment_add(m64, seg, n_seg)[seg]
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
