"""Streaming Parquet → packed torch batches.

Files are read row group by row group in token-budgeted batches (never the whole dump). ``list<float>`` columns are
turned into flat torch values + offsets without copies through DLPack (``docs/schema.md``; the recipe and its
pitfalls are in the ecosystem notes): the offsets are slice-adjusted, the child values are sliced by hand because
``ListArray.values`` ignores the parent's offset, and null slots are rejected because they may point at hidden values.
Tensors that alias Arrow buffers are never modified in place.
"""

from __future__ import annotations

import glob
import os
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
from grpo_cli.io.schema import COLUMNS, REQUIRED_COLUMNS, ColumnKind, Layout

__all__ = ["DEFAULT_BATCH_TOKENS", "RolloutDataset", "Shard", "expand_paths"]

"""Tokens per streamed batch: memory grows with it (Arrow's decoding buffers, the tensors, the metric temporaries),
while throughput on a CPU is flat from about 2^16 up (docs/performance.md)."""
READ_BUFFER_BYTES = 1 << 20
"""Bytes read from a file at a time while decoding (pages are streamed, never the whole column chunk)."""


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files, directories (recursive ``*.parquet``) and quoted globs → a sorted, de-duplicated file list."""
    files: set[Path] = set()
    for raw in paths:
        text = str(raw)
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
    return sorted(files, key=lambda p: str(p))


@dataclass(frozen=True)
class Shard:
    """A unit of work: some row groups of one file."""

    file_index: int
    row_groups: tuple[int, ...]
    first_row: int
    n_rows: int
    n_tokens: int
    n_bytes: int


@dataclass
class _FileInfo:
    path: Path
    layout: Layout
    actual: dict[str, str]  # canonical → column name in this file
    types: dict[str, pa.DataType]
    metadata: pq.FileMetaData


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
        paths: Sequence[str | os.PathLike[str]],
        column_map: dict[str, str] | None = None,
        transforms: Sequence[Callable[[TokenBatch], TokenBatch]] = (),
    ) -> None:
        self.column_map = dict(column_map or {})
        self.transforms = list(transforms)
        self.files = expand_paths(paths)
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
    def _inspect(self, path: Path) -> _FileInfo:
        if path.is_dir():
            raise InputError("is a directory", file=str(path))
        try:
            parquet = pq.ParquetFile(path, memory_map=True)
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
                column = pq.read_table(info.path, columns=[actual]).column(actual)
                if column.null_count:
                    chunk_rows = 0
                    for chunk in column.chunks:
                        if chunk.null_count:
                            raise InputError("null value (a group key must be set on every row)",
                                             file=str(info.path), column=actual,
                                             row=chunk_rows + _first_null_row(chunk))
                        chunk_rows += len(chunk)
                found.update(pc.unique(_decoded(column.combine_chunks())).to_pylist())
            cache[name] = sorted(found)  # type: ignore[type-var]
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
            return pq.ParquetFile(
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
            raise InputError(f"cannot decode ({_first_line(exc)})", file=str(info.path), row=row) from None

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
            raise InputError(f"cannot decode ({_first_line(exc)})", file=str(info.path), row=row) from None


def _schema_difference(info: _FileInfo, first: _FileInfo) -> str:
    """What differs between two files' schema columns (not both lists)."""
    parts = []
    extra = sorted(set(info.actual) - set(first.actual))
    missing = sorted(set(first.actual) - set(info.actual))
    if extra:
        parts.append(f"this file also has {', '.join(extra)}")
    if missing:
        parts.append(f"this file lacks {', '.join(missing)}")
    if info.layout is not first.layout:
        parts.append(f"layout {info.layout.value} vs {first.layout.value}")
    return "; ".join(parts)


# -- type checks ------------------------------------------------------------------------------------------------
def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)


def _is_float(dtype: pa.DataType) -> bool:
    return pa.types.is_floating(dtype)


def _is_int(dtype: pa.DataType) -> bool:
    return pa.types.is_integer(dtype)


def _kind_signature(dtype: pa.DataType) -> str:
    """float32 vs float64 (and int widths) may differ across files; list-ness and number kind may not."""
    inner = dtype.value_type if _is_list(dtype) else dtype
    if _is_float(inner):
        kind = "float"
    elif _is_int(inner):
        kind = "int"
    else:
        kind = "bool" if pa.types.is_boolean(inner) else str(inner)
    return f"list<{kind}>" if _is_list(dtype) else kind


def _type_problem(kind: ColumnKind, dtype: pa.DataType, layout: Layout) -> str | None:
    token_layout = layout is Layout.TOKEN_PER_ROW
    is_list = _is_list(dtype)
    inner = dtype.value_type if is_list else dtype

    def expect(description: str) -> str:
        return f"wrong type {dtype}: expected {description}"

    if kind in (ColumnKind.TOKEN_FLOAT, ColumnKind.TOKEN_MASK, ColumnKind.TOKEN_INT):
        if token_layout == is_list:
            shape = "a scalar per row (token-per-row layout)" if token_layout else "list<...> per row"
            return expect(f"{kind.value} as {shape}")
        ok = {
            ColumnKind.TOKEN_FLOAT: _is_float(inner),
            ColumnKind.TOKEN_MASK: pa.types.is_boolean(inner) or _is_int(inner),
            ColumnKind.TOKEN_INT: _is_int(inner),
        }[kind]
        return None if ok else expect(kind.value)
    if kind is ColumnKind.SEQUENCE_OR_TOKEN_FLOAT:
        if is_list and token_layout:
            return expect("a float per row (token-per-row layout)")
        return None if _is_float(inner) or _is_int(inner) else expect(kind.value)
    if is_list:
        return expect(f"{kind.value} (a scalar per row)")
    if kind is ColumnKind.SEQUENCE_FLOAT:
        return None if _is_float(inner) or _is_int(inner) else expect(kind.value)
    # Per-sequence ints may be stored as bools (an 'eos' flag); they are read as 0/1.
    return None if _is_int(inner) or pa.types.is_boolean(inner) else expect(kind.value)


def _leaf_index(md: pq.FileMetaData, name: str) -> int:
    for i in range(md.num_columns):
        path = md.schema.column(i).path
        if path == name or path.startswith(name + "."):
            return i
    raise KeyError(name)


def _num_values(meta: pq.RowGroupMetaData, leaf: int) -> int:
    return meta.column(leaf).num_values


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# -- Arrow → torch --------------------------------------------------------------------------------------------
def _to_tensor(values: pa.Array) -> Tensor:
    """Zero-copy for numeric arrays without nulls (DLPack); bit-packed booleans need one unpacking copy."""
    if pa.types.is_boolean(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False))
    if pa.types.is_float16(values.type):
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).astype("float32"))
    return torch.from_dlpack(values)


def _first_null_row(array: pa.Array) -> int:
    import pyarrow.compute as pc

    return int(pc.index(array.is_null(), True).as_py())


def _list_parts(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> tuple[Tensor, Tensor]:
    """A list column → (flat values, int64 offsets starting at 0)."""
    name = info.actual[canonical]
    if array.null_count:
        raise InputError("null list (row has no value)", file=str(info.path), column=name,
                         row=row0 + _first_null_row(array))
    offsets = array.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    values = array.values.slice(start, end - start)
    if values.null_count:
        parents = array.value_parent_indices()
        import pyarrow.compute as pc

        first = int(pc.index(values.is_null(), True).as_py())
        row = row0 + int(parents[first].as_py())
        token = first - (int(offsets[int(parents[first].as_py())].as_py()) - start)
        raise InputError("null element in list", file=str(info.path), column=name, row=row, token=token)
    offsets_t = torch.from_dlpack(offsets).to(torch.int64)
    if start:
        offsets_t = offsets_t - start
    return _to_tensor(values), offsets_t


def _scalar_column(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> Tensor:
    if array.null_count:
        raise InputError("null value", file=str(info.path), column=info.actual[canonical],
                         row=row0 + _first_null_row(array))
    return _to_tensor(array)


def _as_float(values: Tensor) -> Tensor:
    return values if values.is_floating_point() else values.to(torch.float64)


def _sequence_batch(
    info: _FileInfo, file_index: int, record_batch: pa.RecordBatch, row0: int, wanted: set[str]
) -> TokenBatch:
    path = str(info.path)
    new_values, cu_seqlens = _list_parts(info, "new_logp", record_batch.column(info.actual["new_logp"]), row0)
    n_seq = record_batch.num_rows
    data: dict[str, Tensor] = {"new_logp": _as_float(new_values)}
    for canonical in wanted - {"new_logp"}:
        array = record_batch.column(info.actual[canonical])
        kind = COLUMNS[canonical].kind
        if _is_list(array.type):
            values, offsets = _list_parts(info, canonical, array, row0)
            if not torch.equal(offsets, cu_seqlens):
                bad = int(torch.nonzero(offsets != cu_seqlens)[0])
                row = row0 + max(bad - 1, 0)
                lengths = (offsets[1:] - offsets[:-1], cu_seqlens[1:] - cu_seqlens[:-1])
                i = row - row0
                raise InputError(
                    f"has {int(lengths[0][i])} tokens but new_logp has {int(lengths[1][i])} "
                    "(per-token columns of a row must have equal lengths)",
                    file=path, column=info.actual[canonical], row=row,
                )
            data[canonical] = values
        else:
            data[canonical] = _scalar_column(info, canonical, array, row0)
            if kind is ColumnKind.SEQUENCE_OR_TOKEN_FLOAT:  # per-sequence advantage → every token of the row
                seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
                data[canonical] = torch.repeat_interleave(data[canonical], seq_lengths, output_size=new_values.numel())
    return _make_batch(data, cu_seqlens, file_index, torch.arange(row0, row0 + n_seq, dtype=torch.int64))


def _make_batch(data: dict[str, Tensor], cu_seqlens: Tensor, file_index: int, rows: Tensor) -> TokenBatch:
    n_tokens = data["new_logp"].numel()
    mask = data.pop("loss_mask", None)
    # An integer mask keeps its values (iter_batches converts it, or the validator after checking it is 0/1).
    mask = torch.ones(n_tokens, dtype=torch.bool) if mask is None else mask
    kwargs: dict[str, Tensor] = {}
    for canonical, values in data.items():
        kind = COLUMNS[canonical].kind
        if kind in (ColumnKind.TOKEN_FLOAT, ColumnKind.SEQUENCE_OR_TOKEN_FLOAT, ColumnKind.SEQUENCE_FLOAT):
            kwargs[canonical] = _as_float(values)
        elif kind in (ColumnKind.TOKEN_INT, ColumnKind.SEQUENCE_INT):
            kwargs[canonical] = values.to(torch.int64)
    return TokenBatch(cu_seqlens=cu_seqlens, loss_mask=mask, file_index=file_index, rows=rows, **kwargs)


def _flat_column(info: _FileInfo, canonical: str, array: pa.Array, row0: int) -> Tensor:
    return _scalar_column(info, canonical, array, row0)


def _run_boundaries(ids: Tensor) -> Tensor:
    """Offsets of the runs of equal ids: ``[0, start_1, ..., start_last, len(ids)]``."""
    n = ids.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.int64)
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change, torch.tensor([n])])


def _token_batch(
    info: _FileInfo,
    file_index: int,
    flat: dict[str, Tensor],
    cu_seqlens: Tensor,
    row0: int,
    wanted: set[str],
    seen_ids: set[int],
) -> TokenBatch:
    """Token-per-row runs of equal ``seq_id`` → a packed batch; per-sequence columns take each run's first row."""
    first = cu_seqlens[:-1]
    ids = flat["seq_id"][first].tolist()
    for i, seq in enumerate(ids):
        if seq in seen_ids:
            raise InputError(
                f"seq_id {seq} appears again after other sequences (rows of a sequence must be contiguous)",
                file=str(info.path), column=info.actual["seq_id"], row=row0 + int(first[i]),
            )
        seen_ids.add(seq)
    data: dict[str, Tensor] = {}
    for canonical in wanted:
        values = flat[canonical]
        per_sequence = COLUMNS[canonical].kind in (ColumnKind.SEQUENCE_FLOAT, ColumnKind.SEQUENCE_INT)
        data[canonical] = values[first] if per_sequence else values
    batch = _make_batch(data, cu_seqlens, file_index, first + row0)
    if _KEY in flat:
        batch.group_key = flat[_KEY][first]  # a sequence's key is its first row's
    return batch


_KEY = "\0group_key"
"""The flat-column slot of the ``group_key`` codes while token-per-row runs are cut into sequences."""

_GroupKey = tuple[str, pa.Array]
"""(file column, its sorted distinct values) of a ``--group-by`` column read as codes."""


def _decoded(array: pa.Array) -> pa.Array:
    return array.dictionary_decode() if pa.types.is_dictionary(array.type) else array


def _group_codes(info: _FileInfo, array: pa.Array, key: _GroupKey, row0: int) -> Tensor:
    """Per-row values → int64 indices into the dump's sorted distinct values."""
    import pyarrow.compute as pc

    if array.null_count:
        raise InputError("null value (a group key must be set on every row)", file=str(info.path), column=key[0],
                         row=row0 + _first_null_row(array))
    codes = pc.index_in(_decoded(array), value_set=key[1])
    return torch.from_numpy(codes.to_numpy(zero_copy_only=False).astype("int64"))
