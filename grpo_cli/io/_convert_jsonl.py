"""``--from jsonl``: one sequence per JSON line → schema-v1 part files, streamed in token-budgeted chunks of
consecutive lines with one step."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_cli.errors import InputError
from grpo_cli.io._convert_common import (
    _CHUNK_TOKENS,
    ConvertResult,
    _conventions,
    _count_tokens,
    _key_map,
    _writer_error,
)
from grpo_cli.io.preset_table import Preset
from grpo_cli.io.writer import RolloutWriter

__all__: list[str] = []  # private to grpo_cli.io.convert

_PER_SEQUENCE = ("rewards", "current_version", "group_id", "seq_id")


def _convert_jsonl(
    files: Sequence[Path], out_dir: Path, result: ConvertResult, column_map: Mapping[str, str] | None,
    preset: Preset | None, metadata: Mapping[str, Any],
) -> None:
    alignment, overrides, window, pad = _conventions(preset)
    meta = {**metadata, "source_format": "jsonl"}
    if preset is not None:
        meta.setdefault("framework", preset.framework)
    keys: dict[str, str] | None = None
    if column_map and "step" in column_map:
        step_keys: tuple[str, ...] = (column_map["step"],)
    else:
        step_keys = preset.columns.get("step", ("step",)) if preset is not None else ("step",)
    with RolloutWriter(out_dir, metadata=meta) as writer:
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
                        result.n_sequences += writer.add(step=step, alignment=alignment, column_alignment=overrides,
                                                         window=window, **inputs)
                    except ValueError as exc:
                        raise _writer_error(exc, file) from None
        finally:
            writer.close()
            result.files.extend(writer.files)
    result.n_tokens = _count_tokens(result.files)


def _jsonl_chunks(file: Path, step_keys: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]], int]]:
    """(step, rows, first line number) chunks of consecutive lines with one step, about 1M tokens each."""
    rows: list[dict[str, Any]] = []
    step: int | None = None
    tokens = 0
    first_line = 1
    try:
        handle = file.open("r", encoding="utf-8")
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
    rows: list[dict[str, Any]], keys: Mapping[str, str], file: Path, first_line: int, pad: bool
) -> dict[str, Any]:
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
        tensors = []
        for offset, value in enumerate(values):
            if not isinstance(value, list):
                raise InputError(f"{_line(first_line + offset)}: '{key}' must be a list (one value per token)",
                                 file=str(file), column=key, row=first_line + offset - 1)
            try:
                tensor = torch.tensor(
                    [math.nan if v is None else v for v in value],
                    dtype=torch.int64 if canonical in ("versions",) else torch.float64,
                )
            except (TypeError, ValueError) as exc:
                raise InputError(f"{_line(first_line + offset)}: '{key}' is not numeric ({exc})", file=str(file),
                                 column=key, row=first_line + offset - 1) from None
            if pad:
                tensor = torch.cat([tensor, tensor.new_full((1,), -1 if canonical == "versions" else 0)])
            tensors.append(tensor)
        out[canonical] = tensors
    return out
