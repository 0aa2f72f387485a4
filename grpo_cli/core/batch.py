"""The packed batch every reader produces and every metric consumes.

A :class:`TokenBatch` holds a block of whole sequences as flat per-token tensors plus ``cu_seqlens``. Per-token
columns that the dump does not have are ``None`` (never zeros). :meth:`TokenBatch.valid` compacts the batch to the
tokens that enter the loss (``loss_mask == 1``), which is what almost every figure is computed over; compacting once
means masked positions can hold any garbage (even NaN) without reaching a figure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core._loss_common import all_true
from grpo_cli.core.packing import cu_seqlens_from_lengths, segment_ids

__all__ = ["PER_SEQUENCE_COLUMNS", "PER_TOKEN_COLUMNS", "TokenBatch"]

_MEMO_LOCK = threading.Lock()


class _Once:
    """A value computed by the first caller of :meth:`get`; concurrent callers wait for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.value: Any = None

    def get(self, compute: Callable[[], Any]) -> Any:
        with self.lock:
            if not self.done:
                self.value = compute()
                self.done = True
        return self.value

PER_TOKEN_COLUMNS = (
    "new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions", "advantages", "teacher_logp"
)
PER_SEQUENCE_COLUMNS = ("rewards", "current_version", "step", "group_id", "seq_id", "eos", "micro_batch")


@dataclass
class TokenBatch:
    """Whole sequences, packed.

    Attributes:
        cu_seqlens: ``[B + 1]`` int64 offsets.
        new_logp: ``[N]`` log π_θ (float32 or float64).
        loss_mask: ``[N]`` bool, True where the token enters the loss.
        old_logp, prox_logp, ref_logp, entropy: ``[N]`` floats or ``None``.
        versions: ``[N]`` int64 policy version per token (−1 for prompt tokens) or ``None``.
        advantages: ``[N]`` float per token (per-sequence advantages are broadcast) or ``None``.
        rewards: ``[B]`` float or ``None``.
        current_version, step, group_id, seq_id: ``[B]`` int64 or ``None``.
        teacher_logp: ``[N]`` teacher-model log-probs (distillation) or ``None``.
        eos: ``[B]`` int64, 1 where the sequence ended with EOS, 0 where it was cut off, or ``None``.
        micro_batch: ``[B]`` int64 id of the training micro-batch (forward) the sequence came from, or ``None``.
        file_index: index of the source file in the sorted input list.
        rows: ``[B]`` int64 row of each sequence in its file (for token-per-row files, its first token's row).
        positions: ``[N]`` int64 position of each token within its sequence (set on valid views only).
        group_key: ``[B]`` int64 code of a ``--group-by`` column outside the schema's int columns (a string task
            or data-source name, a prompt id, …): the index of the sequence's value in the dump's sorted distinct
            values (``RolloutDataset.group_values``), or ``None``.
    """

    cu_seqlens: Tensor
    new_logp: Tensor
    loss_mask: Tensor
    old_logp: Tensor | None = None
    prox_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    entropy: Tensor | None = None
    versions: Tensor | None = None
    advantages: Tensor | None = None
    rewards: Tensor | None = None
    current_version: Tensor | None = None
    step: Tensor | None = None
    group_id: Tensor | None = None
    seq_id: Tensor | None = None
    teacher_logp: Tensor | None = None
    eos: Tensor | None = None
    micro_batch: Tensor | None = None
    file_index: int = 0
    rows: Tensor | None = None
    positions: Tensor | None = field(default=None)
    group_key: Tensor | None = None

    @property
    def n_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def n_tokens(self) -> int:
        return self.new_logp.numel()

    @property
    def device(self) -> torch.device:
        return self.new_logp.device

    @property
    def ratio_base_logp(self) -> Tensor | None:
        """The PPO ratio's base: ``prox_logp`` when present (decoupled PPO, AReaL), else ``old_logp`` (or ``None``)."""
        return self.prox_logp if self.prox_logp is not None else self.old_logp

    def memo(self) -> dict[str, Any]:
        """Scratch space for values derived from this very batch object, shared by everything that reads it.

        Several metric groups need the same intermediate of a batch (e.g. AReaL's PPO terms of the valid tokens);
        the first computes it under a key, the others read it. The dict belongs to this object: it is not a
        dataclass field, so :func:`dataclasses.replace`, :meth:`to`, :meth:`valid` and :meth:`select_sequences`
        return batches with an empty memo. Never change a batch's tensors after memoising something derived.
        """
        memo = self.__dict__.get("_memo")
        if memo is None:
            with _MEMO_LOCK:  # metric threads may ask at once: one dict per batch
                memo = self.__dict__.setdefault("_memo", {})
        return memo

    def memoised(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` stored under ``key`` in :meth:`memo` by its first caller; callers in other threads (the
        metric threads of ``analyze``) wait for that one instead of computing it again."""
        memo = self.memo()
        with _MEMO_LOCK:
            once = memo.get(key)
            if once is None:
                once = memo[key] = _Once()
        return once.get(compute)

    def columns(self) -> frozenset[str]:
        """Names of the data columns present (not ``None``)."""
        names = (*PER_TOKEN_COLUMNS, *PER_SEQUENCE_COLUMNS)
        return frozenset(name for name in names if getattr(self, name) is not None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return TokenBatch(**moved)

    def sequence_keys(self) -> Tensor:
        """``[B, 2]`` int64 (file, row) per sequence: a location independent of batching."""
        rows = self.rows if self.rows is not None else torch.arange(self.n_sequences, device=self.device)
        return torch.stack([torch.full_like(rows, self.file_index), rows], dim=1)

    def select_sequences(self, keep: Tensor) -> TokenBatch:
        """The batch restricted to the sequences where ``keep`` (``[B]`` bool) is True, or to the sequences
        ``keep`` (``[K]`` int64 indices) in that order."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        if keep.dtype == torch.bool:
            token_keep = torch.repeat_interleave(keep, lengths, output_size=self.n_tokens)
            # One nonzero() and index_select per column: boolean indexing would redo the nonzero for every column
            # and gathers through a slower kernel.
            tokens = torch.nonzero(token_keep).flatten()
            sequences = torch.nonzero(keep).flatten()
        else:
            sequences = keep
            kept = lengths.index_select(0, sequences)
            total = int(kept.sum())
            # token j of the k-th kept sequence sits at cu[sequences[k]] + j
            shift = self.cu_seqlens[:-1].index_select(0, sequences) - (torch.cumsum(kept, 0) - kept)
            tokens = torch.arange(total, device=self.device) + torch.repeat_interleave(shift, kept, output_size=total)
        changes: dict[str, Any] = {}  # Tensor | None per column (Any: dataclasses.replace types each field)
        for name in (*PER_TOKEN_COLUMNS, "loss_mask", "positions"):
            value = getattr(self, name)
            changes[name] = None if value is None else value.index_select(0, tokens)
        for name in (*PER_SEQUENCE_COLUMNS, "rows", "group_key"):
            value = getattr(self, name)
            changes[name] = None if value is None else value.index_select(0, sequences)
        return replace(self, cu_seqlens=cu_seqlens_from_lengths(lengths.index_select(0, sequences)), **changes)

    def sequence_range(self, start: int, stop: int) -> TokenBatch:
        """Sequences ``start … stop − 1`` as views of this batch's tensors (no copy), and their valid view as views
        of this batch's (built here if it was not yet): ``select_sequences`` of a contiguous run, without gathering."""
        cu = self.cu_seqlens
        first, last = int(cu[start]), int(cu[stop])
        changes: dict[str, Any] = {}  # Tensor | None per column (Any: dataclasses.replace types each field)
        for name in (*PER_TOKEN_COLUMNS, "loss_mask", "positions"):
            value = getattr(self, name)
            changes[name] = None if value is None else value[first:last]
        for name in (*PER_SEQUENCE_COLUMNS, "rows", "group_key"):
            value = getattr(self, name)
            changes[name] = None if value is None else value[start:stop]
        part = replace(self, cu_seqlens=cu[start:stop + 1] - cu[start], **changes)
        valid = self.valid()
        if valid is self:
            part.memo()["compact"] = True
        else:
            part.memo()["valid"] = valid.sequence_range(start, stop)
        return part

    def valid(self) -> TokenBatch:
        """The batch restricted to loss-mask tokens (sequences kept, possibly empty), with ``positions`` set.

        Built once per batch object and memoised (:meth:`memo`): the validator and every metric group share it.
        """
        memo = self.memo()
        if memo.get("compact"):
            return self  # a valid view: its tokens are all valid, their positions already the sequence's
        cached = memo.get("valid")
        if cached is not None:
            return cached
        view = self._compact()
        memo["valid"] = view
        # A flag, not a reference to itself: a cycle would keep every batch's tensors alive until the cyclic
        # garbage collector ran (+400 MiB peak RSS on a 20 M-token dump).
        view.memo()["compact"] = True
        return view

    def _compact(self) -> TokenBatch:
        seq = segment_ids(self.cu_seqlens, self.n_tokens)
        if all_true(self.loss_mask):
            # Every token is in the loss (dumps that store responses only): the columns are already compact, so
            # nothing is gathered; the result equals the general path's (tested).
            index = torch.arange(self.n_tokens, device=self.device)
            return replace(
                self,
                cu_seqlens=cu_seqlens_from_lengths(self.cu_seqlens[1:] - self.cu_seqlens[:-1]),
                positions=index - self.cu_seqlens[:-1].index_select(0, seq),
            )
        # One nonzero() shared by every column (boolean indexing would redo it per column), and index_select
        # rather than advanced indexing: the same gather through a kernel several times faster on CPU.
        index = torch.nonzero(self.loss_mask).flatten()
        seq_valid = seq.index_select(0, index)
        lengths = torch.bincount(seq_valid, minlength=self.n_sequences)
        compact = {name: getattr(self, name) for name in PER_TOKEN_COLUMNS}
        compact = {name: (None if value is None else value.index_select(0, index)) for name, value in compact.items()}
        return replace(
            self,
            cu_seqlens=cu_seqlens_from_lengths(lengths),
            loss_mask=torch.ones(index.numel(), dtype=torch.bool, device=self.device),
            positions=index - self.cu_seqlens[:-1].index_select(0, seq_valid),
            **compact,
        )
