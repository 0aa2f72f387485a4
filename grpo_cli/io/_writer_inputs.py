"""How :meth:`grpo_cli.io.writer.RolloutWriter.add` reads its inputs: padded ``[B, T]``, packed ``[N]`` with
``cu_seqlens`` or lists of 1-D tensors, per-token or per-sequence, into packed tensors and numpy arrays for Arrow."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_cli.core.packing import cu_seqlens_from_lengths, lengths_from_cu_seqlens, padded_to_packed
from grpo_cli.io.align import unroll_next_token
from grpo_cli.io.part_writer import SEQUENCE_INPUTS, TOKEN_INPUTS, _alignments

__all__: list[str] = []  # private to grpo_cli.io.writer

_INT32 = torch.iinfo(torch.int32)

# -- input normalisation ------------------------------------------------------------------------------------------
def _as_tensor(value: Any, name: str) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: cannot be read as a tensor ({exc})") from None


def _is_sequence_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


class _Layout:
    """How the per-token inputs of one ``add`` call are laid out, and how to pack any of them."""

    def __init__(
        self,
        new_logp: Any,
        *,
        cu_seqlens: Any,
        lengths: Any,
        attention_mask: Any,
        loss_mask: Any,
        mask_next_token: bool,
    ) -> None:
        self.form: str
        self.select: Tensor | None = None  # padded: [B, T] bool of the positions that exist
        self.shape: tuple[int, ...] = ()
        if _is_sequence_list(new_logp):
            if cu_seqlens is not None or attention_mask is not None:
                raise ValueError("new_logp is a list of sequences: cu_seqlens/attention_mask do not apply")
            self.form = "list"
            parts = [_as_tensor(x, "new_logp") for x in new_logp]
            for i, part in enumerate(parts):
                if part.dim() != 1:
                    raise ValueError(f"new_logp[{i}]: expected a 1-D tensor, got shape {tuple(part.shape)}")
            seq_lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
        else:
            tensor = _as_tensor(new_logp, "new_logp")
            self.shape = tuple(tensor.shape)
            if tensor.dim() == 1:
                if cu_seqlens is None:
                    raise ValueError(
                        "new_logp is 1-D: pass cu_seqlens for packed sequences (or a [1, T] tensor for one sequence)"
                    )
                self.form = "packed"
                cu = _as_tensor(cu_seqlens, "cu_seqlens").to("cpu", torch.int64)
                if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != tensor.numel():
                    raise ValueError(
                        f"cu_seqlens must be [B + 1] offsets from 0 to {tensor.numel()}, got {cu.tolist()[:8]}…"
                    )
                seq_lengths = lengths_from_cu_seqlens(cu)
                if bool((seq_lengths < 0).any()):
                    raise ValueError("cu_seqlens must be non-decreasing")
            elif tensor.dim() == 2:
                if cu_seqlens is not None:
                    raise ValueError("new_logp is padded [B, T]: cu_seqlens does not apply (use lengths)")
                self.form = "padded"
                n_rows, width = tensor.shape
                if attention_mask is not None:
                    if lengths is not None:
                        raise ValueError("pass lengths or attention_mask, not both")
                    select = _as_tensor(attention_mask, "attention_mask").to("cpu")
                    if tuple(select.shape) != self.shape:
                        raise ValueError(f"attention_mask has shape {tuple(select.shape)}, new_logp {self.shape}")
                    self.select = select != 0
                    seq_lengths = self.select.sum(dim=1).to(torch.int64)
                elif lengths is not None:
                    seq_lengths = _as_tensor(lengths, "lengths").to("cpu", torch.int64).reshape(-1)
                    if seq_lengths.numel() != n_rows or bool((seq_lengths < 0).any() | (seq_lengths > width).any()):
                        raise ValueError(f"lengths must be {n_rows} values in [0, {width}]")
                elif loss_mask is not None and not _is_sequence_list(loss_mask):
                    # Right padding assumed: a row ends at its last loss-mask position (+1 when the mask is
                    # next-token aligned, since that position then predicts the row's last token).
                    mask = _as_tensor(loss_mask, "loss_mask").to("cpu")
                    if tuple(mask.shape) != self.shape:
                        raise ValueError(f"loss_mask has shape {tuple(mask.shape)}, new_logp {self.shape}")
                    positions = torch.arange(1, width + 1, dtype=torch.int64)
                    seq_lengths = torch.where(mask != 0, positions, torch.zeros_like(positions)).amax(dim=1)
                    if mask_next_token:
                        seq_lengths = torch.clamp(seq_lengths + (seq_lengths > 0).to(torch.int64), max=width)
                    if n_rows == 0:
                        seq_lengths = torch.zeros(0, dtype=torch.int64)
                else:
                    seq_lengths = torch.full((n_rows,), width, dtype=torch.int64)
            else:
                raise ValueError(f"new_logp: expected [B, T], packed [N] or a list of 1-D tensors, got {self.shape}")
        self.lengths = seq_lengths
        self.cu_seqlens = cu_seqlens_from_lengths(seq_lengths)
        self.n_sequences = int(seq_lengths.numel())
        self.n_tokens = int(self.cu_seqlens[-1])

    def is_per_sequence(self, value: Any) -> bool:
        """Whether an ``advantages`` input holds one value per sequence (else one per token)."""
        if self.form == "list" and _is_sequence_list(value):
            return all(not isinstance(v, (list, tuple)) and _as_tensor(v, "advantages").dim() == 0 for v in value)
        tensor = _as_tensor(value, "advantages")
        if tensor.dim() == 0:
            return True
        if self.form == "padded":
            return tuple(tensor.shape) != self.shape and (
                tuple(tensor.shape) in ((self.n_sequences,), (self.n_sequences, 1))
            )
        if self.form == "packed":
            return tensor.dim() == 1 and tensor.numel() == self.n_sequences and tensor.numel() != self.n_tokens
        return tensor.dim() == 1 and tensor.numel() == self.n_sequences

    def pack(self, value: Any, name: str) -> Tensor:
        """A per-token input in this call's form → packed ``[N]`` (on the input's device)."""
        if self.form == "list":
            if not _is_sequence_list(value) or len(value) != self.n_sequences:
                raise ValueError(f"{name}: expected a list of {self.n_sequences} 1-D tensors like new_logp")
            parts = [_as_tensor(x, f"{name}[{i}]") for i, x in enumerate(value)]
            for i, (part, length) in enumerate(zip(parts, self.lengths.tolist())):
                if part.dim() != 1 or part.numel() != length:
                    raise ValueError(f"{name}[{i}]: has shape {tuple(part.shape)}, new_logp[{i}] has {length} tokens")
            if not parts:
                return torch.zeros(0)
            device = parts[0].device
            return torch.cat([p.to(device) for p in parts])
        tensor = _as_tensor(value, name)
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"{name}: has shape {tuple(tensor.shape)}, new_logp has {self.shape}")
        if self.form == "packed":
            return tensor
        if self.select is not None:
            return tensor[self.select.to(tensor.device)]
        packed, _ = padded_to_packed(tensor, self.lengths.to(tensor.device))
        return packed

    def per_sequence(self, value: Any, name: str) -> Tensor:
        """A per-sequence input (scalar, ``[B]``, ``[B, 1]`` or a list of scalars) → ``[B]``."""
        if _is_sequence_list(value):
            items = [_as_tensor(v, name) for v in value]
            if any(v.numel() != 1 for v in items):
                raise ValueError(f"{name}: expected one value per sequence")
            tensor = torch.stack([v.reshape(()).cpu() for v in items]) if items else torch.zeros(0)
        else:
            tensor = _as_tensor(value, name)
        if tensor.dim() == 0:
            return tensor.reshape(1).expand(self.n_sequences)
        if tensor.dim() == 2 and tensor.shape[1] == 1:
            tensor = tensor[:, 0]
        if tensor.dim() != 1 or tensor.numel() != self.n_sequences:
            raise ValueError(
                f"{name}: expected {self.n_sequences} values (one per sequence), got {tuple(tensor.shape)}"
            )
        return tensor


@dataclass
class PackedInputs:
    """One ``add`` call's inputs, token-aligned and packed (still torch, on the inputs' devices).

    Attributes:
        layout: how the call's per-token inputs were laid out.
        token: packed ``[N]`` per-token columns (``loss_mask`` bool), un-rolled to token alignment.
        sequence: ``[B]`` per-sequence columns (and ``advantages`` when given per sequence).
    """

    layout: _Layout
    token: dict[str, Tensor]
    sequence: dict[str, Tensor]


def pack_inputs(
    inputs: Mapping[str, Any],
    *,
    cu_seqlens: Any = None,
    lengths: Any = None,
    attention_mask: Any = None,
    alignment: str = "token",
    column_alignment: Mapping[str, str] | None = None,
    window: str = "full",
) -> PackedInputs:
    """``RolloutWriter.add``'s inputs (padded, packed or lists; token or next-token aligned) → :class:`PackedInputs`:
    the one reading of them, shared by the writer and the online ``Diagnoser``."""
    aligned = _alignments(alignment, column_alignment, window)
    layout = _Layout(
        inputs["new_logp"], cu_seqlens=cu_seqlens, lengths=lengths, attention_mask=attention_mask,
        loss_mask=inputs.get("loss_mask"), mask_next_token=aligned["loss_mask"] == "next_token",
    )
    cu = layout.cu_seqlens
    token: dict[str, Tensor] = {}
    sequence: dict[str, Tensor] = {}
    if layout.n_sequences == 0:
        return PackedInputs(layout, token, sequence)
    unrolled_any = False
    for name in TOKEN_INPUTS:
        value = inputs.get(name)
        if value is None:
            continue
        if name == "advantages" and layout.is_per_sequence(value):
            sequence[name] = layout.per_sequence(value, name)
            continue
        packed = layout.pack(value, name)
        if name == "loss_mask":
            packed = packed != 0
        if aligned[name] == "next_token":
            fill: float | int | bool = {"loss_mask": False, "versions": -1}.get(name, 0.0)
            packed = unroll_next_token(packed, cu.to(packed.device), fill)
            unrolled_any = unrolled_any or name != "versions"
        token[name] = packed
    if unrolled_any:
        # After un-rolling, the first token of every sequence has no value: never let it count.
        first = torch.zeros(layout.n_tokens, dtype=torch.bool)
        first[cu[:-1][layout.lengths > 0]] = True
        mask = token.get("loss_mask")
        token["loss_mask"] = ~first if mask is None else mask.cpu() & ~first
    for name in SEQUENCE_INPUTS:
        value = inputs.get(name)
        if value is not None:
            sequence[name] = layout.per_sequence(value, name)
    return PackedInputs(layout, token, sequence)


def _float_numpy(values: Tensor, name: str) -> np.ndarray:
    if values.dtype == torch.bool or not (values.is_floating_point() or values.dtype in _INTEGER_DTYPES):
        raise ValueError(f"{name}: expected float values, got {values.dtype}")
    if values.dtype != torch.float64:
        values = values.to(torch.float32)
    return values.cpu().numpy()


_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _int_numpy(values: Tensor, name: str, dtype: torch.dtype) -> np.ndarray:
    if values.is_floating_point():
        if not bool(torch.isfinite(values).all()) or not bool((values == torch.round(values)).all()):
            raise ValueError(f"{name}: expected integer values")
    elif values.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer values, got bool")
    if dtype == torch.int32 and values.numel() and (
        int(values.min()) < _INT32.min or int(values.max()) > _INT32.max
    ):
        raise ValueError(f"{name}: values outside the int32 range")
    return values.to(dtype).cpu().numpy()


def _mask_numpy(values: Tensor) -> np.ndarray:
    return (values != 0).cpu().numpy()


# -- the writer ---------------------------------------------------------------------------------------------------
