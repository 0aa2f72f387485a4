"""Validation between the reader and the metric core: every batch is checked as it streams, in torch.

The reader already rejects what is wrong with the *shape* of a dump (missing or mistyped columns, nulls, per-token
columns of unequal length, non-contiguous token-layout ``seq_id``s, schemas differing across files). This layer
rejects what is wrong with its *values*, which would otherwise turn into silently wrong figures:

============================  =========================================================================
reason (``invalid/<reason>``)  what is wrong
============================  =========================================================================
``loss_mask_not_binary``       a ``loss_mask`` value other than 0 and 1 (any token)
``<logp>_not_finite``          NaN or ±inf log-prob at a valid token (``new/old/prox/ref/teacher_logp``)
``<logp>_positive``            log-prob > :data:`LOGP_TOLERANCE` at a valid token
``entropy_not_finite``         NaN or ±inf entropy at a valid token
``entropy_negative``           entropy < −:data:`LOGP_TOLERANCE` at a valid token
``advantages_not_finite``      NaN or ±inf advantage at a valid token
``versions_below_minus_one``   version < −1 at a valid token
``versions_above_current``     version > the sequence's ``current_version`` at a valid token
``rewards_not_finite``         NaN or ±inf reward (per sequence)
``eos_not_binary``             an ``eos`` flag other than 0 and 1 (per sequence)
============================  =========================================================================

A *valid* token has ``loss_mask = 1``; masked positions may hold anything (prompt padding, NaN, garbage), because no
figure reads them. Only the columns a command reads are checked.

Policies (``--on-invalid``): ``error`` (the default) raises :class:`~grpo_cli.errors.InputError` naming the file,
the column, the row (and token) of the first offender in file order and what is wrong; ``skip`` drops every
sequence with any problem and counts them, per reason, in a mergeable :class:`~grpo_cli.core.state.MetricState`
(reported as ``invalid/*`` keys and a warning on stderr: nothing is dropped silently).

Cost: the clean path is one fused elementwise pass per checked column folded into a single ``ok`` tensor and one
host sync per batch; the per-reason analysis runs only for batches that hold a problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.state import MetricState, count
from grpo_cli.engine.checks import (
    _CHECK,
    _HINT,
    _ORDER,
    CHECKS,
    LOGP_COLUMNS_CHECKED,
    LOGP_TOLERANCE,
    Check,
    _describe,
)
from grpo_cli.engine.config import OnInvalid
from grpo_cli.engine.figures import Figure
from grpo_cli.engine.group import MetricGroup
from grpo_cli.errors import InputError

if TYPE_CHECKING:
    from grpo_cli.engine.config import StreamConfig
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.io.storage import DumpPath, Location

__all__ = [
    "CHECKS",
    "LOGP_COLUMNS_CHECKED",
    "LOGP_TOLERANCE",
    "BatchValidator",
    "Check",
    "OnInvalid",
    "ValidationGroup",
    "readable_files",
    "require_data",
    "skipped_warning",
    "unreadable_warning",
    "validation_compute",
    "validation_state",
]

def validation_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state of skip counts: sequences and tokens dropped, and sequences per reason (all int64)."""
    specs = {"n_sequences_skipped": count(), "n_tokens_skipped": count()}
    specs.update({check.reason: count() for check in CHECKS})
    return MetricState(specs, device)


def validation_compute(state: MetricState) -> dict[str, int]:
    """``invalid/n_sequences_skipped``, ``invalid/n_tokens_skipped`` and ``invalid/<reason>`` for each reason that
    dropped a sequence (a sequence with several problems counts once in the totals and once per reason)."""
    out = {
        "invalid/n_sequences_skipped": int(state["n_sequences_skipped"]),
        "invalid/n_tokens_skipped": int(state["n_tokens_skipped"]),
    }
    for check in CHECKS:
        n = int(state[check.reason])
        if n:
            out[f"invalid/{check.reason}"] = n
    return out


@dataclass
class _Finding:
    check: Check
    bad: Tensor  # [N] per token or [B] per sequence, bool


class BatchValidator:
    """Checks (and under ``skip`` filters) each :class:`TokenBatch` before any metric sees it.

    Args:
        on_invalid: ``"error"`` or ``"skip"`` (:class:`OnInvalid`).
        files: the dataset's file names, indexed by ``batch.file_index`` (for messages).
        column_names: ``{canonical: name in the file}`` for messages (``--map``); default the canonical names.
        token_layout: the files are token-per-row: messages then name the token's own file row.
        tolerance: :data:`LOGP_TOLERANCE` unless you have a reason.
        current_version: the trainer version for batches without a ``current_version`` column
            (``--current-version``); versions are checked against it.

    Example:
        >>> batch = TokenBatch(cu_seqlens=torch.tensor([0, 2, 3]), new_logp=torch.tensor([-1.0, 0.5, -2.0]),
        ...                    loss_mask=torch.tensor([1, 1, 1], dtype=torch.int8))
        >>> state = validation_state()
        >>> kept = BatchValidator("skip")(batch, state)
        >>> kept.new_logp.tolist(), validation_compute(state)["invalid/new_logp_positive"]
        ([-2.0], 1)
    """

    def __init__(
        self,
        on_invalid: OnInvalid | str = OnInvalid.error,
        *,
        files: Sequence[str] = (),
        column_names: Mapping[str, str] | None = None,
        token_layout: bool = False,
        tolerance: float = LOGP_TOLERANCE,
        current_version: int | None = None,
    ) -> None:
        try:
            self.on_invalid = OnInvalid(on_invalid)
        except ValueError:
            raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}") from None
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        self.files = [str(f) for f in files]
        self.column_names = dict(column_names or {})
        self.token_layout = token_layout
        self.tolerance = float(tolerance)
        self.current_version = current_version

    @classmethod
    def for_dataset(
        cls, dataset: RolloutDataset, on_invalid: OnInvalid | str, current_version: int | None = None
    ) -> BatchValidator:
        """A validator whose messages use ``dataset``'s file and column names."""
        from grpo_cli.io.schema import Layout

        return cls(
            on_invalid,
            files=[str(p) for p in dataset.files],
            column_names=dataset.column_map,
            token_layout=dataset.layout is Layout.TOKEN_PER_ROW,
            current_version=current_version,
        )

    def __call__(self, batch: TokenBatch, state: MetricState | None = None) -> TokenBatch:
        """Validate ``batch`` (whose ``loss_mask`` may still hold the raw integer values).

        Returns:
            The batch with a bool ``loss_mask``; under ``skip``, without the offending sequences (counted into
            ``state``, which ``skip`` requires).

        Raises:
            InputError: under ``error``, for the first offender in the batch.
        """
        if self.on_invalid is OnInvalid.skip and state is None:
            raise ValueError("on_invalid='skip' needs a validation_state() to count the skipped sequences in")
        raw = batch.loss_mask
        valid = raw if raw.dtype == torch.bool else raw != 0
        clean = replace(batch, loss_mask=valid)
        problem, view = self._any_problem(batch, raw)
        if not problem:
            if view is not None:
                clean.memo()["valid"] = view  # the same compaction clean.valid() would build (TokenBatch.valid)
            return clean
        findings = self._findings(batch, raw, valid)
        if self.on_invalid is OnInvalid.error:
            raise self._error(batch, findings)
        assert state is not None
        return self._skip(clean, findings, state)

    # -- the clean path: reductions over the valid tokens, one sync --------------------------------------------
    def _any_problem(self, batch: TokenBatch, raw: Tensor) -> tuple[bool, TokenBatch | None]:
        """Whether any rule fails, and the batch's valid view (:meth:`TokenBatch.valid`, which every metric needs
        next anyway). The checks run on the compacted valid tokens as min/max reductions (NaN propagates through
        both, so it fails every bound) instead of full-length masks: no per-token boolean temporaries."""
        tol = self.tolerance
        flags: list[Tensor] = []
        if raw.dtype != torch.bool and raw.numel():
            flags.append((raw.amin() < 0) | (raw.amax() > 1))
        view = batch.valid()
        if view.n_tokens:

            def outside(x: Tensor, low: float, high: float, *, strict_low: bool, strict_high: bool) -> Tensor:
                lo, hi = x.amin(), x.amax()
                ok_lo = lo > low if strict_low else lo >= low
                ok_hi = hi < high if strict_high else hi <= high
                return ~(ok_lo & ok_hi)

            for column in LOGP_COLUMNS_CHECKED:
                x = getattr(view, column, None)
                if x is not None:  # finite and <= tol: False for NaN, ±inf and positive values
                    flags.append(outside(x, -math.inf, tol, strict_low=True, strict_high=False))
            if view.entropy is not None:
                flags.append(outside(view.entropy, -tol, math.inf, strict_low=False, strict_high=True))
            if view.advantages is not None:
                flags.append(outside(view.advantages, -math.inf, math.inf, strict_low=True, strict_high=True))
            if view.versions is not None:
                v = view.versions
                flags.append(v.amin() < -1)
                if view.current_version is not None:
                    current = broadcast_to_tokens(view.current_version.to(v.device), view.cu_seqlens, view.n_tokens)
                    flags.append((v > current).any())
                elif self.current_version is not None:
                    flags.append(v.amax() > self.current_version)
        if batch.rewards is not None:
            flags.append((~torch.isfinite(batch.rewards)).any())
        eos = getattr(batch, "eos", None)
        if eos is not None:
            flags.append(((eos < 0) | (eos > 1)).any())
        return (bool(torch.stack(flags).any()) if flags else False), view

    def _versions_ok(self, batch: TokenBatch) -> Tensor:
        versions = batch.versions
        assert versions is not None
        ok = versions >= -1
        if batch.current_version is not None:
            current = broadcast_to_tokens(batch.current_version.to(versions.device), batch.cu_seqlens, batch.n_tokens)
            ok &= versions <= current
        elif self.current_version is not None:
            ok &= versions <= self.current_version
        return ok

    # -- the slow path: which rule, where ----------------------------------------------------------------------
    def _findings(self, batch: TokenBatch, raw: Tensor, valid: Tensor) -> list[_Finding]:
        tol = self.tolerance
        found: list[_Finding] = []

        def add(reason: str, bad: Tensor) -> None:
            if bool(bad.any()):
                found.append(_Finding(_CHECK[reason], bad))

        if raw.dtype != torch.bool:
            add("loss_mask_not_binary", (raw < 0) | (raw > 1))
        for column in LOGP_COLUMNS_CHECKED:
            x = getattr(batch, column, None)
            if x is not None:
                add(f"{column}_not_finite", valid & ~torch.isfinite(x))
                add(f"{column}_positive", valid & (x > tol) & (x < math.inf))
        if batch.entropy is not None:
            e = batch.entropy
            add("entropy_not_finite", valid & ~torch.isfinite(e))
            add("entropy_negative", valid & (e < -tol) & (e > -math.inf))
        if batch.advantages is not None:
            add("advantages_not_finite", valid & ~torch.isfinite(batch.advantages))
        if batch.versions is not None:
            v = batch.versions
            add("versions_below_minus_one", valid & (v < -1))
            add("versions_above_current", valid & (v >= -1) & ~self._versions_ok(batch))
        if batch.rewards is not None:
            add("rewards_not_finite", ~torch.isfinite(batch.rewards))
        eos = getattr(batch, "eos", None)
        if eos is not None:
            add("eos_not_binary", (eos < 0) | (eos > 1))
        found.sort(key=lambda f: _ORDER[f.check.reason])
        return found

    def _error(self, batch: TokenBatch, findings: list[_Finding]) -> InputError:
        cu = batch.cu_seqlens
        best: tuple[int, int, int] | None = None
        chosen: tuple[_Finding, int, int | None] | None = None
        for finding in findings:
            first = int(torch.nonzero(finding.bad)[0])
            if finding.check.per_sequence:
                seq, pos, index = first, -1, None
            else:
                seq = int(torch.searchsorted(cu, torch.tensor(first, device=cu.device), right=True)) - 1
                pos, index = first - int(cu[seq]), first
            key = (seq, pos, _ORDER[finding.check.reason])
            if best is None or key < best:
                best, chosen = key, (finding, seq, index)
        assert chosen is not None and best is not None
        finding, seq, index = chosen
        pos = best[1]
        check = finding.check
        row = int(batch.rows[seq]) if batch.rows is not None else seq
        token: int | None = pos if pos >= 0 else None
        if self.token_layout and token is not None:
            row, token = row + token, None  # in a token-per-row file the token *is* a row
        values = getattr(batch, check.column)
        value = values[seq if index is None else index].item()
        current = batch.current_version[seq].item() if batch.current_version is not None else self.current_version
        what = _describe(check, value, self.tolerance, cast("int | None", current))  # an integer column
        file = self.files[batch.file_index] if 0 <= batch.file_index < len(self.files) else None
        return InputError(
            f"{what}; {_HINT}",
            file=file,
            column=self.column_names.get(check.column, check.column),
            row=row,
            token=token,
        )

    def _skip(self, batch: TokenBatch, findings: list[_Finding], state: MetricState) -> TokenBatch:
        cu = batch.cu_seqlens
        drop = torch.zeros(batch.n_sequences, dtype=torch.bool, device=cu.device)
        per_reason: dict[str, Tensor] = {}
        for finding in findings:
            bad = finding.bad
            seq_bad = bad if finding.check.per_sequence else segment_sum(bad.to(torch.int64), cu) > 0
            per_reason[finding.check.reason] = seq_bad.sum()
            drop |= seq_bad
        lengths = lengths_from_cu_seqlens(cu)
        state.update(n_sequences_skipped=drop.sum(), n_tokens_skipped=lengths[drop].sum(), **per_reason)
        return batch.select_sequences(~drop)


class ValidationGroup(MetricGroup):
    """The ``invalid/*`` figures: sequences ``--on-invalid skip`` dropped, in total and per reason.

    It is a metric group so that its counts merge like every other state (batches, ``--workers``, ranks). The
    dropping itself happens in :func:`grpo_cli.engine.runner.accumulate_states`, before any group sees the batch;
    ``update`` has nothing left to do. Under ``--on-invalid error`` it reports nothing (a run that finishes had no
    problem).
    """

    name = "invalid"
    figures = (
        Figure("invalid/n_sequences_skipped", "sequences dropped as invalid (left out of every figure)"),
        Figure("invalid/n_tokens_skipped", "tokens of the dropped sequences"),
        *(Figure(f"invalid/{check.reason}", f"sequences dropped: {check.meaning}") for check in CHECKS),
    )

    def columns(self) -> frozenset[str]:
        # current_version is read so that versions can be checked against it.
        return frozenset({"loss_mask", "current_version"})

    def init_state(self, config: StreamConfig, device: torch.device | str) -> MetricState:
        return validation_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: StreamConfig) -> None:
        return None

    def compute(self, state: MetricState, config: StreamConfig) -> dict[str, Any]:
        return validation_compute(state) if config.on_invalid == OnInvalid.skip.value else {}


def skipped_warning(metrics: Mapping[str, Any]) -> str | None:
    """The one-line stderr warning for a report whose ``invalid/n_sequences_skipped`` is non-zero, else ``None``."""
    n = int(metrics.get("invalid/n_sequences_skipped", 0) or 0)
    if n == 0:
        return None
    tokens = int(metrics.get("invalid/n_tokens_skipped", 0) or 0)
    totals = ("invalid/n_sequences_skipped", "invalid/n_tokens_skipped")
    reasons = ", ".join(
        f"{key.removeprefix('invalid/')}: {value}"
        for key, value in metrics.items()
        if key.startswith("invalid/") and key not in totals
    )
    kept = metrics.get("n_sequences")
    of = f" of {int(kept) + n}" if isinstance(kept, int) else ""
    return (
        f"skipped {n}{of} sequences ({tokens} tokens) as invalid ({reasons}); every figure leaves them out "
        "and the report lists them under invalid/*"
    )


def readable_files(
    paths: Sequence[Location],
) -> tuple[list[DumpPath], list[tuple[DumpPath, str]]]:
    """``--on-invalid skip`` for whole files: the files of ``paths`` (as the reader expands them) whose Parquet
    footer can be read, and the others with why (a truncated or corrupt file: the footer is written last).

    Raises:
        InputError: no file of ``paths`` can be read (the first one's error; there is nothing to analyse).
    """
    import pyarrow as pa

    from grpo_cli.io.reader import expand_paths
    from grpo_cli.io.storage import open_parquet

    readable: list[DumpPath] = []
    skipped: list[tuple[DumpPath, str]] = []
    for path in expand_paths(paths):
        try:
            open_parquet(path, memory_map=True)
        except (pa.ArrowException, OSError) as exc:
            skipped.append((path, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))
            continue
        except InputError as exc:  # an object in object storage: only a bad file is skipped, not a refused request
            if not exc.reason.startswith("not a readable Parquet file"):
                raise
            skipped.append((path, exc.reason))
            continue
        readable.append(path)
    if not readable:
        path, why = skipped[0]
        raise InputError(f"not a readable Parquet file ({why}); no file of the input can be read", file=str(path))
    return readable, skipped


def unreadable_warning(skipped: Sequence[tuple[DumpPath, str]], n_files: int) -> str | None:
    """The one-line stderr warning for the files :func:`readable_files` skipped, or ``None`` when it skipped none."""
    if not skipped:
        return None
    shown = "; ".join(f"{path} ({why})" for path, why in skipped[:3]) + (" …" if len(skipped) > 3 else "")
    return (f"skipped {len(skipped)} of {n_files} files as not readable Parquet (--on-invalid skip): {shown}; "
            "every figure leaves them out")


def require_data(metrics: Mapping[str, Any], inputs: Sequence[str] = ()) -> None:
    """Raise :class:`InputError` when there is nothing to compute a figure from.

    Zero rows, every sequence skipped as invalid, or zero valid tokens (``loss_mask`` 0 everywhere) all make
    every figure undefined; reporting counts alone would let an empty or all-masked dump pass a CI gate unseen.
    Keys absent from ``metrics`` are not checked.
    """
    file = inputs[0] if len(inputs) == 1 else None
    where = "" if file is not None or not inputs else f" ({len(inputs)} files)"
    n_seq = metrics.get("n_sequences")
    skipped = int(metrics.get("invalid/n_sequences_skipped", 0) or 0)
    if n_seq == 0 and skipped:
        reasons = ", ".join(
            f"{k.removeprefix('invalid/')}: {v}"
            for k, v in metrics.items()
            if k.startswith("invalid/") and k not in ("invalid/n_sequences_skipped", "invalid/n_tokens_skipped")
        )
        raise InputError(
            f"every sequence ({skipped}) was skipped as invalid ({reasons}){where}; nothing is left to analyse",
            file=file,
        )
    if n_seq == 0:
        raise InputError(f"the input has no rows (0 sequences){where}; nothing to analyse", file=file)
    n_valid = metrics.get("n_valid_tokens")
    if n_valid == 0:
        n_tokens = metrics.get("n_tokens", "all")
        of = f" of {n_seq} sequences" if n_seq is not None else ""
        raise InputError(
            f"no valid tokens: loss_mask is 0 on all {n_tokens} tokens{of}{where}; every figure is over tokens with "
            "loss_mask = 1 (check the loss_mask column, or point --map loss_mask=COLUMN at the right one)",
            file=file,
        )
