"""Packed-token helpers: flat values + ``cu_seqlens`` offsets, and padded ``[B, T]`` conversions.

Every per-token tensor in the core is either *packed* (1-D, ``N`` tokens, with ``cu_seqlens`` of shape
``[B + 1]`` holding sequence boundaries, ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == N``) or *padded*
(``[B, T]``, one sequence per row). These helpers are pure torch, device-agnostic and allocation-light.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

__all__ = [
    "broadcast_to_tokens",
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "packed_to_padded",
    "padded_to_packed",
    "segment_count",
    "segment_ids",
    "segment_max",
    "segment_span",
    "segment_min",
    "segment_sum",
]


def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """Cumulative offsets ``[0, l0, l0 + l1, ...]`` as int64.

    Example:
        >>> cu_seqlens_from_lengths(torch.tensor([2, 0, 3])).tolist()
        [0, 2, 2, 5]
    """
    lengths = lengths.to(torch.int64)
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def lengths_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Per-sequence lengths (int64) from offsets."""
    cu = cu_seqlens.to(torch.int64)
    return cu[1:] - cu[:-1]


class _SegmentIdsCache(threading.local):
    """The last few :func:`segment_ids` results, per thread.

    A batch's ``cu_seqlens`` is shared by every metric group, and each used to rebuild the same ``[N]`` ids (a
    ``repeat_interleave``, the costliest step of many per-sequence reductions). An entry is reused only for the
    very same tensor object (a weak reference, so a freed tensor never matches a new one at the same address),
    unmodified since (``_version``, bumped by every in-place op) and with ids that were not modified in place either.
    """

    SIZE = 8

    def __init__(self) -> None:
        self.entries: list[tuple[weakref.ref[Tensor], int, int, Tensor, int]] = []

    def get(self, cu_seqlens: Tensor, n_tokens: int) -> Tensor | None:
        for ref, version, n, ids, ids_version in self.entries:
            if ref() is cu_seqlens and version == cu_seqlens._version and n == n_tokens and (
                ids._version == ids_version
            ):
                return ids
        return None

    def put(self, cu_seqlens: Tensor, n_tokens: int, ids: Tensor) -> None:
        entry = (weakref.ref(cu_seqlens), cu_seqlens._version, n_tokens, ids, ids._version)
        self.entries = [entry, *[e for e in self.entries if e[0]() is not None][: self.SIZE - 1]]


_segment_ids_cache = _SegmentIdsCache()


def segment_ids(cu_seqlens: Tensor, n_tokens: int | None = None) -> Tensor:
    """Sequence index of every token (int64), e.g. ``[0, 0, 2, 2, 2]`` for lengths ``[2, 0, 3]``.

    The result is memoised for the same ``cu_seqlens`` tensor (see :class:`_SegmentIdsCache`): treat it as
    read-only.
    """
    total = int(cu_seqlens[-1] - cu_seqlens[0]) if n_tokens is None else n_tokens
    cached = _segment_ids_cache.get(cu_seqlens, total)
    if cached is not None:
        return cached
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device)
    out = torch.repeat_interleave(ids, lengths, output_size=total)
    _segment_ids_cache.put(cu_seqlens, total, out)
    return out


def broadcast_to_tokens(per_sequence: Tensor, cu_seqlens: Tensor, n_tokens: int | None = None) -> Tensor:
    """Repeat one value per sequence over that sequence's tokens."""
    # A gather through the (memoised) segment ids: the same values as repeat_interleave, several times faster.
    return per_sequence.index_select(0, segment_ids(cu_seqlens, n_tokens).to(per_sequence.device))


def segment_sum(values: Tensor, cu_seqlens: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Per-sequence sums of packed ``values`` (empty sequences give 0).

    Args:
        values: ``[N]`` packed values (already neutralised at positions that must not count).
        cu_seqlens: ``[B + 1]`` offsets.
        dtype: accumulation dtype (default: ``values.dtype``); pass ``torch.float64`` for exact sums.

    Example:
        >>> segment_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 2, 3])).tolist()
        [3.0, 0.0, 3.0]
    """
    dtype = values.dtype if dtype is None else dtype
    n_seq = cu_seqlens.numel() - 1
    out = torch.zeros(n_seq, dtype=dtype, device=values.device)
    if values.numel() == 0:
        return out
    if dtype.is_floating_point and values.ndim == 1:
        # Sequences are contiguous runs, so a segmented reduction does it: each sum runs through its tokens in
        # order, as index_add_ would (the same bits), but several times faster and without CUDA atomics.
        lengths = lengths_from_cu_seqlens(cu_seqlens).to(values.device)
        return torch.segment_reduce(values.to(dtype), "sum", lengths=lengths, unsafe=True)
    return out.index_add_(0, segment_ids(cu_seqlens, values.numel()), values.to(dtype))


def _running_count(mask: Tensor) -> Tensor:
    """``[N + 1]`` int64: entry i counts the true tokens before token i."""
    running = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask, 0, dtype=torch.int64, out=running[1:])
    return running


def segment_count(mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """int64 count of the true tokens of packed ``mask`` per sequence, from one running count (a prefix sum is
    cheaper than a scatter, and integer counts do not depend on the order of addition).

    Example:
        >>> segment_count(torch.tensor([True, False, True]), torch.tensor([0, 2, 2, 3])).tolist()
        [1, 0, 1]
    """
    running = _running_count(mask)
    start = (cu_seqlens - cu_seqlens[0]).to(device=mask.device, dtype=torch.int64)
    return running.index_select(0, start[1:]) - running.index_select(0, start[:-1])


def segment_span(mask: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: the count of true tokens of packed ``mask``, the index (into the packed tokens) of its first
    true token (the int64 maximum where it has none) and of its last (−1 where none).

    One running count answers all three: a sequence's first true token is the first position where the count
    passes its value at the sequence's start, its last where the count first reaches its value at the end (binary
    searches of a non-decreasing vector, instead of scatters over every token).

    Example:
        >>> [t.tolist() for t in segment_span(torch.tensor([False, True, True, False]), torch.tensor([0, 3, 3, 4]))]
        [[2, 0, 0], [1, 9223372036854775807, 9223372036854775807], [2, -1, -1]]
    """
    running = _running_count(mask)
    start = (cu_seqlens[:-1] - cu_seqlens[0]).to(device=mask.device, dtype=torch.int64)
    end = (cu_seqlens[1:] - cu_seqlens[0]).to(device=mask.device, dtype=torch.int64)
    before, through = running.index_select(0, start), running.index_select(0, end)
    count = through - before
    after = running[1:]
    first = torch.searchsorted(after, before + 1)
    last = torch.searchsorted(after, through)
    some = count > 0
    return (count, torch.where(some, first, torch.iinfo(torch.int64).max), torch.where(some, last, -1))


def _segment_extreme(values: Tensor, cu_seqlens: Tensor, reduce: str, fill: float) -> Tensor:
    n_seq = cu_seqlens.numel() - 1
    out = torch.full((n_seq,), fill, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return out
    return out.scatter_reduce_(0, segment_ids(cu_seqlens, values.numel()), values, reduce=reduce)


def segment_max(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence maxima; empty sequences give ``-inf``."""
    return _segment_extreme(values, cu_seqlens, "amax", float("-inf"))


def segment_min(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence minima; empty sequences give ``+inf``."""
    return _segment_extreme(values, cu_seqlens, "amin", float("inf"))


def padded_to_packed(padded: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Left-aligned ``[B, T]`` rows → (packed ``[N]`` values, ``cu_seqlens``), taking ``lengths[b]`` per row."""
    lengths = lengths.to(torch.int64)
    positions = torch.arange(padded.shape[1], device=padded.device)
    keep = positions.unsqueeze(0) < lengths.unsqueeze(1)
    return padded[keep], cu_seqlens_from_lengths(lengths)


def packed_to_padded(values: Tensor, cu_seqlens: Tensor, pad_value: float = 0.0) -> Tensor:
    """Packed ``[N]`` values → left-aligned ``[B, T_max]`` rows filled with ``pad_value``."""
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    n_seq = lengths.numel()
    width = int(lengths.max()) if n_seq else 0
    out = torch.full((n_seq, width), pad_value, dtype=values.dtype, device=values.device)
    positions = torch.arange(width, device=values.device)
    keep = positions.unsqueeze(0) < lengths.unsqueeze(1)
    out[keep] = values
    return out
