"""Shared helpers of the peers' logged figures (:mod:`grpo_cli.core.peer_figures`): padded ``[B, T]`` inputs
with a bool (or 0/1) mask, elementwise math in the working dtype, sums in float64, masked positions neutralised
with ``torch.where`` or left out by :func:`pack`."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from grpo_cli.core._loss_common import as_bool_mask, check_same_shape, compute_dtype
from grpo_cli.core.packing import cu_seqlens_from_lengths, lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.state import MetricState, StateSpec

__all__ = ["F64", "VERL_SAFETY_BOUND", "fold_one_batch", "masked_max", "masked_mean", "masked_min", "pack",
           "packed_mean", "prepare", "sequence_means", "where"]

VERL_SAFETY_BOUND = 20.0
"""verl's ``SAFETY_BOUND``: log-ratios are clamped to ±20 before ``exp`` in the rollout-correction helper."""

F64 = torch.float64


def prepare(ref: Tensor, mask: Tensor, **others: Tensor | None) -> tuple[Tensor, torch.dtype]:
    """Check padded ``[B, T]`` inputs of one shape; return the bool mask and the working dtype."""
    if not isinstance(ref, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(ref).__name__}")
    if ref.ndim != 2:
        raise ValueError(f"expected padded [B, T] tensors, got shape {tuple(ref.shape)}")
    m = as_bool_mask(mask, "mask")
    check_same_shape("log_probs", ref, mask=m, **others)
    return m, compute_dtype(ref.dtype)


def pack(mask: Tensor, *values: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The valid tokens of padded ``[B, T]`` rows, packed row by row, and their ``cu_seqlens`` (every row is a
    sequence, an all-masked one empty): the layout the streaming groups see, so that a batch function and its
    streaming group call the same packed per-token and per-sequence functions.

    Example:
        >>> cu, (x,) = pack(torch.tensor([[True, False, True], [False, False, False]]), torch.arange(6.0).view(2, 3))
        >>> cu.tolist(), x.tolist()
        ([0, 2, 2], [0.0, 2.0])
    """
    return cu_seqlens_from_lengths(mask.sum(-1)), [v[mask] for v in values]


def packed_mean(x: Tensor) -> float:
    """Mean of packed values (valid tokens, or one value per sequence) in float64, 0 when there are none (as
    :func:`masked_mean`)."""
    return float(x.to(F64).sum() / x.numel()) if x.numel() else 0.0


def sequence_means(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence means of packed values in float64, 0 for an empty sequence (verl's ``masked_mean(axis=-1)``)."""
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(values.device)
    return segment_sum(values, cu_seqlens, F64) / lengths.to(F64).clamp(min=1.0)


def fold_one_batch(
    specs: Mapping[str, StateSpec], device: torch.device, *partials: Mapping[str, Tensor]
) -> MetricState:
    """A state holding one batch's partials: a batch function's path through the ``*_figures`` reductions its
    streaming group applies to the folded batches of a dump."""
    state = MetricState(specs, device)
    for partial in partials:
        state.update(**partial)
    return state


def where(mask: Tensor, x: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` on the mask, ``fill`` elsewhere (the peers multiply by the mask; this keeps inf/NaN out)."""
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> float:
    """Σ x·m / Σ m over everything (float64), 0 for an empty mask (verl divides by Σm + 1e-8)."""
    n = int(mask.sum())
    return float(where(mask, x).to(F64).sum() / n) if n else 0.0


def masked_max(x: Tensor, mask: Tensor) -> float:
    """Largest value on the mask (−inf when empty)."""
    return float(where(mask, x.to(F64), -math.inf).max()) if x.numel() else -math.inf


def masked_min(x: Tensor, mask: Tensor) -> float:
    """Smallest value on the mask (+inf when empty)."""
    return float(where(mask, x.to(F64), math.inf).min()) if x.numel() else math.inf
