"""``grpo-cli convert --optimize``: re-encode a schema-v1 dump with the writer's fast settings."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa

from grpo_cli.errors import InputError, UsageError
from grpo_cli.io._convert_common import _CHUNK_TOKENS, Check, ConvertResult, _check_out_dir
from grpo_cli.io.parquet_file import ParquetFileOut
from grpo_cli.io.part_writer import fast_write_options
from grpo_cli.io.presets import open_dataset
from grpo_cli.io.schema import Layout
from grpo_cli.io.storage import DumpPath, Location, RemotePath, is_uri, open_parquet, to_path

__all__ = ["optimize_dump"]


def optimize_dump(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: Location,
    *,
    column_map: Mapping[str, str] | None = None,
    preset: str | None = None,
    row_group_tokens: int = _CHUNK_TOKENS,
    check: Check | None = None,
) -> ConvertResult:
    """Re-encode a schema-v1 dump with the writer's fast settings (non-nullable, BYTE_STREAM_SPLIT + zstd).

    The dump is first read once by ``check`` (``--map``/``--preset`` apply; the command passes ``analyze``'s
    validation, which stops at invalid values or counts them into a note), then each
    file is streamed into ``out_dir`` under its own relative name, all columns kept, row groups merged to about
    ``row_group_tokens`` tokens, each output file written to a temporary name and renamed when complete.
    """
    out = to_path(out_dir)
    dataset = open_dataset(sources, column_map, preset)
    names = _relative_names(sources, dataset.files)
    _check_out_dir(out, dataset.files)
    result = ConvertResult()
    # Read once with the checks (types, nulls, list lengths, values) before anything is written.
    if check is not None:
        check(dataset, result, "the dump")
    token_layout = dataset.layout is Layout.TOKEN_PER_ROW
    schema_columns = {dataset.column_map.get(c, c) for c in dataset.columns}
    for path, name in zip(dataset.files, names):
        target = out / name
        if isinstance(target, Path):
            target.parent.mkdir(parents=True, exist_ok=True)
        parquet = open_parquet(path, memory_map=True)
        source_schema = parquet.schema_arrow
        schema = pa.schema(
            [_non_nullable(f) if f.name in schema_columns else f for f in source_schema],
            metadata=source_schema.metadata,
        )
        new_name = dataset.column_map.get("new_logp", "new_logp")
        # Written to a hidden temporary file (a temporary key in object storage) and moved into place when complete.
        writer = ParquetFileOut(target, schema=schema, **fast_write_options(schema))
        try:
            with writer:
                pending: list[pa.RecordBatch] = []
                pending_tokens = 0
                for batch in parquet.iter_batches(batch_size=65536, use_threads=True):
                    batch = batch.cast(schema)
                    pending.append(batch)
                    column = batch.column(new_name)
                    pending_tokens += batch.num_rows if token_layout else _list_values(column)
                    if pending_tokens >= row_group_tokens:
                        table = pa.Table.from_batches(pending, schema=schema)
                        writer.write(table, row_group_size=max(table.num_rows, 1))
                        result.n_tokens += pending_tokens
                        pending, pending_tokens = [], 0
                if pending:
                    table = pa.Table.from_batches(pending, schema=schema)
                    writer.write(table, row_group_size=max(table.num_rows, 1))
                    result.n_tokens += pending_tokens
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot rewrite ({str(exc).splitlines()[0] if str(exc) else exc})",
                             file=str(path)) from None
        result.files.append(target)
        result.n_sequences += parquet.metadata.num_rows
    if token_layout:
        result.n_sequences = -1  # not known without reading seq_id; reported as n/a
    return result


def _list_values(column: pa.Array) -> int:
    offsets = column.offsets
    return int(offsets[-1].as_py()) - int(offsets[0].as_py()) if len(column) else 0


def _non_nullable(f: pa.Field) -> pa.Field:
    if pa.types.is_list(f.type):
        return pa.field(f.name, pa.list_(pa.field("element", f.type.value_type, nullable=False)), nullable=False,
                        metadata=f.metadata)
    if pa.types.is_large_list(f.type):
        return pa.field(f.name, pa.large_list(pa.field("element", f.type.value_type, nullable=False)),
                        nullable=False, metadata=f.metadata)
    return f.with_nullable(False)


def _relative_names(sources: Sequence[str | os.PathLike[str]], files: Sequence[DumpPath]) -> list[Path]:
    """Each file's name relative to the source directory (or object-storage prefix) it was found in (or its own
    name)."""
    dirs = [Path(s).resolve() for s in sources if not is_uri(s) and Path(s).is_dir()]
    prefixes = [str(s).rstrip("/") + "/" for s in sources if is_uri(s)]
    names: list[Path] = []
    for path in files:
        if isinstance(path, RemotePath):
            prefix = next((p for p in prefixes if path.uri.startswith(p)), None)
            names.append(Path(path.uri[len(prefix):]) if prefix is not None else Path(path.name))
            continue
        resolved = path.resolve()
        base = next((d for d in dirs if d in resolved.parents), None)
        names.append(resolved.relative_to(base) if base is not None else Path(path.name))
    if len(set(names)) != len(names):
        seen: set[Path] = set()
        dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]  # set.add used for its effect
        raise UsageError(f"two inputs would both be written as {dup}; convert them separately")
    return names
