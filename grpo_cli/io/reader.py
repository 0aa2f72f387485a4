"""Streaming Parquet → packed torch batches.

Files are read row group by row group in token-budgeted batches (never the whole dump). ``list<float>`` columns are
turned into flat torch values + offsets without copies through DLPack (``docs/schema.md``; the recipe and its
pitfalls are in the ecosystem notes): the offsets are slice-adjusted, the child values are sliced by hand because
``ListArray.values`` ignores the parent's offset, and null slots are rejected because they may point at hidden values.
Tensors that alias Arrow buffers are never modified in place.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor

from grpo_cli._choices import DEFAULT_BATCH_TOKENS
from grpo_cli.core.batch import TokenBatch
from grpo_cli.errors import InputError
from grpo_cli.io._arrow_torch import (
    _KEY,
    _decoded,
    _first_null_row,
    _flat_column,
    _group_codes,
    _GroupKey,
    _run_boundaries,
    _sequence_batch,
    _token_batch,
)
from grpo_cli.io._file_schema import (
    _FileInfo,
    _is_float,
    _is_int,
    _is_list,
    _kind_signature,
    _leaf_index,
    _num_values,
    _schema_difference,
    _type_problem,
)
from grpo_cli.io.schema import COLUMNS, REQUIRED_COLUMNS, Layout
from grpo_cli.io.storage import (
    DumpPath,
    Location,
    RemotePath,
    describe,
    is_uri,
    open_parquet,
    read_table,
)
from grpo_cli.io.storage_listing import expand_remote

__all__ = ["DEFAULT_BATCH_TOKENS", "RolloutDataset", "Shard", "expand_paths"]

"""Tokens per streamed batch: memory grows with it (Arrow's decoding buffers, the tensors, the metric temporaries),
while throughput on a CPU is flat from about 2^16 up (docs/performance.md)."""
READ_BUFFER_BYTES = 1 << 20
"""Bytes read from a file at a time while decoding (pages are streamed, never the whole column chunk)."""


def expand_paths(paths: Iterable[Location]) -> list[DumpPath]:
    """Files, directories (recursive ``*.parquet``) and quoted globs → a sorted, de-duplicated file list.

    Object-storage URIs (``s3://bucket/prefix/``, ``'gs://bucket/run/*.parquet'``, …) expand the same way into
    :class:`~grpo_cli.io.storage.RemotePath` objects (docs/storage.md)."""
    files: set[Path] = set()
    remote: dict[str, RemotePath] = {}
    for raw in paths:
        text = str(raw)
        if isinstance(raw, RemotePath) or is_uri(text):
            remote.update((str(p), p) for p in expand_remote(text))
            continue
        if any(ch in text for ch in "*?["):
            matches = [Path(m) for m in glob.glob(text, recursive=True)]
            if not matches:
                raise InputError("no file matches this pattern", file=text)
            candidates = matches
        else:
            path = Path(text)
            if not path.exists():
                raise InputError("no such file or directory", file=text)
            candidates = [path]
        for path in candidates:
            if path.is_dir():
                found = [p for p in path.rglob("*.parquet") if p.is_file()]
                if not found:
                    raise InputError("directory contains no .parquet files", file=str(path))
                files.update(found)
            else:
                files.add(path)
    return sorted([*files, *remote.values()], key=lambda p: str(p))


@dataclass(frozen=True)
class Shard:
    """A unit of work: some row groups of one file."""

    file_index: int
    row_groups: tuple[int, ...]
    first_row: int
    n_rows: int
    n_tokens: int
    n_bytes: int


class RolloutDataset:
    """A set of schema-v1 rollout files, opened lazily and streamed in token-budgeted batches.

    Args:
        paths: files, directories or glob patterns.
        column_map: ``{canonical: actual}`` renames (``--map``).
        transforms: functions applied, in order, to every batch :meth:`iter_batches` yields (a ``--preset``'s
            conventions, e.g. un-rolling next-token-aligned columns; ``grpo_cli.io.presets``). Each must keep
            whole sequences and may change their lengths.

    Example:
        >>> ds = RolloutDataset(["sample_data/rollouts.parquet"])  # doctest: +SKIP
        >>> for batch in ds.iter_batches(batch_tokens=1 << 16):  # doctest: +SKIP
        ...     print(batch.n_sequences, batch.n_tokens)
    """

    def __init__(
        self,
        paths: Sequence[Location],
        column_map: dict[str, str] | None = None,
        transforms: Sequence[Callable[[TokenBatch], TokenBatch]] = (),
    ) -> None:
        self.column_map = dict(column_map or {})
        self.transforms = list(transforms)
        self.files = expand_paths(paths)
        if any(isinstance(path, RemotePath) for path in self.files):
            # Each footer is a round trip to the store: read them concurrently (in file order all the same).
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(16, len(self.files))) as pool:
                self._infos = list(pool.map(self._inspect, self.files))
        else:
            self._infos = [self._inspect(path) for path in self.files]
        first = self._infos[0]
        for info in self._infos[1:]:
            if info.layout is not first.layout or set(info.actual) != set(first.actual):
                raise InputError(f"schema differs from {first.path}: {_schema_difference(info, first)}",
                                 file=str(info.path))
            for name, dtype in info.types.items():
                if _kind_signature(dtype) != _kind_signature(first.types[name]):
                    raise InputError(
                        f"type {dtype} differs from {first.types[name]} in {first.path}",
                        file=str(info.path),
                        column=info.actual[name],
                    )
        self.layout = first.layout
        self.columns: frozenset[str] = frozenset(first.actual)
        self.notes: list[str] = []
        """Warnings about the input that do not stop a run (a column that looks like a schema column but is not
        read, …): the library returns them, the CLI prints them to stderr."""

    # -- inspection ---------------------------------------------------------------------------------------------
    def _inspect(self, path: DumpPath) -> _FileInfo:
        if isinstance(path, Path) and path.is_dir():
            raise InputError("is a directory", file=str(path))
        try:
            parquet = open_parquet(path, memory_map=True)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise InputError(f"not a readable Parquet file ({_first_line(exc)})", file=str(path)) from None
        schema = parquet.schema_arrow
        actual: dict[str, str] = {}
        types: dict[str, pa.DataType] = {}
        for canonical in COLUMNS:
            name = self.column_map.get(canonical, canonical)
            index = schema.get_field_index(name)
            if index >= 0:
                actual[canonical] = name
                types[canonical] = schema.field(index).type
            elif canonical in self.column_map:
                raise InputError(
                    f"--map {canonical}={name}: the file has no column '{name}'", file=str(path), column=name
                )
        for canonical in REQUIRED_COLUMNS:
            if canonical not in actual:
                raise InputError(
                    f"required column is missing (the file has: {', '.join(schema.names) or 'no columns'})",
                    file=str(path), column=canonical,
                )
        layout = Layout.SEQUENCE_PER_ROW if _is_list(types["new_logp"]) else Layout.TOKEN_PER_ROW
        if layout is Layout.TOKEN_PER_ROW and "seq_id" not in actual:
            raise InputError(
                f"expected list<float> per-token values (sequence-per-row layout), got {types['new_logp']}; "
                "a token-per-row file needs a 'seq_id' column",
                file=str(path),
                column=actual["new_logp"],
            )
        for canonical, dtype in types.items():
            problem = _type_problem(COLUMNS[canonical].kind, dtype, layout)
            if problem:
                raise InputError(problem, file=str(path), column=actual[canonical])
        return _FileInfo(path, layout, actual, types, parquet.metadata)

    # -- --group-by on any per-sequence column ----------------------------------------------------------------------
    def group_column_problem(self, name: str) -> str | None:
        """Why file column ``name`` (after ``--map``) cannot split the dump by value, or ``None`` when it can: it
        must exist in every file and hold one scalar per row (string, int, bool, float or dictionary-encoded)."""
        actual = self.column_map.get(name, name)
        for info in self._infos:
            schema = info.metadata.schema.to_arrow_schema()
            index = schema.get_field_index(actual)
            if index < 0:
                return f"the dump has no '{actual}' column ({info.path})"
            dtype = schema.field(index).type
            if pa.types.is_dictionary(dtype):
                dtype = dtype.value_type
            scalar = (pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or _is_int(dtype)
                      or _is_float(dtype) or pa.types.is_boolean(dtype))
            if not scalar:
                return f"column '{actual}' has type {dtype}: a group key must be one scalar per sequence"
        return None

    def group_values(self, name: str) -> list[object]:
        """The sorted distinct values of file column ``name`` over every file: a sequence's ``group_key`` code is
        its value's index here, so codes are the same whatever the batches, shards or workers, and ascending codes
        are ascending values. Read once per dataset (one column)."""
        cache: dict[str, list[object]] = self.__dict__.setdefault("_group_values", {})
        if name not in cache:
            import pyarrow.compute as pc

            actual = self.column_map.get(name, name)
            found: set[object] = set()
            for info in self._infos:
                column = read_table(info.path, [actual]).column(actual)
                if column.null_count:
                    chunk_rows = 0
                    for chunk in column.chunks:
                        if chunk.null_count:
                            raise InputError("null value (a group key must be set on every row)",
                                             file=str(info.path), column=actual,
                                             row=chunk_rows + _first_null_row(chunk))
                        chunk_rows += len(chunk)
                found.update(pc.unique(_decoded(column.combine_chunks())).to_pylist())
            cache[name] = sorted(found)  # type: ignore[type-var]  # one column: all ints or all strings
        return cache[name]

    # -- sharding -----------------------------------------------------------------------------------------------
    def shards(self) -> list[Shard]:
        """(file, row-group) work units; token-per-row files are one shard each (sequences may span row groups)."""
        out: list[Shard] = []
        for file_index, info in enumerate(self._infos):
            md = info.metadata
            token_column = _leaf_index(md, info.actual["new_logp"])
            groups = []
            first_row = 0
            for rg in range(md.num_row_groups):
                meta = md.row_group(rg)
                n_tokens = meta.num_rows if info.layout is Layout.TOKEN_PER_ROW else _num_values(meta, token_column)
                groups.append(Shard(file_index, (rg,), first_row, meta.num_rows, n_tokens, meta.total_byte_size))
                first_row += meta.num_rows
            if info.layout is Layout.TOKEN_PER_ROW and groups:
                groups = [
                    Shard(
                        file_index,
                        tuple(g.row_groups[0] for g in groups),
                        0,
                        sum(g.n_rows for g in groups),
                        sum(g.n_tokens for g in groups),
                        sum(g.n_bytes for g in groups),
                    )
                ]
            out.extend(groups)
        return out

    @property
    def n_tokens(self) -> int:
        """Total tokens according to the Parquet metadata (no data is read)."""
        return sum(shard.n_tokens for shard in self.shards())

    # -- reading ------------------------------------------------------------------------------------------------
    def iter_batches(
        self,
        *,
        columns: Iterable[str] | None = None,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        shards: Sequence[Shard] | None = None,
        raw_mask: bool = False,
        group_key: str | None = None,
    ) -> Iterator[TokenBatch]:
        """Yield packed batches of whole sequences, each about ``batch_tokens`` tokens (at least one sequence).

        Args:
            columns: canonical columns to read (default: all present). ``new_logp`` is always read.
            batch_tokens: token budget per batch.
            shards: the work units to read (default: all, in file and row-group order).
            raw_mask: keep an integer ``loss_mask`` column's values as read (its own dtype, also through the
                transforms) instead of ``!= 0``, so that :class:`grpo_cli.engine.validate.BatchValidator` can reject
                values other than 0/1; the validator then makes it the bool mask every consumer expects.
            group_key: a file column whose per-sequence values become ``batch.group_key``, coded as indices into
                :meth:`group_values` (``--group-by`` on a string or other non-schema column).
        """
        if batch_tokens < 1:
            raise ValueError("batch_tokens must be >= 1")
        wanted = set(self.columns if columns is None else columns) & self.columns
        wanted.add("new_logp")
        key = None
        if group_key is not None:
            key = (self.column_map.get(group_key, group_key), pa.array(self.group_values(group_key)))
        for shard in self.shards() if shards is None else shards:
            info = self._infos[shard.file_index]
            if info.layout is Layout.SEQUENCE_PER_ROW:
                batches = self._iter_sequence_rows(info, shard, wanted, batch_tokens, key)
            else:
                batches = self._iter_token_rows(info, shard, wanted, batch_tokens, key)
            for batch in batches:
                if not raw_mask and batch.loss_mask.dtype != torch.bool:
                    batch.loss_mask = batch.loss_mask != 0
                for transform in self.transforms:
                    batch = transform(batch)
                yield batch

    def _open(self, info: _FileInfo) -> pq.ParquetFile:
        try:
            # Page CRCs, where the writer stored them, turn a corrupted data page into an error instead of numbers.
            # Pages are streamed through a small buffer rather than memory-mapped or pre-buffered: a mapping's pages
            # and pre-buffered column chunks stay resident, so memory would grow with the row group (the whole file
            # for pyarrow's default writer settings) instead of staying bounded by --batch-tokens. Decoding is the
            # same speed (docs/performance.md).
            # A remote object is read through a bigger buffer (storage.REMOTE_READ_BUFFER_BYTES): a round trip each.
            return open_parquet(
                info.path,
                memory_map=False,
                pre_buffer=False,
                buffer_size=READ_BUFFER_BYTES,
                page_checksum_verification=True,
            )
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot open ({_first_line(exc)})", file=str(info.path)) from None

    def _iter_sequence_rows(
        self, info: _FileInfo, shard: Shard, wanted: set[str], batch_tokens: int, key: _GroupKey | None = None
    ) -> Iterator[TokenBatch]:
        parquet = self._open(info)
        names = [info.actual[c] for c in sorted(wanted)]
        if key is not None and key[0] not in names:
            names.append(key[0])
        rows_per_batch = max(1, (batch_tokens * shard.n_rows) // max(shard.n_tokens, 1))
        row = shard.first_row
        try:
            for record_batch in parquet.iter_batches(
                batch_size=rows_per_batch, row_groups=list(shard.row_groups), columns=names, use_threads=True
            ):
                batch = _sequence_batch(info, shard.file_index, record_batch, row, wanted)
                if key is not None:
                    batch.group_key = _group_codes(info, record_batch.column(key[0]), key, row)
                yield batch
                row += record_batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise _decode_error(info, exc, row) from None

    def _iter_token_rows(
        self, info: _FileInfo, shard: Shard, wanted: set[str], batch_tokens: int, key: _GroupKey | None = None
    ) -> Iterator[TokenBatch]:
        parquet = self._open(info)
        wanted = wanted | {"seq_id"}
        names = [info.actual[c] for c in sorted(wanted)]
        if key is not None and key[0] not in names:
            names.append(key[0])
        carry: dict[str, Tensor] | None = None
        row = 0  # file row of carry's first token
        seen_ids: set[int] = set()
        try:
            batches = parquet.iter_batches(
                batch_size=batch_tokens, row_groups=list(shard.row_groups), columns=names, use_threads=True
            )
            for record_batch in batches:
                flat = {c: _flat_column(info, c, record_batch.column(info.actual[c]), row) for c in wanted}
                if key is not None:
                    flat[_KEY] = _group_codes(info, record_batch.column(key[0]), key, row)
                if carry is not None:
                    flat = {c: torch.cat([carry[c], flat[c]]) for c in flat}
                boundaries = _run_boundaries(flat["seq_id"])
                # The last run may continue in the next record batch: hold it back.
                cut = int(boundaries[-2])
                if cut > 0:
                    done = {c: v[:cut] for c, v in flat.items()}
                    yield _token_batch(info, shard.file_index, done, boundaries[:-1], row, wanted, seen_ids)
                    row += cut
                carry = {c: v[cut:] for c, v in flat.items()}
            if carry is not None and carry["seq_id"].numel() > 0:
                boundaries = _run_boundaries(carry["seq_id"])
                yield _token_batch(info, shard.file_index, carry, boundaries, row, wanted, seen_ids)
        except (pa.ArrowException, OSError) as exc:
            raise _decode_error(info, exc, row) from None


def _decode_error(info: _FileInfo, exc: BaseException, row: int) -> InputError:
    if isinstance(info.path, RemotePath) and not isinstance(exc, pa.ArrowInvalid):
        return InputError(f"cannot read ({describe(exc, info.path)})", file=str(info.path), row=row)
    return InputError(f"cannot decode ({_first_line(exc)})", file=str(info.path), row=row)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
