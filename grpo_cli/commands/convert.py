"""``grpo-cli convert``: the converters of :mod:`grpo_cli.io.convert`, with ``analyze``'s value checks on the data.

What a converter wrote is checked with :func:`grpo_cli.engine.checks.check_part_files` (pyarrow and numpy), a dump
re-encoded by ``--optimize`` with :class:`grpo_cli.engine.validate.BatchValidator` (torch, imported then): so
``convert --from jsonl`` never loads torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grpo_cli.engine.checks import check_part_files
from grpo_cli.io import convert as converters
from grpo_cli.io.convert import ConvertResult
from grpo_cli.io.storage import DumpPath

if TYPE_CHECKING:
    from grpo_cli.io.reader import RolloutDataset

__all__ = ["ConvertResult", "convert"]

_CHECK_BATCH_TOKENS = 1 << 20


def convert(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    on_invalid: str = "error",
    **options: Any,
) -> ConvertResult:
    """:func:`grpo_cli.io.convert.convert` (``options``: ``source_format``, ``optimize``, ``join``,
    ``column_map``, ``preset``, ``metadata``) with ``analyze``'s validation: under ``on_invalid="error"`` an
    invalid value (NaN or positive log-prob at a valid token, a mask that is not 0/1, …) refuses the data (nothing is
    written); under ``"skip"`` the data is kept and the offenders are counted in the result's notes."""

    def check(dataset: RolloutDataset, result: ConvertResult, what: str) -> None:
        validate(dataset, on_invalid, result, what)

    def check_files(files: list[DumpPath], result: ConvertResult, what: str) -> None:
        _note_skipped(check_part_files(files, on_invalid), result, what)

    return converters.convert(sources, out_dir, check=check, check_files=check_files, **options)


def validate(dataset: RolloutDataset, on_invalid: str, result: ConvertResult, what: str) -> None:
    """One pass with analyze's value checks (:mod:`grpo_cli.engine.validate`): ``error`` raises on the first
    offender; ``skip`` only counts offenders into a note (analyze them later with ``--on-invalid skip``)."""
    from grpo_cli.engine.validate import BatchValidator, validation_compute, validation_state

    validator = BatchValidator.for_dataset(dataset, on_invalid)
    state = validation_state() if validator.on_invalid.value == "skip" else None
    for batch in dataset.iter_batches(batch_tokens=_CHECK_BATCH_TOKENS, raw_mask=True):
        validator(batch, state)
    if state is not None:
        _note_skipped(validation_compute(state), result, what)


def _note_skipped(counts: Mapping[str, int], result: ConvertResult, what: str) -> None:
    """The note for sequences kept although invalid (``counts``: ``validation_compute``'s keys; empty under
    ``error``)."""
    if counts.get("invalid/n_sequences_skipped"):
        reasons = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in counts.items()
                            if v and k not in ("invalid/n_sequences_skipped", "invalid/n_tokens_skipped"))
        result.notes.append(f"{what}: {counts['invalid/n_sequences_skipped']} sequences hold invalid values "
                            f"({reasons}); kept — analyze them with --on-invalid skip")
