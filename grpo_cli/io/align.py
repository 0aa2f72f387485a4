"""Undoing next-token alignment on packed sequences (``docs/recipes/``).

Schema v1 is *token-aligned*: the value at index t of a sequence belongs to token t (its log-prob given the tokens
before it). Several trainers keep per-token tensors *next-token aligned* instead — the value at index t belongs to
token t + 1 — because that is where the logits of position t are scored (AReaL after ``_compute_advantages``,
twinkle's rolled labels, OpenRLHF's ``[B, T − 1]`` action tensors). Two shapes occur:

* the same length as the sequence, last slot garbage (AReaL, twinkle): :func:`unroll_next_token` shifts every
  sequence right by one within its own segment and drops the last slot;
* one slot shorter than the sequence (OpenRLHF, ``A = T − 1``): :func:`prepend_slot` inserts the missing first
  slot, which makes each sequence one token longer.

Either way the first token of a sequence has no value (no position predicts it); it gets ``fill`` and must be
masked (fill ``False`` for the loss mask). Both functions are pure torch on packed ``[N]`` values + ``cu_seqlens``,
create their outputs on the input's device and never modify their inputs (which may alias Arrow buffers).

Example:
    >>> import torch
    >>> cu = torch.tensor([0, 3, 5])
    >>> unroll_next_token(torch.tensor([1.0, 2.0, 9.0, 4.0, 9.0]), cu, 0.0).tolist()
    [0.0, 1.0, 2.0, 0.0, 4.0]
    >>> values, cu2 = prepend_slot(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 2, 3]), 0.0)
    >>> values.tolist(), cu2.tolist()
    ([0.0, 1.0, 2.0, 0.0, 4.0], [0, 3, 5])
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["prepend_slot", "unroll_next_token"]


def _check(values: Tensor, cu_seqlens: Tensor) -> None:
    if values.dim() != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("expected packed [N] values and [B + 1] cu_seqlens")
    if int(cu_seqlens[-1]) != values.numel():
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are {values.numel()} values")


def unroll_next_token(values: Tensor, cu_seqlens: Tensor, fill: float | int | bool) -> Tensor:
    """Next-token aligned → token-aligned, same lengths: ``out[t] = values[t − 1]`` within each sequence.

    Args:
        values: ``[N]`` packed values; index t of a sequence holds the value of its token t + 1.
        cu_seqlens: ``[B + 1]`` int64 offsets.
        fill: the value of each sequence's first token (no position predicts it).

    Returns:
        ``[N]`` token-aligned values (a new tensor); each sequence's last input value, which would belong to a
        token after the end, is dropped.
    """
    _check(values, cu_seqlens)
    out = torch.empty_like(values)
    if values.numel() == 0:
        return out
    out[1:] = values[:-1]  # crosses sequence boundaries; every first token is overwritten below
    starts = cu_seqlens[:-1].to(device=values.device, dtype=torch.int64)
    nonempty = cu_seqlens[1:].to(starts.device) > starts
    out[starts[nonempty]] = torch.as_tensor(fill, dtype=values.dtype, device=values.device)
    return out


def prepend_slot(values: Tensor, cu_seqlens: Tensor, fill: float | int | bool) -> tuple[Tensor, Tensor]:
    """Next-token aligned with one slot fewer than tokens (OpenRLHF) → token-aligned, one slot longer.

    Args:
        values: ``[N]`` packed values; index t of a sequence holds the value of its token t + 1.
        cu_seqlens: ``[B + 1]`` int64 offsets of ``values``.
        fill: the value of the inserted first slot of every sequence.

    Returns:
        ``(out, out_cu_seqlens)`` with ``out`` of ``N + B`` values and ``out_cu_seqlens = cu_seqlens + [0, 1, …, B]``.
    """
    _check(values, cu_seqlens)
    cu = cu_seqlens.to(device=values.device, dtype=torch.int64)
    n_seq = cu.numel() - 1
    shift = torch.arange(n_seq + 1, device=values.device, dtype=torch.int64)
    new_cu = cu + shift
    out = torch.full((values.numel() + n_seq,), fill, dtype=values.dtype, device=values.device)
    lengths = cu[1:] - cu[:-1]
    # token i of sequence s moves to i + s + 1: every sequence's tokens shift by (its index + 1)
    offsets = torch.repeat_interleave(shift[1:], lengths, output_size=values.numel())
    out[torch.arange(values.numel(), device=values.device) + offsets] = values
    return out, new_cu
