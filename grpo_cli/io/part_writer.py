"""``PartWriter``: the torch-free half of :class:`~grpo_cli.io.writer.RolloutWriter` — Arrow record batches of one
training step → a rank-local schema-v1 part file with the fast settings and the ``grpo_cli.*`` metadata.

It owns everything after the inputs have become Arrow arrays: one schema and one set of conventions per writer, the
file names (``part-step{step:06d}-rank{rank:03d}.parquet``, ``-1``, ``-2``, … for a step seen again), row groups of
about ``row_group_tokens`` tokens, the hidden temporary file renamed into place when the step is complete, and the
Parquet key-value metadata. :class:`~grpo_cli.io.writer.RolloutWriter` turns tensors into those arrays; converters
that start from numpy (``--from jsonl``) hand their arrays over directly, so they never load torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from grpo_cli import __version__
from grpo_cli.io.parquet_file import ParquetFileOut
from grpo_cli.io.schema import COLUMNS, SCHEMA_VERSION, ColumnKind
from grpo_cli.io.storage import DumpPath, Location, RemotePath, read_schema, remove, to_path
from grpo_cli.io.storage_listing import require_bucket

__all__ = [
    "ALIGNMENTS",
    "METADATA_PREFIX",
    "SEQUENCE_INPUTS",
    "TOKEN_INPUTS",
    "WINDOWS",
    "PartWriter",
    "fast_write_options",
    "read_metadata",
]

ALIGNMENTS = ("token", "next_token")
WINDOWS = ("full", "response")
METADATA_PREFIX = "grpo_cli."
#: Per-token inputs of :meth:`RolloutWriter.add` (``advantages`` may also be per sequence).
_TOKEN_KINDS = (ColumnKind.TOKEN_FLOAT, ColumnKind.TOKEN_MASK, ColumnKind.TOKEN_INT, ColumnKind.SEQUENCE_OR_TOKEN_FLOAT)
TOKEN_INPUTS = tuple(name for name, spec in COLUMNS.items() if spec.kind in _TOKEN_KINDS)
#: Per-sequence inputs of :meth:`RolloutWriter.add` (``step`` is its own argument).
SEQUENCE_INPUTS = tuple(name for name, spec in COLUMNS.items() if spec.kind not in _TOKEN_KINDS and name != "step")
_RESERVED_METADATA = ("schema_version", "writer", "rank", "step", "alignment", "source_alignment", "window")


def _list_type(value_type: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", value_type, nullable=False))


def fast_write_options(schema: pa.Schema) -> dict[str, Any]:
    """``pq.ParquetWriter`` keywords for fast reading (docs/performance.md).

    Floats: BYTE_STREAM_SPLIT + zstd and no dictionary (log-probs are nearly all distinct, a dictionary only adds
    a fallback); integers: dictionary (versions and ids repeat); booleans: plain bit-packing. Fields should be
    declared non-nullable, which shrinks the definition levels the reader decodes.
    """
    dictionary: list[str] = []
    encoding: dict[str, str] = {}
    for field in schema:
        is_list = pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
        leaf_type = field.type.value_type if is_list else field.type
        leaf = f"{field.name}.list.element" if is_list else field.name
        if pa.types.is_floating(leaf_type) and not pa.types.is_float16(leaf_type):
            encoding[leaf] = "BYTE_STREAM_SPLIT"
        elif pa.types.is_integer(leaf_type):
            dictionary.append(leaf)
    return {
        "compression": "zstd",
        "use_dictionary": dictionary,
        "column_encoding": encoding or None,
        "write_statistics": False,
        "write_page_checksum": True,  # the reader verifies page CRCs: corruption becomes an error, not numbers
    }


def read_metadata(path: Location) -> dict[str, Any]:
    """The ``grpo_cli.*`` key-value metadata of a Parquet file, JSON-decoded, without the prefix.

    Example:
        >>> read_metadata("dumps/run1/part-step000000-rank000.parquet")["framework"]  # doctest: +SKIP
        'verl'
    """
    raw = read_schema(path).metadata or {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.decode("utf-8", "replace")
        if name.startswith(METADATA_PREFIX):
            text = value.decode("utf-8", "replace")
            try:
                out[name[len(METADATA_PREFIX):]] = json.loads(text)
            except json.JSONDecodeError:
                out[name[len(METADATA_PREFIX):]] = text
    return out


_W = TypeVar("_W", bound="PartWriter")


class PartWriter:
    """Writes Arrow record batches of schema-v1 columns as rank-local part files, one per step (see the module
    docstring). :class:`~grpo_cli.io.writer.RolloutWriter` documents the arguments.

    Raises:
        ValueError: a bad rank, metadata that is not JSON-serialisable, or a reserved metadata key.
    """

    def __init__(
        self,
        directory: Location,
        *,
        rank: int = 0,
        metadata: Mapping[str, Any] | None = None,
        row_group_tokens: int = 1 << 20,
        fsync: bool = True,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        if isinstance(row_group_tokens, bool) or not isinstance(row_group_tokens, int) or row_group_tokens < 1:
            raise ValueError(f"row_group_tokens must be an integer >= 1, got {row_group_tokens!r}")
        self.directory: DumpPath = to_path(directory)
        self.rank = rank
        self.row_group_tokens = row_group_tokens
        self.fsync = fsync
        self._user_metadata: dict[str, str] = {}
        for key, value in dict(metadata or {}).items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"metadata keys must be non-empty strings, got {key!r}")
            if key in _RESERVED_METADATA:
                raise ValueError(f"metadata key '{key}' is set by the writer")
            try:
                self._user_metadata[key] = json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"metadata['{key}'] is not JSON-serialisable ({exc})") from None
        if isinstance(self.directory, RemotePath):
            require_bucket(self.directory)  # object stores have no directories: a prefix needs only its bucket
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.files: list[DumpPath] = []  # finished part files, in order
        self._schema: pa.Schema | None = None
        self._conventions: tuple[str, str] | None = None  # (source_alignment JSON, window)
        self._step: int | None = None
        self._seen_steps: dict[int, int] = {}
        self._out: ParquetFileOut | None = None
        self._tmp: DumpPath | None = None
        self._final: DumpPath | None = None
        self._buffer: list[pa.RecordBatch] = []
        self._buffered_tokens = 0
        self._closed = False

    # -- context manager ------------------------------------------------------------------------------------------
    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def add_arrays(self, step: int, columns: dict[str, pa.Array], n_tokens: int, conventions: tuple[str, str]) -> int:
        """Append one batch of rows of training step ``step`` (a new step finishes the previous step's file).

        Args:
            step: the training step (an int >= 0); ``columns`` holds its ``step`` column.
            columns: schema column → Arrow array, one row per sequence (per-token columns are lists).
            n_tokens: the batch's token count (row groups hold about ``row_group_tokens``).
            conventions: ``(source_alignment JSON, window)``, the same in every call.

        Returns:
            The number of rows added.

        Raises:
            ValueError: the writer is closed, or a column set, type or convention that differs from earlier calls.
        """
        if self._closed:
            raise ValueError("the writer is closed")
        batch = self._record_batch(columns, conventions)
        self._append(step, batch, n_tokens)
        return batch.num_rows

    def flush(self) -> None:
        """Finish the current step's part file now (it is renamed into place and readable)."""
        self._finish()

    def close(self) -> None:
        """Finish the last part file. Idempotent."""
        if self._closed:
            return
        try:
            self._finish()
        finally:
            self._closed = True

    # -- internals ------------------------------------------------------------------------------------------------
    def _record_batch(self, columns: dict[str, pa.Array], conventions: tuple[str, str]) -> pa.RecordBatch:
        names = [name for name in COLUMNS if name in columns]
        if self._schema is None:
            fields = [pa.field(name, columns[name].type, nullable=False) for name in names]
            self._schema = pa.schema(fields)
            self._conventions = conventions
        schema = self._schema
        if names != schema.names:
            raise ValueError(
                f"columns {names} differ from this writer's earlier calls {schema.names} "
                "(every part file of a dump needs the same columns)"
            )
        if conventions != self._conventions:
            raise ValueError(
                f"alignment/window {conventions} differ from this writer's earlier calls {self._conventions}"
            )
        arrays = []
        for field in schema:
            array = columns[field.name]
            if array.type != field.type:
                if _kind(array.type) != _kind(field.type):
                    raise ValueError(
                        f"{field.name}: {array.type} differs from this writer's earlier calls ({field.type}); "
                        "e.g. advantages must be per token in every call or per sequence in every call"
                    )
                array = array.cast(field.type)
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def _metadata(self, step: int) -> dict[str, str]:
        assert self._conventions is not None
        meta = {f"{METADATA_PREFIX}{k}": v for k, v in self._user_metadata.items()}
        source_alignment, window = self._conventions
        meta.update({
            f"{METADATA_PREFIX}schema_version": json.dumps(SCHEMA_VERSION),
            f"{METADATA_PREFIX}writer": json.dumps(f"grpo-cli {__version__}"),
            f"{METADATA_PREFIX}rank": json.dumps(self.rank),
            f"{METADATA_PREFIX}step": json.dumps(step),
            f"{METADATA_PREFIX}alignment": json.dumps("token"),
            f"{METADATA_PREFIX}source_alignment": source_alignment,
            f"{METADATA_PREFIX}window": json.dumps(window),
        })
        return meta

    def _append(self, step: int, batch: pa.RecordBatch, n_tokens: int) -> None:
        if self._step is not None and step != self._step:
            self._finish()
        if self._step is None:
            self._start(step)
        self._buffer.append(batch)
        self._buffered_tokens += n_tokens
        if self._buffered_tokens >= self.row_group_tokens:
            self._write_row_group()

    def _start(self, step: int) -> None:
        visits = self._seen_steps.get(step, 0)
        self._seen_steps[step] = visits + 1
        suffix = f"-{visits}" if visits else ""
        name = f"part-step{step:06d}-rank{self.rank:03d}{suffix}.parquet"
        self._step = step
        self._final = self.directory / name
        # Hidden and not ending in .parquet, so a concurrent reader's directory scan never picks it up.
        self._tmp = self.directory / f".{name}.{os.getpid()}.tmp"

    def _write_row_group(self) -> None:
        if not self._buffer:
            return
        assert self._schema is not None and self._tmp is not None and self._step is not None
        table = pa.Table.from_batches(self._buffer, schema=self._schema)
        try:
            if self._out is None:
                schema = self._schema.with_metadata(self._metadata(self._step))
                assert self._final is not None
                self._out = ParquetFileOut(self._final, schema=schema, tmp=self._tmp, fsync=self.fsync,
                                           **fast_write_options(schema))
            self._out.write(table, row_group_size=max(table.num_rows, 1))
        except BaseException:
            self._abort()
            raise
        self._buffer.clear()
        self._buffered_tokens = 0

    def _finish(self) -> None:
        if self._step is None:
            return
        try:
            self._write_row_group()
            if self._out is not None:
                path = self._out.commit()
                self._out = None
                assert path is not None
                self.files.append(path)
        except BaseException:
            self._abort()
            raise
        finally:
            self._step = None
            self._tmp = self._final = None

    def _abort(self) -> None:
        """Drop the unfinished part file (nothing half-written is ever renamed into place)."""
        if self._out is not None:
            self._out.abort()
            self._out = None
        if self._tmp is not None:
            remove(self._tmp)
        self._buffer.clear()
        self._buffered_tokens = 0
        self._step = None
        self._tmp = self._final = None


def arrow_columns(
    token: Mapping[str, Any],
    sequence: Mapping[str, Any],
    cu_seqlens: np.ndarray,
    step: int,
    *,
    mask: Callable[[Any], np.ndarray],
    integers: Callable[[Any, str, bool], np.ndarray],
    floats: Callable[[Any, str], np.ndarray],
) -> dict[str, pa.Array]:
    """The Arrow columns of one ``add``: token columns as lists over the ``cu_seqlens`` offsets (int32 offsets while
    they fit), sequence columns flat, and ``step``.

    ``mask``, ``integers`` (``wide``: int64, else int32) and ``floats`` turn one input into host values of its
    column's kind with the caller's checks: ``RolloutWriter.add`` from tensors, ``convert --from jsonl`` from numpy.
    """
    n_tokens = int(cu_seqlens[-1])
    offsets = pa.array(cu_seqlens.astype(np.int32) if n_tokens < np.iinfo(np.int32).max else cu_seqlens)
    columns: dict[str, pa.Array] = {}
    for name, values in token.items():
        kind = COLUMNS[name].kind
        if kind is ColumnKind.TOKEN_MASK:
            flat = mask(values)
        elif kind is ColumnKind.TOKEN_INT:
            flat = integers(values, name, False)
        else:
            flat = floats(values, name)
        columns[name] = _list_array(offsets, pa.array(flat))
    for name, values in sequence.items():
        if COLUMNS[name].kind in (ColumnKind.SEQUENCE_FLOAT, ColumnKind.SEQUENCE_OR_TOKEN_FLOAT):
            columns[name] = pa.array(floats(values, name))
        else:
            columns[name] = pa.array(integers(values, name, True))
    columns["step"] = pa.array(np.full(len(cu_seqlens) - 1, step, dtype=np.int64))
    return columns


def _list_array(offsets: pa.Array, flat: pa.Array) -> pa.Array:
    if pa.types.is_int64(offsets.type):
        return pa.LargeListArray.from_arrays(offsets, flat, type=pa.large_list(pa.field("element", flat.type, False)))
    return pa.ListArray.from_arrays(offsets, flat, type=_list_type(flat.type))


def _kind(dtype: pa.DataType) -> str:
    is_list = pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
    inner = dtype.value_type if is_list else dtype
    kind = "float" if pa.types.is_floating(inner) else "int" if pa.types.is_integer(inner) else str(inner)
    return f"list<{kind}>" if is_list else kind


def _alignments(alignment: str, column_alignment: Mapping[str, str] | None, window: str) -> dict[str, str]:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    out = dict.fromkeys(TOKEN_INPUTS, alignment)
    for name, value in dict(column_alignment or {}).items():
        if name not in TOKEN_INPUTS:
            raise ValueError(f"column_alignment: '{name}' is not a per-token input ({', '.join(TOKEN_INPUTS)})")
        if value not in ALIGNMENTS:
            raise ValueError(f"column_alignment['{name}'] must be one of {ALIGNMENTS}, got {value!r}")
        out[name] = value
    if window == "response" and "next_token" in out.values():
        raise ValueError(
            "next_token alignment needs window='full': in a response-only window the value of the first response "
            "token sits at the last prompt position, outside the window"
        )
    return out
