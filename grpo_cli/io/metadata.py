"""A dump's own record of the options that change its figures: ``RolloutWriter(metadata=…)`` values
(``temperature``, the clip widths, the framework) become the defaults for that dump.

An option given on the command line wins; files whose metadata disagree are refused (one run, one setting). The
names accepted for each option are the ones trainers log (``clip_range``/``clip_ratio`` for ε, as in TRL's
``epsilon`` and verl's ``clip_ratio``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import InputError

if TYPE_CHECKING:
    from grpo_cli.io.storage import Location

__all__ = ["METADATA_OPTIONS", "dump_defaults"]

METADATA_OPTIONS: dict[str, tuple[str, ...]] = {
    "temperature": ("temperature",),
    "epsilon": ("epsilon", "clip_range", "clip_ratio", "clip_ratio_low", "eps_clip"),
    "epsilon_high": ("epsilon_high", "clip_range_high", "clip_ratio_high"),
}
"""``{option: metadata keys}``: the first key a file has gives the option's default for that dump."""

INFORMATIONAL = ("framework",)
"""Metadata reported with the defaults (and checked for agreement) without being an option."""


def _value(meta: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
    for key in keys:
        if key in meta and meta[key] is not None:
            return key, meta[key]
    return None


def dump_defaults(files: Sequence[Location], explicit: Collection[str] = ()) -> dict[str, Any]:
    """``{option: value}`` from the files' ``grpo_cli.*`` metadata (options in :data:`METADATA_OPTIONS`, plus
    ``framework``); ``{}`` when no file records any. Options in ``explicit`` (given on the command line) are not
    read, so files that disagree on them are accepted.

    Raises:
        InputError: a recorded value is not a finite positive number, or two files record different values.
    """
    from grpo_cli.io.part_writer import read_metadata

    found: dict[str, tuple[Any, str]] = {}
    wanted = {**METADATA_OPTIONS, **{name: (name,) for name in INFORMATIONAL}}
    wanted = {option: keys for option, keys in wanted.items() if option not in set(explicit)}
    for path in files:
        meta = read_metadata(path)
        for option, keys in wanted.items():
            hit = _value(meta, keys)
            if hit is None:
                continue
            key, value = hit
            if option in METADATA_OPTIONS and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0
            ):
                raise InputError(f"metadata '{key}' = {value!r} is not a finite number >= 0", file=str(path))
            value = float(value) if option in METADATA_OPTIONS else value
            if option in found and found[option][0] != value:
                raise InputError(
                    f"metadata '{key}' = {value!r} differs from {found[option][0]!r} in {found[option][1]} "
                    f"(analyse one setting at a time, or pass --{option.replace('_', '-')} to override both)",
                    file=str(path),
                )
            found.setdefault(option, (value, str(path)))
    return {option: value for option, (value, _) in found.items()}
