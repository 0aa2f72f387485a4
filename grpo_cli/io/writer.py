"""``RolloutWriter``: schema-v1 dumps written from inside a trainer, one call per (micro-)batch.

Two lines in a training loop (``docs/recipes/`` has one page per framework)::

    writer = RolloutWriter("dumps/run1", rank=rank, metadata={"framework": "verl", "temperature": 1.0})
    writer.add(step=step, new_logp=logp, old_logp=rollout_logp, loss_mask=mask, advantages=adv)  # [B, T] each

and ``writer.close()`` at the end (or use it as a context manager). What it does:

* **Inputs** in any of three forms, chosen by the form of ``new_logp`` (every per-token column of a call must use
  the same form): padded ``[B, T]`` tensors (sequence lengths from ``attention_mask``, ``lengths``, or else the
  last loss-mask position of each row), packed ``[N]`` tensors with ``cu_seqlens``, or lists of 1-D tensors.
  Tensors may live on any device and have any float dtype (bfloat16/float16 are stored as float32). Per-sequence
  values (``rewards``, ``current_version``, ``group_id``, ``seq_id``, ``micro_batch``, ``eos``, and ``advantages``
  when it has one value per sequence) are ``[B]``/``[B, 1]`` tensors, lists, or one scalar for the whole call.
* **Absent columns stay absent**: a column you do not pass is not written (never zeros), so ``analyze`` omits the
  figures that need it.
* **Alignment**: ``alignment="next_token"`` (value t belongs to token t + 1: AReaL's loss inputs, twinkle, OpenRLHF)
  is un-rolled once to schema v1's token alignment (:func:`grpo_cli.io.align.unroll_next_token`); a per-column
  override handles exceptions such as AReaL's ``versions``, which stay token-aligned. The first token of every
  sequence then has no value: it is masked in the stored ``loss_mask`` (written even when you passed none).
* **Several forwards per sequence** (PPO epochs): ``RolloutWriter(..., dedupe=True)`` keeps only the first ``add``
  of each ``seq_id`` within a step, so ``new_logp`` is each sequence's first training forward.
* **Files**: one rank-local part file per step, ``part-step{step:06d}-rank{rank:03d}.parquet`` (a step seen again
  after another step gets ``-1``, ``-2``, … before ``.parquet``), written to a hidden temporary file and renamed
  into place when the step is complete, so a reader never sees half a file. Several ``add`` calls of one step go
  to the same file; row groups hold about ``row_group_tokens`` tokens, so memory stays bounded.
* **Fast settings** (Arrow's Parquet writer options, measured in ``docs/performance.md``): non-nullable list and
  element fields, no dictionary for floats, BYTE_STREAM_SPLIT + zstd for floats, bit-packed bool masks, int32 versions.
* **Metadata**: Parquet key-value metadata ``grpo_cli.<key>`` (JSON values): what you pass (``framework``,
  ``framework_version``, ``temperature``, ``top_p``, ``top_k``, ``logprobs_mode``, ``hook``, or anything else) plus
  ``schema_version``, ``writer``, ``rank``, ``step``, ``alignment`` (always ``"token"`` after un-rolling),
  ``source_alignment`` and ``window``. :func:`read_metadata` reads them back.

Importing this module pulls in torch and pyarrow but no CLI code (typer, rich); the Parquet side of the writer
(:class:`~grpo_cli.io.part_writer.PartWriter`, :func:`fast_write_options`, :func:`read_metadata`) is torch-free.

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as d, RolloutWriter(d, metadata={"framework": "demo"}) as w:
    ...     w.add(step=0, new_logp=[torch.tensor([-0.5, -1.0]), torch.tensor([-2.0])], rewards=[1.0, 0.0])
    2
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_cli.core.packing import cu_seqlens_from_lengths
from grpo_cli.io._writer_inputs import _float_numpy, _int_numpy, _mask_numpy, pack_inputs
from grpo_cli.io.parquet_file import ColumnRewriter, ParquetFileOut
from grpo_cli.io.part_writer import (
    ALIGNMENTS,
    METADATA_PREFIX,
    SEQUENCE_INPUTS,
    TOKEN_INPUTS,
    WINDOWS,
    PartWriter,
    arrow_columns,
    fast_write_options,
    read_metadata,
)
from grpo_cli.io.schema import COLUMNS
from grpo_cli.io.storage import Location

__all__ = [
    "ALIGNMENTS",
    "METADATA_PREFIX",
    "SEQUENCE_INPUTS",
    "TOKEN_INPUTS",
    "WINDOWS",
    "ColumnRewriter",
    "ParquetFileOut",
    "RolloutWriter",
    "fast_write_options",
    "read_metadata",
]


class RolloutWriter(PartWriter):
    """Writes schema-v1 rank-local part files from a trainer (see the module docstring).

    Args:
        directory: output directory (created if missing); several ranks may share it. Also an object-storage
            prefix (``"s3://bucket/run1"``, ``gs://``, ``hdfs://``, ``abfs://``; its bucket must exist): each part is
            streamed to a hidden temporary key and moved to its final name only when complete (docs/storage.md).
        rank: this process's rank (part of the file name and of the metadata).
        metadata: JSON-serialisable facts about the run, stored as ``grpo_cli.<key>`` Parquet metadata. Use
            ``framework``, ``framework_version``, ``temperature``, ``top_p``, ``top_k``, ``logprobs_mode`` (e.g.
            vLLM's ``raw_logprobs``/``processed_logprobs``) and ``hook`` (where the writer is called) where known.
        row_group_tokens: about how many tokens a row group holds (bounds the writer's buffer).
        fsync: flush each finished part file to disk before renaming it into place.
        dedupe: keep only the first ``add`` of each ``seq_id`` within a step and drop later ones. With several
            PPO epochs (or mini-batch passes) a loss hook sees each sequence more than once; with ``dedupe`` the
            dump's ``new_logp`` is each sequence's *first* training forward. Needs ``seq_id``.

    Raises:
        ValueError: a bad rank, metadata that is not JSON-serialisable, or a reserved metadata key.
        InputError: an object-storage prefix whose bucket is missing, whose credentials are refused or whose
            endpoint cannot be reached.
    """

    def __init__(
        self,
        directory: Location,
        *,
        rank: int = 0,
        metadata: Mapping[str, Any] | None = None,
        row_group_tokens: int = 1 << 20,
        fsync: bool = True,
        dedupe: bool = False,
    ) -> None:
        super().__init__(directory, rank=rank, metadata=metadata, row_group_tokens=row_group_tokens, fsync=fsync)
        self.dedupe = dedupe
        self._dedupe_step: int | None = None
        self._dedupe_seen: set[int] = set()

    # -- context manager ------------------------------------------------------------------------------------------
    def __enter__(self) -> RolloutWriter:
        return self

    # -- public API -----------------------------------------------------------------------------------------------
    def add(
        self,
        *,
        step: int,
        new_logp: Any,
        old_logp: Any = None,
        prox_logp: Any = None,
        ref_logp: Any = None,
        entropy: Any = None,
        loss_mask: Any = None,
        versions: Any = None,
        advantages: Any = None,
        rewards: Any = None,
        current_version: Any = None,
        group_id: Any = None,
        seq_id: Any = None,
        micro_batch: Any = None,
        cu_seqlens: Any = None,
        lengths: Any = None,
        attention_mask: Any = None,
        alignment: str = "token",
        column_alignment: Mapping[str, str] | None = None,
        window: str = "full",
        **columns: Any,
    ) -> int:
        """Add the sequences of one (micro-)batch of training step ``step``.

        Args:
            step: training step (int); also names the part file and fills the ``step`` column.
            new_logp: required. Padded ``[B, T]``, packed ``[N]`` (with ``cu_seqlens``) or a list of 1-D tensors;
                the other per-token inputs must use the same form and shape.
            old_logp, prox_logp, ref_logp, entropy, loss_mask, versions: per-token inputs or ``None`` (absent).
            advantages: per token (like ``new_logp``) or per sequence (``[B]``, ``[B, 1]``, scalars).
            rewards, current_version, group_id, seq_id: per sequence (``[B]``, ``[B, 1]``, a list, or a scalar).
            micro_batch: per sequence like ``seq_id`` (usually one scalar per call): the id of the training
                micro-batch (forward) these rows come from, so per-micro-batch averages can be rebuilt.
            **columns: any other schema-v1 column by name (``teacher_logp`` per token, ``eos`` per sequence, …).
            cu_seqlens: ``[B + 1]`` offsets for packed inputs.
            lengths: ``[B]`` true lengths of right-padded ``[B, T]`` rows.
            attention_mask: ``[B, T]``, non-zero where a padded row has a token (any padding side).
                Without ``lengths``/``attention_mask`` a padded row ends at its last ``loss_mask`` position.
            alignment: ``"token"`` (value t belongs to token t) or ``"next_token"`` (to token t + 1).
            column_alignment: per-column exceptions, e.g. ``{"versions": "token"}`` for AReaL.
            window: ``"full"`` (prompt + response) or ``"response"`` (response only); recorded in metadata.

        Returns:
            The number of sequences added.

        Raises:
            ValueError: shapes that disagree, a bad alignment/window, or a column set, dtype or convention that
                differs from the writer's earlier calls (the reader needs one schema per dump).
            TypeError: ``step`` is not an integer, or a keyword that is not a schema-v1 column.
        """
        if self._closed:
            raise ValueError("the writer is closed")
        step = _as_step(step)
        unknown = sorted(set(columns) - set(TOKEN_INPUTS) - set(SEQUENCE_INPUTS))
        if unknown:
            raise TypeError(f"add() got unexpected keyword(s) {', '.join(unknown)} (schema v1 columns: "
                            f"{', '.join(COLUMNS)})")
        inputs = {"new_logp": new_logp, "old_logp": old_logp, "prox_logp": prox_logp, "ref_logp": ref_logp,
                  "entropy": entropy, "loss_mask": loss_mask, "versions": versions, "advantages": advantages,
                  "rewards": rewards, "current_version": current_version, "group_id": group_id, "seq_id": seq_id,
                  "micro_batch": micro_batch, **columns}
        packed_inputs = pack_inputs(inputs, cu_seqlens=cu_seqlens, lengths=lengths, attention_mask=attention_mask,
                                    alignment=alignment, column_alignment=column_alignment, window=window)
        layout, token, sequence = packed_inputs.layout, packed_inputs.token, packed_inputs.sequence
        if layout.n_sequences == 0:
            return 0
        cu = layout.cu_seqlens
        lengths = layout.lengths
        if self.dedupe:
            keep = self._unseen(step, sequence.get("seq_id"))
            if not bool(keep.all()):
                token_keep = torch.repeat_interleave(keep, lengths, output_size=layout.n_tokens)
                token = {k: v[token_keep.to(v.device)] for k, v in token.items()}
                sequence = {k: v[keep.to(v.device)] for k, v in sequence.items()}
                lengths = lengths[keep]
                cu = cu_seqlens_from_lengths(lengths)
            if lengths.numel() == 0:
                return 0
        # 2. → Arrow (host copies happen here, once)
        n_tokens = int(cu[-1])
        arrays = arrow_columns(
            token, sequence, cu.numpy(), step, mask=_mask_numpy, floats=_float_numpy,
            integers=lambda values, name, wide: _int_numpy(values, name, torch.int64 if wide else torch.int32))
        n_sequences = int(lengths.numel())
        conventions = (json.dumps({"default": alignment, **dict(column_alignment or {})}, sort_keys=True), window)
        batch = self._record_batch(arrays, conventions)
        self._append(step, batch, n_tokens)
        if self.dedupe:
            self._remember(step, sequence["seq_id"])
        return n_sequences

    def _unseen(self, step: int, seq_id: Tensor | None) -> Tensor:
        """``[B]`` bool: sequences not yet written in this step (first occurrence within the call wins)."""
        if seq_id is None:
            raise ValueError("dedupe=True needs seq_id (the identity of a sequence across forwards)")
        if step != self._dedupe_step:  # only the current step is remembered: memory stays bounded
            self._dedupe_step, self._dedupe_seen = step, set()
        keep, local = [], set()
        for value in seq_id.tolist():
            keep.append(value not in self._dedupe_seen and value not in local)
            local.add(value)
        return torch.tensor(keep, dtype=torch.bool)

    def _remember(self, step: int, seq_id: Tensor) -> None:
        if step == self._dedupe_step:
            self._dedupe_seen.update(seq_id.tolist())



def _as_step(step: Any) -> int:
    if isinstance(step, Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, np.integer):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step
