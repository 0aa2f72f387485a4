"""``--from jsonl``: one sequence per JSON line → schema-v1 part files, streamed in token-budgeted chunks of
consecutive lines with one step.

Torch-free (``convert --from jsonl`` loads no torch: 1.3 s and 650 MB): lines become numpy arrays and then Arrow
arrays handed to :class:`~grpo_cli.io.part_writer.PartWriter`, with exactly what
:meth:`RolloutWriter.add <grpo_cli.io.writer.RolloutWriter.add>` writes for the same values given as lists of
tensors (``tests/test_convert_jsonl.py`` compares the two): per-token numbers as float64 (``versions`` int32),
per-sequence floats as float32 (torch's default dtype for Python floats), integers as int64, next-token
alignment un-rolled within each sequence with its first token masked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from grpo_cli.errors import InputError
from grpo_cli.io._convert_common import (
    _CHUNK_TOKENS,
    ConvertResult,
    _conventions,
    _count_tokens,
    _key_map,
    _writer_error,
)
from grpo_cli.io.part_writer import SEQUENCE_INPUTS, TOKEN_INPUTS, PartWriter, _alignments, arrow_columns
from grpo_cli.io.preset_table import Preset
from grpo_cli.io.storage import DumpPath, open_text

__all__: list[str] = []  # private to grpo_cli.io.convert

_PER_SEQUENCE = ("rewards", "current_version", "group_id", "seq_id")
_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)


def _convert_jsonl(
    files: Sequence[DumpPath], out_dir: DumpPath, result: ConvertResult, column_map: Mapping[str, str] | None,
    preset: Preset | None, metadata: Mapping[str, Any],
) -> None:
    alignment, overrides, window, pad = _conventions(preset)
    aligned = _alignments(alignment, overrides, window)
    conventions = (json.dumps({"default": alignment, **overrides}, sort_keys=True), window)
    meta = {**metadata, "source_format": "jsonl"}
    if preset is not None:
        meta.setdefault("framework", preset.framework)
    keys: dict[str, str] | None = None
    if column_map and "step" in column_map:
        step_keys: tuple[str, ...] = (column_map["step"],)
    else:
        step_keys = preset.columns.get("step", ("step",)) if preset is not None else ("step",)
    with PartWriter(out_dir, metadata=meta) as writer:
        try:
            for file in files:
                for step, rows, first_line in _jsonl_chunks(file, step_keys):
                    if keys is None:
                        keys = _key_map(list(rows[0]), column_map, preset)
                        if "new_logp" not in keys:
                            raise InputError(f"{_line(first_line)}: no 'new_logp' list (use --map new_logp=KEY or "
                                             "--preset)", file=str(file), row=first_line - 1)
                    inputs = _jsonl_inputs(rows, keys, file, first_line, pad)
                    try:
                        columns, n_tokens = _arrays(step, inputs, aligned)
                        result.n_sequences += writer.add_arrays(step, columns, n_tokens, conventions)
                    except ValueError as exc:
                        raise _writer_error(exc, file) from None
        finally:
            writer.close()
            result.files.extend(writer.files)
    result.n_tokens = _count_tokens(result.files)


def _jsonl_chunks(file: DumpPath, step_keys: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]], int]]:
    """(step, rows, first line number) chunks of consecutive lines with one step, about 1M tokens each."""
    rows: list[dict[str, Any]] = []
    step: int | None = None
    tokens = 0
    first_line = 1
    try:
        handle = open_text(file)
    except OSError as exc:
        raise InputError(f"cannot open ({exc.strerror or exc})", file=str(file)) from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{_line(number)}: not JSON ({exc.msg})", file=str(file), row=number - 1) from None
            if not isinstance(row, dict):
                raise InputError(f"{_line(number)}: expected a JSON object", file=str(file), row=number - 1)
            step_key = next((k for k in step_keys if k in row), None)
            row_step = row[step_key] if step_key is not None else 0
            if isinstance(row_step, bool) or not isinstance(row_step, int) or row_step < 0:
                raise InputError(f"{_line(number)}: '{step_key}' must be an integer >= 0", file=str(file),
                                 column=step_key, row=number - 1)
            if rows and (row_step != step or tokens >= _CHUNK_TOKENS):
                yield step, rows, first_line  # type: ignore[misc]  # step is set once rows is not empty
                rows, tokens = [], 0
            if not rows:
                first_line = number
            step = row_step
            rows.append(row)
            new = row.get("new_logp")
            tokens += len(new) if isinstance(new, list) else 1
        if rows:
            yield step, rows, first_line  # type: ignore[misc]  # step is set once rows is not empty


def _line(number: int) -> str:
    """A JSON-lines position: the error's ``row`` is 0-based like every row grpo-cli reports (pyarrow/pandas), the
    editor's 1-based line number is given beside it."""
    return f"line {number}"


def _jsonl_inputs(
    rows: list[dict[str, Any]], keys: Mapping[str, str], file: DumpPath, first_line: int, pad: bool
) -> dict[str, Any]:
    """``{schema column: a list of per-sequence values, or a list of per-token numpy arrays}`` for one chunk."""
    out: dict[str, Any] = {}
    for canonical, key in keys.items():
        if canonical == "step":
            continue
        values = []
        for offset, row in enumerate(rows):
            if key not in row or row[key] is None:
                raise InputError(f"{_line(first_line + offset)}: no '{key}' (earlier lines have it)",
                                 file=str(file), column=key, row=first_line + offset - 1)
            values.append(row[key])
        per_sequence = canonical in _PER_SEQUENCE or (
            canonical == "advantages" and not isinstance(values[0], list)
        )
        if per_sequence:
            if any(isinstance(v, list) for v in values):
                raise InputError(f"lines {first_line}…: '{key}' must be one number per line", file=str(file),
                                 column=key, row=first_line - 1)
            out[canonical] = values
            continue
        arrays = []
        for offset, value in enumerate(values):
            if not isinstance(value, list):
                raise InputError(f"{_line(first_line + offset)}: '{key}' must be a list (one value per token)",
                                 file=str(file), column=key, row=first_line + offset - 1)
            try:
                if any(isinstance(v, str) for v in value):  # numpy would parse "0.5"; JSON strings are not numbers
                    raise ValueError("a string is not a number")
                array = np.array(
                    [math.nan if v is None else v for v in value],
                    dtype=np.int64 if canonical in ("versions",) else np.float64,
                )
            except (TypeError, ValueError, OverflowError) as exc:
                raise InputError(f"{_line(first_line + offset)}: '{key}' is not numeric ({exc})", file=str(file),
                                 column=key, row=first_line + offset - 1) from None
            if pad:
                array = np.concatenate([array, np.full(1, -1 if canonical == "versions" else 0, dtype=array.dtype)])
            arrays.append(array)
        out[canonical] = arrays
    return out


# -- numpy → Arrow, as RolloutWriter.add writes lists of tensors ------------------------------------------------
def _arrays(step: int, inputs: Mapping[str, Any], aligned: Mapping[str, str]) -> tuple[dict[str, pa.Array], int]:
    """One chunk's inputs → (Arrow columns, token count).

    Raises:
        ValueError: with :meth:`RolloutWriter.add <grpo_cli.io.writer.RolloutWriter.add>`'s message, for values
            it refuses (shapes, non-integral ids, out-of-range versions, …).
    """
    parts = inputs["new_logp"]
    for i, part in enumerate(parts):
        if part.ndim != 1:
            raise ValueError(f"new_logp[{i}]: expected a 1-D tensor, got shape {tuple(part.shape)}")
    lengths = np.array([part.size for part in parts], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_tokens = int(cu[-1])
    token: dict[str, np.ndarray] = {}
    sequence: dict[str, np.ndarray] = {}
    unrolled_any = False
    for name in TOKEN_INPUTS:
        value = inputs.get(name)
        if value is None:
            continue
        if name == "advantages" and not isinstance(value[0], np.ndarray):
            sequence[name] = _per_sequence(value, name)
            continue
        packed = _pack(value, name, lengths)
        if name == "loss_mask":
            packed = packed != 0
        if aligned[name] == "next_token":
            fill: float | int | bool = {"loss_mask": False, "versions": -1}.get(name, 0.0)
            packed = _unroll_next_token(packed, cu, fill)
            unrolled_any = unrolled_any or name != "versions"
        token[name] = packed
    if unrolled_any:
        # After un-rolling, the first token of every sequence has no value: never let it count.
        first = np.zeros(n_tokens, dtype=bool)
        first[cu[:-1][lengths > 0]] = True
        mask = token.get("loss_mask")
        token["loss_mask"] = ~first if mask is None else mask & ~first
    for name in SEQUENCE_INPUTS:
        value = inputs.get(name)
        if value is not None:
            sequence[name] = _per_sequence(value, name)
    columns = arrow_columns(token, sequence, cu, step, mask=lambda values: values != 0,
                            integers=lambda values, name, wide: _integers(values, name, np.int64 if wide else np.int32),
                            floats=_floats)
    return columns, n_tokens


def _pack(parts: Sequence[np.ndarray], name: str, lengths: np.ndarray) -> np.ndarray:
    if len(parts) != len(lengths):
        raise ValueError(f"{name}: expected a list of {len(lengths)} 1-D tensors like new_logp")
    for i, (part, length) in enumerate(zip(parts, lengths.tolist())):
        if part.ndim != 1 or part.size != length:
            raise ValueError(f"{name}[{i}]: has shape {tuple(part.shape)}, new_logp[{i}] has {length} tokens")
    return np.concatenate(parts)


def _per_sequence(values: Sequence[Any], name: str) -> np.ndarray:
    """Scalars → a ``[B]`` array of the dtype torch gives the same scalars stacked: bool, else int64, and float32
    as soon as one is a float (torch's default dtype for Python floats)."""
    kinds = set()
    for value in values:
        if isinstance(value, bool):
            kinds.add("bool")
        elif isinstance(value, int):
            if not _INT64.min <= value <= _INT64.max:
                raise ValueError(f"{name}: cannot be read as a tensor (Overflow when unpacking long)")
            kinds.add("int")
        elif isinstance(value, float):
            kinds.add("float")
        else:
            raise ValueError(f"{name}: cannot be read as a tensor ({type(value).__name__} is not a number)")
    dtype = np.float32 if "float" in kinds else np.int64 if "int" in kinds else np.bool_
    return np.array(values, dtype=dtype)


def _floats(values: np.ndarray, name: str) -> np.ndarray:
    """``_writer_inputs._float_numpy``: float64 stays, any other number becomes float32."""
    if values.dtype == np.bool_:
        raise ValueError(f"{name}: expected float values, got torch.bool")
    return values if values.dtype == np.float64 else values.astype(np.float32)


def _integers(values: np.ndarray, name: str, dtype: type[np.integer[Any]]) -> np.ndarray:
    """``_writer_inputs._int_numpy``: floats must be finite whole numbers; int32 columns must fit."""
    if values.dtype.kind == "f":
        if not bool(np.isfinite(values).all()) or not bool((values == np.round(values)).all()):
            raise ValueError(f"{name}: expected integer values")
    elif values.dtype == np.bool_:
        raise ValueError(f"{name}: expected integer values, got bool")
    if dtype is np.int32 and values.size and (int(values.min()) < _INT32.min or int(values.max()) > _INT32.max):
        raise ValueError(f"{name}: values outside the int32 range")
    return values.astype(dtype)


def _unroll_next_token(values: np.ndarray, cu_seqlens: np.ndarray, fill: float | int | bool) -> np.ndarray:
    """``align.unroll_next_token`` in numpy: ``out[t] = values[t − 1]`` within each sequence, ``fill`` first."""
    out = np.empty_like(values)
    if values.size == 0:
        return out
    out[1:] = values[:-1]  # crosses sequence boundaries; every first token is overwritten below
    starts = cu_seqlens[:-1]
    out[starts[cu_seqlens[1:] > starts]] = fill
    return out
