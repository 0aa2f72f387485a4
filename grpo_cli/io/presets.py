"""``--preset NAME``: column maps and conventions for dumps written with a framework's own tensor names.

A preset is for a Parquet dump whose columns carry a framework's names (``rollout_log_probs``, ``old_log_probs``,
``response_mask``, …) and keep that framework's conventions, e.g. a verl user who wrote the step batch's tensors
as they are. It does two things (``docs/recipes/``):

* **Renames**: schema column ← the first of the preset's candidate names that the file has (``--map`` wins over
  the preset; a column none of whose names is present falls back to its schema name, else stays absent). Where a
  framework's "old" log-prob is the recomputed *proximal* policy (verl ``old_log_probs``, TRL
  ``old_per_token_logps``, slime ``log_probs``, OpenRLHF ``action_log_probs``) it becomes ``prox_logp``, and the
  inference engine's log-prob becomes ``old_logp`` (schema v1's behaviour policy).
* **Alignment**: next-token-aligned frameworks are un-rolled to schema v1's token alignment by a transform applied
  to every batch the reader yields (:class:`UnrollTransform` for AReaL and twinkle, same length;
  :class:`PrependSlotTransform` for OpenRLHF, whose ``[B, T − 1]`` action tensors lack the first token). Files
  written by :class:`grpo_cli.io.RolloutWriter` are token-aligned already (metadata ``grpo_cli.alignment``) and are
  left alone.

The new log-prob of the training forward pass is a local variable of each framework's loss, not a named tensor
of its batch; each preset lists the name to store it under (``new_logp`` always works).

Example:
    >>> from grpo_cli.io.presets import PRESETS, resolve_column_map
    >>> resolve_column_map(PRESETS["verl"], ["new_logp", "old_log_probs", "rollout_log_probs", "response_mask"])
    {'old_logp': 'rollout_log_probs', 'prox_logp': 'old_log_probs', 'loss_mask': 'response_mask'}
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from grpo_cli.errors import InputError
from grpo_cli.io.preset_table import PRESETS, Preset, _by_name, resolve_column_map
from grpo_cli.io.preset_table import describe as describe  # re-exported: grpo_cli.io.presets.describe
from grpo_cli.io.preset_table import format_description as format_description
from grpo_cli.io.schema import COLUMNS
from grpo_cli.io.storage import read_schema

if TYPE_CHECKING:

    from grpo_cli.core.batch import TokenBatch
    from grpo_cli.io.reader import RolloutDataset

# The preset table, describe() and format_description() (preset_table.py) need no torch: ``grpo-cli schema`` loads
# none. The reader and the alignment functions (torch) are imported where a dataset is opened.

__all__ = [
    "PRESETS",
    "PrependSlotTransform",
    "Preset",
    "UnrollTransform",
    "open_dataset",
    "preset_transforms",
    "resolve_column_map",
    "unread_column_notes",
]


def _shifted() -> tuple[str, ...]:
    """Per-token columns a transform shifts (``loss_mask`` is always shifted too: it exists on every batch)."""
    from grpo_cli.core.batch import PER_TOKEN_COLUMNS

    return tuple(PER_TOKEN_COLUMNS)

_FILL: dict[str, float | int | bool] = {"versions": -1, "loss_mask": False}


def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)


class UnrollTransform:
    """Un-rolls next-token-aligned per-token columns of every batch (same lengths; ``align.unroll_next_token``).

    Args:
        columns: the per-token columns to shift (``loss_mask`` is always shifted).
        skip_files: file indices that are token-aligned already (written by ``RolloutWriter``).
    """

    def __init__(self, columns: Iterable[str], skip_files: Iterable[int] = ()) -> None:
        self.columns = tuple(columns)
        self.skip_files = frozenset(skip_files)

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        from grpo_cli.io.align import unroll_next_token

        if batch.file_index in self.skip_files:
            return batch
        changes: dict[str, Any] = {}  # column → Tensor (Any: dataclasses.replace types each field)
        for name in (*self.columns, "loss_mask"):
            values = getattr(batch, name)
            if values is not None:
                changes[name] = unroll_next_token(values, batch.cu_seqlens, _FILL.get(name, 0.0))
        return replace(batch, positions=None, **changes)


class PrependSlotTransform:
    """Inserts a masked first slot into every sequence (OpenRLHF's ``[B, T − 1]`` tensors → ``T`` tokens).

    Args:
        skip_files: file indices that are token-aligned already (written by ``RolloutWriter``).
    """

    def __init__(self, skip_files: Iterable[int] = ()) -> None:
        self.skip_files = frozenset(skip_files)

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        from grpo_cli.io.align import prepend_slot

        if batch.file_index in self.skip_files:
            return batch
        changes: dict[str, Any] = {}  # column → Tensor (Any: dataclasses.replace types each field)
        cu_out = batch.cu_seqlens
        for name in (*_shifted(), "loss_mask"):
            values = getattr(batch, name)
            if values is not None:
                changes[name], cu_out = prepend_slot(values, batch.cu_seqlens, _FILL.get(name, 0.0))
        return replace(batch, cu_seqlens=cu_out, positions=None, **changes)


def preset_transforms(preset: Preset | str, dataset: RolloutDataset) -> list[Any]:
    """The batch transforms a preset needs on ``dataset`` (empty for token-aligned frameworks)."""
    from grpo_cli.io.part_writer import read_metadata

    preset = _by_name(preset) if isinstance(preset, str) else preset
    if preset.alignment == "token":
        return []
    skip = [i for i, path in enumerate(dataset.files) if read_metadata(path).get("alignment") == "token"]
    if preset.alignment == "next_token_short":
        return [PrependSlotTransform(skip)]
    columns = [c for c in _shifted() if c not in preset.token_aligned]
    if "advantages" in columns and "advantages" in dataset.columns and not _per_token_advantages(dataset):
        columns.remove("advantages")  # one value per sequence (broadcast by the reader): nothing to shift
    return [UnrollTransform(columns, skip)]


def _per_token_advantages(dataset: RolloutDataset) -> bool:
    name = dataset.column_map.get("advantages", "advantages")
    schema = read_schema(dataset.files[0])
    new_name = dataset.column_map.get("new_logp", "new_logp")
    token_layout = not _is_list(schema.field(new_name).type)
    return token_layout or _is_list(schema.field(name).type)


def open_dataset(
    paths: Sequence[str | os.PathLike[str]],
    column_map: Mapping[str, str] | None = None,
    preset: str | None = None,
) -> RolloutDataset:
    """A :class:`RolloutDataset` with ``--map`` and ``--preset`` applied (what every command should open).

    Raises:
        UsageError: an unknown preset.
        InputError: what :class:`RolloutDataset` raises (missing files or columns, wrong types).
    """
    from grpo_cli.io.reader import expand_paths

    if preset is None:
        return _open_noting(paths, dict(column_map or {}), None)
    chosen = _by_name(preset)
    files = expand_paths(paths)
    try:
        available = read_schema(files[0]).names
    except (pa.ArrowException, OSError):
        available = []  # the dataset below reports the unreadable file with its usual message
    resolved = resolve_column_map(chosen, available, column_map)
    if chosen.name == "twinkle" and "loss_mask" not in resolved and "loss_mask" not in available and (
        "labels" in available
    ):
        raise InputError(
            "--preset twinkle: found 'labels' but no mask; store labels != -100 as 'loss_mask' (a label column "
            "holds token ids, not a mask)",
            file=str(files[0]),
            column="labels",
        )
    dataset = _open_noting(paths, resolved, chosen)
    dataset.transforms.extend(preset_transforms(chosen, dataset))
    return dataset


def _open_noting(paths: Sequence[str | os.PathLike[str]], column_map: Mapping[str, str],
                 preset: Preset | None) -> RolloutDataset:
    """:class:`RolloutDataset` plus the column hints: a missing required column names the preset whose names the
    file uses, and file columns that look like unread schema columns become ``dataset.notes``."""
    from grpo_cli.io.reader import RolloutDataset

    try:
        dataset = RolloutDataset(paths, dict(column_map))
    except InputError as exc:
        if exc.column in ("new_logp",) and exc.reason.startswith("required column is missing") and exc.file:
            hint = _missing_hint(_file_columns(exc.file), preset)
            if hint:
                raise InputError(f"{exc.reason}; {hint}", file=exc.file, column=exc.column) from None
        raise
    try:
        available = read_schema(dataset.files[0]).names
    except (pa.ArrowException, OSError):
        available = []
    dataset.notes.extend(unread_column_notes(available, dataset.column_map, dataset.columns, preset))
    return dataset


def _file_columns(path: str) -> list[str]:
    try:
        return list(read_schema(path).names)
    except (pa.ArrowException, OSError, InputError):
        return []


def _preset_names(preset: Preset) -> set[str]:
    return {name for canonical, names in preset.columns.items() for name in names if name != canonical}


def _missing_hint(available: Sequence[str], preset: Preset | None) -> str | None:
    """Which ``--preset`` the file's column names match (by how many of its framework names the file has)."""
    if preset is not None:
        names = " or ".join(preset.columns.get("new_logp", ("new_logp",)))
        return f"--preset {preset.name} reads the new log-prob from {names} (or use --map new_logp=COLUMN)"
    present = set(available)
    scores = {p.name: len(_preset_names(p) & present) for p in PRESETS.values()}
    best = max(scores.values(), default=0)
    if best == 0:
        return "name it new_logp or use --map new_logp=COLUMN"
    matches = [name for name, score in scores.items() if score == best]
    return (f"the column names match --preset {' or --preset '.join(matches)} (which reads new_logp from "
            f"{' or '.join(PRESETS[matches[0]].columns['new_logp'])}); or use --map new_logp=COLUMN")


def unread_column_notes(available: Sequence[str], column_map: Mapping[str, str], read: Iterable[str],
                        preset: Preset | None = None) -> list[str]:
    """Warnings for file columns that look like a schema column the run does not read.

    A column is flagged if a preset would read it as a schema column that is absent (``rollout_log_probs`` →
    ``old_logp`` under ``--preset verl``) or if its name is close to an absent schema column's (``old_logprobs``);
    each note names the ``--map`` (and presets) that would use it. A misspelt optional column would otherwise
    leave its figures "not computed" without a word.
    """
    import difflib

    used = set(column_map.values()) | set(read)
    absent = [c for c in COLUMNS if c not in set(read)]
    notes = []
    for name in available:
        if name in used or name in COLUMNS:
            continue
        targets: dict[str, list[str]] = {}
        for candidate in PRESETS.values():
            if preset is not None and candidate.name == preset.name:
                continue
            for canonical, names in candidate.columns.items():
                if name in names and canonical in absent:
                    targets.setdefault(canonical, []).append(candidate.name)
        if not targets:
            close = difflib.get_close_matches(name, absent, n=1, cutoff=0.75)
            if close:
                targets[close[0]] = []
        for canonical, presets in targets.items():
            via = f"--map {canonical}={name}"
            if presets:
                via = f"--preset {' or --preset '.join(presets)} (or {via})"
            notes.append(f"column '{name}' looks like {canonical} but is not read; {via} would use it")
    return notes
