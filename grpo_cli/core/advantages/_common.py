"""What the advantage estimators share: dense group indices, float64 segment sums and token-tensor checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_cli.core.packing import packed_to_padded
from grpo_cli.core.rewards import as_float, check_per_sequence

__all__ = ["F64", "check_token_tensor", "group_index", "segment_add", "to_padded"]


F64 = torch.float64


def group_index(
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


def segment_add(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Float64 per-segment sums of ``values`` (already neutralised) by ``index``."""
    return torch.zeros(n, dtype=F64, device=values.device).index_add_(0, index, values.to(F64))


def to_padded(x: Tensor, cu: Tensor) -> Tensor:
    """Packed ``[N]`` → padded ``[B, T]`` with zeros past each sequence."""
    return packed_to_padded(x, cu, pad_value=0)


def check_token_tensor(t: Tensor | None, mask: Tensor, name: str) -> Tensor | None:
    """``t`` as a real float tensor on the mask's device, checked to have the mask's shape (``None`` passes)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != loss_mask shape {tuple(mask.shape)}")
    return as_float(t.to(mask.device), name)
