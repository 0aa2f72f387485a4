"""What every converter of :mod:`grpo_cli.io.convert` shares: the result, the ``check`` hook, finding source
files, refusing an output directory that already holds a dump, and the writer conventions a preset implies."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.preset_table import Preset, resolve_column_map
from grpo_cli.io.schema import COLUMNS
from grpo_cli.io.storage import DumpPath, RemotePath, is_uri, open_parquet
from grpo_cli.io.storage_listing import holds_parquet, objects_with_suffix, require_bucket

__all__ = ["Check", "CheckFiles", "ConvertResult"]

_CHUNK_TOKENS = 1 << 20


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    files: list[DumpPath] = field(default_factory=list)
    n_sequences: int = 0
    n_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"files": [str(p) for p in self.files], "n_sequences": self.n_sequences, "n_tokens": self.n_tokens,
                "notes": self.notes}


Check = Callable[[Any, "ConvertResult", str], None]
"""``check(dataset, result, what)``: the value checks run on a dump before it is rewritten (``optimize``) or on
what a converter wrote; it raises :class:`~grpo_cli.errors.InputError` to refuse the data, or adds notes to
``result``. The command layer supplies it (``grpo_cli.commands.convert``: ``analyze``'s validation)."""

CheckFiles = Callable[[list[DumpPath], "ConvertResult", str], None]
"""``check_files(files, result, what)``: the same checks on the part files a converter wrote (schema column names,
sequence-per-row), without opening a dataset, so that a converter that needs no torch runs without it
(``grpo_cli.commands.convert``: :func:`grpo_cli.engine.checks.check_part_files`)."""


def _expand(sources: Sequence[str | os.PathLike[str]], suffixes: tuple[str, ...]) -> list[DumpPath]:
    files: set[DumpPath] = set()
    for raw in sources:
        if is_uri(raw):  # an object or a prefix in object storage (docs/storage.md)
            files.update(objects_with_suffix(str(raw), suffixes))
            continue
        path = Path(raw)
        if not path.exists():
            raise InputError("no such file or directory", file=str(path))
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes]
            if not found:
                raise InputError(f"directory contains no {'/'.join(suffixes)} files", file=str(path))
            files.update(found)
        else:
            files.add(path)
    return sorted(files, key=str)


def _check_out_dir(out_dir: DumpPath, sources: Sequence[DumpPath]) -> None:
    if isinstance(out_dir, RemotePath):
        require_bucket(out_dir)
        if any(str(s).rstrip("/") == out_dir.uri.rstrip("/") for s in sources):
            raise UsageError(f"-o {out_dir}: is one of the sources")
        if holds_parquet(out_dir):
            raise UsageError(f"-o {out_dir}: already holds .parquet objects; choose an empty or new prefix")
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"-o {out_dir}: not a directory")
    if out_dir.exists() and any(out_dir.rglob("*.parquet")):
        raise UsageError(f"-o {out_dir}: already holds .parquet files; choose an empty or new directory")
    resolved = out_dir.resolve()
    for source in sources:
        if isinstance(source, Path) and source.resolve() == resolved:
            raise UsageError(f"-o {out_dir}: is one of the sources")


def _writer_error(exc: ValueError, file: DumpPath) -> InputError:
    return InputError(f"cannot convert ({exc})", file=str(file))


def _count_tokens(files: Sequence[DumpPath]) -> int:
    total = 0
    for path in files:
        md = open_parquet(path).metadata
        for rg in range(md.num_row_groups):
            total += md.row_group(rg).column(0).num_values
    return total


def _conventions(preset: Preset | None) -> tuple[str, dict[str, str], str, bool]:
    """(alignment, column_alignment, window, pad one slot) for the writer from a preset."""
    if preset is None or preset.alignment == "token":
        return "token", {}, preset.window if preset is not None else "full", False
    overrides = dict.fromkeys(preset.token_aligned, "token")
    return "next_token", overrides, "full", preset.alignment == "next_token_short"


def _key_map(keys: Sequence[str], column_map: Mapping[str, str] | None, preset: Preset | None) -> dict[str, str]:
    """``{schema column: key}`` for the keys a source has."""
    resolved = resolve_column_map(preset, keys, column_map) if preset is not None else dict(column_map or {})
    out = {}
    for canonical in COLUMNS:
        key = resolved.get(canonical, canonical)
        if key in keys:
            out[canonical] = key
    return out
