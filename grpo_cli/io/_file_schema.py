"""What the reader requires of a file's Parquet schema: each schema-v1 column's Arrow type for its kind and the
dump's layout, types that may differ across files (float widths) and those that may not (list-ness, number kind).
Torch-free; :class:`~grpo_cli.io.reader.RolloutDataset` reports the problems as :class:`~grpo_cli.errors.InputError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_cli.io.schema import ColumnKind, Layout
from grpo_cli.io.storage import DumpPath

__all__: list[str] = []  # private to grpo_cli.io.reader


@dataclass
class _FileInfo:
    path: DumpPath
    layout: Layout
    actual: dict[str, str]  # canonical → column name in this file
    types: dict[str, pa.DataType]
    metadata: pq.FileMetaData


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
