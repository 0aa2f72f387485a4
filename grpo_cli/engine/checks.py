"""The value rules of :mod:`grpo_cli.engine.validate`, declared without torch, and their numpy twin for part files.

:class:`~grpo_cli.engine.validate.BatchValidator` applies :data:`CHECKS` to every torch batch a command streams.
``grpo-cli convert`` only has to check the part files a converter has just written (schema column names,
sequence-per-row, written by :class:`~grpo_cli.io.part_writer.PartWriter`); :func:`check_part_files` applies the same
rules to them with pyarrow and numpy, so that ``convert --from jsonl`` never loads torch (1.3 s and 650 MB). Both
report the same first offender (file order, then row, token and rule order) with the same message, and count the
same sequences per reason under ``skip``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from grpo_cli._constants import LOGP_COLUMNS, LOGP_TOLERANCE
from grpo_cli.errors import InputError
from grpo_cli.io.storage import DumpPath, Location, open_parquet, to_path

__all__ = ["CHECKS", "LOGP_COLUMNS_CHECKED", "LOGP_TOLERANCE", "Check", "check_part_files"]

LOGP_COLUMNS_CHECKED = (*LOGP_COLUMNS, "teacher_logp")
"""Every log-probability column (``core.logp_sanity.LOGP_COLUMNS`` and ``teacher_logp``): finite and
≤ :data:`LOGP_TOLERANCE` at valid tokens."""


@dataclass(frozen=True)
class Check:
    """One validation rule: ``invalid/<reason>`` counts the sequences it dropped under ``--on-invalid skip``."""

    reason: str
    column: str
    meaning: str
    per_sequence: bool = False


_TOLERANCE_TEXT = f"{LOGP_TOLERANCE:.0e}".replace("e-0", "e-")  # "1e-4"


def _logp_checks() -> list[Check]:
    out = []
    for column in LOGP_COLUMNS_CHECKED:
        out.append(Check(f"{column}_not_finite", column, f"NaN or ±inf {column} at a valid token"))
        out.append(Check(f"{column}_positive", column, f"{column} > {_TOLERANCE_TEXT} at a valid token"))
    return out


CHECKS: tuple[Check, ...] = (
    Check("loss_mask_not_binary", "loss_mask", "a loss_mask value other than 0 and 1"),
    *_logp_checks(),
    Check("entropy_not_finite", "entropy", "NaN or ±inf entropy at a valid token"),
    Check("entropy_negative", "entropy", f"entropy < −{_TOLERANCE_TEXT} at a valid token"),
    Check("advantages_not_finite", "advantages", "NaN or ±inf advantages at a valid token"),
    Check("versions_below_minus_one", "versions", "version < −1 at a valid token"),
    Check("versions_above_current", "versions", "version above the sequence's current_version at a valid token"),
    Check("rewards_not_finite", "rewards", "NaN or ±inf reward", per_sequence=True),
    Check("eos_not_binary", "eos", "an eos flag other than 0 and 1", per_sequence=True),
)
"""Every rule, in the order used to pick which problem to report when one token has several."""

_HINT = "rerun with --on-invalid skip to drop (and count) such sequences"
_CHECK = {check.reason: check for check in CHECKS}
_ORDER = {check.reason: i for i, check in enumerate(CHECKS)}
_POLICIES = ("error", "skip")


def _describe(check: Check, value: Any, tol: float, current: int | None) -> str:
    """One clause saying what is wrong with ``value``."""
    reason = check.reason
    if reason == "loss_mask_not_binary":
        return f"loss_mask value {value} (must be 0 or 1)"
    if reason.endswith("_positive"):
        return (
            f"log-prob {value:.6g} > 0 at a valid token (tolerance {tol:g}); log-probabilities are <= 0 "
            "(is this a negative log-likelihood or a logit?)"
        )
    if reason == "entropy_negative":
        return f"entropy {value:.6g} < 0 at a valid token (tolerance {tol:g})"
    if reason == "versions_below_minus_one":
        return f"version {value} < -1 at a valid token (versions are policy versions >= 0, or -1 for prompt tokens)"
    if reason == "versions_above_current":
        return (
            f"version {value} at a valid token is above the sequence's current_version {current} "
            "(a token cannot come from a future policy)"
        )
    if reason == "rewards_not_finite":
        return f"reward is {value}"
    if reason == "eos_not_binary":
        return f"eos flag {value} (must be 0 or 1)"
    kind = {"entropy": "entropy", "advantages": "advantage"}.get(check.column, "log-prob")
    return f"{kind} is {value} at a valid token (loss_mask = 1)"


# -- the numpy twin, for part files ------------------------------------------------------------------------------
def check_part_files(
    files: Sequence[Location],
    on_invalid: str = "error",
    *,
    tolerance: float = LOGP_TOLERANCE,
    current_version: int | None = None,
) -> dict[str, int]:
    """:class:`~grpo_cli.engine.validate.BatchValidator`'s rules on part files, with pyarrow and numpy.

    The files must use the schema's column names in the sequence-per-row layout (what
    :class:`~grpo_cli.io.part_writer.PartWriter` writes); they are read in the order
    :class:`~grpo_cli.io.reader.RolloutDataset` reads them (sorted by name).

    Returns:
        Under ``skip``: :func:`~grpo_cli.engine.validate.validation_compute`'s counts (``invalid/n_sequences_skipped``,
        ``invalid/n_tokens_skipped`` and each ``invalid/<reason>`` that holds a sequence); under ``error``, ``{}``.

    Raises:
        InputError: under ``error``, for the first offender, with the validator's message.
        ValueError: an ``on_invalid`` other than ``error`` and ``skip``, or a negative tolerance.
    """
    if on_invalid not in _POLICIES:
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    counts = dict.fromkeys(("n_sequences_skipped", "n_tokens_skipped", *_ORDER), 0)
    for path in sorted((to_path(f) for f in files), key=str):
        row0 = 0
        for batch in open_parquet(path).iter_batches(batch_size=65536):
            _check_batch(batch, path, row0, on_invalid, float(tolerance), current_version, counts)
            row0 += batch.num_rows
    if on_invalid == "error":
        return {}
    out = {"invalid/n_sequences_skipped": counts["n_sequences_skipped"],
           "invalid/n_tokens_skipped": counts["n_tokens_skipped"]}
    out.update({f"invalid/{check.reason}": counts[check.reason] for check in CHECKS if counts[check.reason]})
    return out


def _flat(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list column → (flat values, int64 offsets from 0)."""
    offsets = array.offsets.to_numpy().astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    return array.values.slice(start, end - start).to_numpy(zero_copy_only=False), offsets - start


def _is_list(array: pa.Array) -> bool:
    return pa.types.is_list(array.type) or pa.types.is_large_list(array.type)


def _check_batch(
    batch: pa.RecordBatch, path: DumpPath, row0: int, on_invalid: str, tol: float, current_version: int | None,
    counts: dict[str, int],
) -> None:
    names = set(batch.schema.names)
    _, cu = _flat(batch.column("new_logp"))
    lengths = np.diff(cu)
    n_tokens = int(cu[-1])

    def column(name: str) -> np.ndarray | None:
        """Per-token values (per-sequence advantages broadcast to their tokens, as the reader does)."""
        if name not in names:
            return None
        array = batch.column(name)
        if _is_list(array):
            return _flat(array)[0]
        return np.repeat(array.to_numpy(zero_copy_only=False), lengths)

    def scalars(name: str) -> np.ndarray | None:
        return batch.column(name).to_numpy(zero_copy_only=False) if name in names else None

    def below(x: np.ndarray, bound: float) -> np.ndarray:
        # torch compares a float tensor with a Python number in the tensor's dtype: do the same
        return x < np.asarray(bound, dtype=x.dtype) if x.dtype.kind == "f" else x < bound

    def above(x: np.ndarray, bound: float) -> np.ndarray:
        return x > np.asarray(bound, dtype=x.dtype) if x.dtype.kind == "f" else x > bound

    raw = column("loss_mask")
    valid = np.ones(n_tokens, dtype=bool) if raw is None else (raw if raw.dtype == bool else raw != 0)
    found: list[tuple[Check, np.ndarray]] = []

    def add(reason: str, bad: np.ndarray) -> None:
        if bad.any():
            found.append((_CHECK[reason], bad))

    if raw is not None and raw.dtype != bool:
        add("loss_mask_not_binary", (raw < 0) | (raw > 1))
    for name in LOGP_COLUMNS_CHECKED:
        x = column(name)
        if x is not None:
            add(f"{name}_not_finite", valid & ~np.isfinite(x))
            add(f"{name}_positive", valid & above(x, tol) & (x < np.inf))
    entropy = column("entropy")
    if entropy is not None:
        add("entropy_not_finite", valid & ~np.isfinite(entropy))
        add("entropy_negative", valid & below(entropy, -tol) & (entropy > -np.inf))
    advantages = column("advantages")
    if advantages is not None:
        add("advantages_not_finite", valid & ~np.isfinite(advantages))
    versions = column("versions")
    current_seq = scalars("current_version")
    if versions is not None:
        versions = versions.astype(np.int64)
        ok = versions >= -1
        if current_seq is not None:
            ok &= versions <= np.repeat(current_seq.astype(np.int64), lengths)
        elif current_version is not None:
            ok &= versions <= current_version
        add("versions_below_minus_one", valid & (versions < -1))
        add("versions_above_current", valid & (versions >= -1) & ~ok)
    rewards = scalars("rewards")
    if rewards is not None:
        add("rewards_not_finite", ~np.isfinite(rewards))
    eos = scalars("eos")
    if eos is not None:
        eos = eos.astype(np.int64)
        add("eos_not_binary", (eos < 0) | (eos > 1))
    if not found:
        return
    if on_invalid == "error":
        raise _first_offender(found, cu, path, row0, tol, current_seq, current_version, column, scalars)
    drop = np.zeros(len(lengths), dtype=bool)
    for check, bad in found:
        if check.per_sequence:
            seq_bad = bad
        else:
            running = np.concatenate([[0], np.cumsum(bad, dtype=np.int64)])
            seq_bad = running[cu[1:]] - running[cu[:-1]] > 0
        counts[check.reason] += int(seq_bad.sum())
        drop |= seq_bad
    counts["n_sequences_skipped"] += int(drop.sum())
    counts["n_tokens_skipped"] += int(lengths[drop].sum())


def _first_offender(
    found: list[tuple[Check, np.ndarray]], cu: np.ndarray, path: DumpPath, row0: int, tol: float,
    current_seq: np.ndarray | None, current_version: int | None, column: Any, scalars: Any,
) -> InputError:
    best: tuple[int, int, int] | None = None
    chosen: tuple[Check, int, int | None] | None = None
    for check, bad in found:
        first = int(np.flatnonzero(bad)[0])
        if check.per_sequence:
            seq, pos, index = first, -1, None
        else:
            seq = int(np.searchsorted(cu, first, side="right")) - 1
            pos, index = first - int(cu[seq]), first
        key = (seq, pos, _ORDER[check.reason])
        if best is None or key < best:
            best, chosen = key, (check, seq, index)
    assert chosen is not None and best is not None
    check, seq, index = chosen
    values = scalars(check.column) if index is None else column(check.column)
    value = values[seq if index is None else index].item()
    if check.column in ("versions", "eos"):
        value = int(value)  # read as int64, like the reader's tensors
    current = int(current_seq[seq]) if current_seq is not None else current_version
    return InputError(
        f"{_describe(check, value, tol, current)}; {_HINT}",
        file=str(path),
        column=check.column,
        row=row0 + seq,
        token=best[1] if best[1] >= 0 else None,
    )
