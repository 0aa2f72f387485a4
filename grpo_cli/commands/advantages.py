"""``grpo-cli advantages``: recompute a dump's advantages from its rewards and compare (``docs/advantages.md``).

The math lives in the core (:mod:`grpo_cli.core.rewards`, :mod:`grpo_cli.core.advantages`,
:mod:`grpo_cli.core.adv_check`) and the metric groups (:mod:`grpo_cli.metrics.adv_check`); this module runs them
through :func:`grpo_cli.engine.run.run` (value validation, ``--workers``, ``torchrun``) in passes:

1. the per-sequence scalars of every sequence (O(n_sequences) memory, never per-token tensors of the whole dump),
   from which reward shaping, ``reward_norm``, the per-sequence estimators and their common variants are computed
   at once — a group split across row groups or files is still one group;
2. per-token estimators normalised over a training batch (GAE with ``adv_norm``, REINFORCE++'s whitening): one
   token pass per float64 moment the normalisation needs;
3. the comparison of each batch's recomputed advantages with the dump's (and the variants'), then, with
   ``--write``, one sequential pass that writes the dump with the recomputed column.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa
import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.engine.run import run
from grpo_cli.engine.validate import ValidationGroup
from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.parquet_file import ColumnRewriter
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.io.schema import COLUMNS, ColumnKind, Layout
from grpo_cli.io.storage import DumpPath, read_schema
from grpo_cli.metrics.adv_check import (
    AdvCheckGroup,
    AdvMomentsGroup,
    AdvSequencesGroup,
    sequences_from,
    stash_advantages,
)
from grpo_cli.metrics.adv_config import PER_SEQUENCE_ESTIMATORS, AdvantageCheckConfig, parse_norm_spec
from grpo_cli.metrics.adv_recompute import Recompute, sequence_variants

__all__ = [
    "PER_SEQUENCE_ESTIMATORS",
    "AdvantageCheckConfig",
    "AdvantageCheckResult",
    "check_advantages",
    "parse_norm_spec",
    "per_token_advantages",
]


@dataclass
class AdvantageCheckResult:
    """What every output format renders."""

    metrics: dict[str, Any]
    omitted: dict[str, str]
    inputs: list[str]
    config: dict[str, Any]
    columns: list[str] = field(default_factory=list)
    written: str | None = None
    variants: list[dict[str, Any]] = field(default_factory=list)
    """On a mismatch of a per-sequence estimator: each common variant's options and mismatch counts."""
    matching_variant: dict[str, Any] | None = None
    """The first of :attr:`variants` under which every compared sequence agrees, or None."""

    @property
    def mismatch(self) -> bool:
        """True when any compared sequence disagrees beyond the tolerance."""
        return int(self.metrics.get("adv_check/n_sequences_mismatch", 0)) > 0

    def extra(self) -> dict[str, Any]:
        """The JSON document's keys besides ``metrics``: columns, the written file and, on a mismatch, the variants."""
        out: dict[str, Any] = {"columns": self.columns, "written": self.written}
        if self.variants:
            out["matching_variant"] = self.matching_variant
            out["variants"] = self.variants
        return out




class _Writer:
    """Writes every input row, in order, to one Parquet file with the recomputed ``advantages`` column (through the
    io layer's :class:`~grpo_cli.io.parquet_file.ColumnRewriter`)."""

    def __init__(self, out: DumpPath, dataset: RolloutDataset, column: str, cfg: AdvantageCheckConfig) -> None:
        self.out, self.dataset = out, dataset
        first = read_schema(dataset.files[0])
        index = first.get_field_index(column)
        old_type = first.field(index).type if index >= 0 else None
        inner = old_type.value_type if old_type is not None and pa.types.is_list(old_type) else old_type
        self.value_type = pa.float64() if inner is not None and pa.types.is_float64(inner) else pa.float32()
        per_token_column = dataset.layout is Layout.TOKEN_PER_ROW or (
            old_type is not None and (pa.types.is_list(old_type) or pa.types.is_large_list(old_type))
        )
        self.per_token = per_token_column or cfg.estimator not in PER_SEQUENCE_ESTIMATORS
        metadata = {b"grpo_cli.advantages": json.dumps(cfg.to_json()).encode()}
        self.rewriter = ColumnRewriter(out, list(dataset.files), column, metadata)

    def write(self, batch: TokenBatch, expected: Tensor, per_sequence: Tensor | None) -> None:
        rows = cast(Tensor, batch.rows).cpu()  # the reader sets rows
        start = int(rows[0]) if rows.numel() else 0
        if self.dataset.layout is Layout.TOKEN_PER_ROW:
            stop = start + batch.n_tokens
        else:
            stop = int(rows[-1]) + 1 if rows.numel() else start
        np_type = "float64" if self.value_type == pa.float64() else "float32"
        if self.dataset.layout is Layout.TOKEN_PER_ROW:
            array: pa.Array = pa.array(expected.cpu().numpy().astype(np_type), self.value_type)
        elif self.per_token:
            offsets = pa.array(batch.cu_seqlens.cpu().numpy().astype("int32"), pa.int32())
            values = pa.array(expected.cpu().numpy().astype(np_type), self.value_type)
            array = pa.ListArray.from_arrays(offsets, values)
        else:
            assert per_sequence is not None
            array = pa.array(per_sequence.cpu().numpy().astype(np_type), self.value_type)
        try:
            self.rewriter.write(batch.file_index, start, stop, array)
        except OSError as exc:
            raise UsageError(f"--write {self.out}: cannot write ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise InputError(f"--write: {exc}", file=str(self.dataset.files[batch.file_index])) from None

    def close(self, ok: bool) -> None:
        self.rewriter.close(ok)


def _resolve_batch_by(dataset: RolloutDataset, cfg: AdvantageCheckConfig) -> str | None:
    choice = cfg.batch_by
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return "step" if "step" in dataset.columns else None
    spec = COLUMNS.get(choice)
    if spec is None or spec.kind is not ColumnKind.SEQUENCE_INT:
        names = [name for name, s in COLUMNS.items() if s.kind is ColumnKind.SEQUENCE_INT]
        raise UsageError(f"--batch-by must be a per-sequence int column ({', '.join(names)}) or none, got '{choice}'")
    if choice not in dataset.columns:
        raise UsageError(f"--batch-by {choice}: the dump has no '{choice}' column")
    return choice


def _require(dataset: RolloutDataset, cfg: AdvantageCheckConfig, write: DumpPath | None) -> None:
    have = dataset.columns
    need = {"rewards": "every estimator recomputes advantages from the rewards"}
    if cfg.estimator in PER_SEQUENCE_ESTIMATORS:
        need["group_id"] = f"--estimator {cfg.estimator} normalises within groups"
    for norm, option in ((cfg.reward_norm, "--reward-norm"), (cfg.adv_norm, "--adv-norm")):
        if norm is not None and "group" in (norm.mean_level, norm.std_level) and norm.group_size == 1:
            need["group_id"] = f"{option} has a group level (or give group_size=N)"
    if cfg.estimator == "gae" and cfg.kl_ctl != 0:
        need["old_logp"] = "--kl-ctl ≠ 0 needs the behaviour log-probs for the KL reward"
    if cfg.mask_no_eos_with_zero and "eos" not in have and cfg.max_new_tokens is None:
        raise UsageError("--mask-no-eos-with-zero needs an 'eos' column or --max-new-tokens")
    if "advantages" not in have and write is None:
        raise UsageError("the dump has no 'advantages' column: nothing to compare (use --write to create one)")
    for column, why in need.items():
        if column not in have:
            raise UsageError(f"the dump has no '{column}' column: {why}")

def check_advantages(
    dataset: RolloutDataset,
    cfg: AdvantageCheckConfig,
    *,
    write: DumpPath | None = None,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> AdvantageCheckResult:
    """Recompute the advantages of ``dataset`` with ``cfg`` and compare them with its ``advantages`` column.

    Args:
        dataset: the dump (with ``--write``, read without a preset's transforms: its rows are copied as stored).
        cfg: the estimator and its options (validated here).
        write: also write the dump with the recomputed advantages to this Parquet file.
        workers: processes per pass (:func:`grpo_cli.engine.run.run`; no figure depends on it).
        progress: called with each batch's token count, in every pass.

    Returns:
        The ``adv_check/*`` figures (:func:`~grpo_cli.core.adv_check.adv_diff_compute`), with the reasons for any
        omitted ones and, on a mismatch of a per-sequence estimator, the common variants that were tried.
    """
    cfg.validate()
    if write is not None:
        out = write.resolve()
        if any(out == path.resolve() for path in dataset.files):
            raise UsageError(f"--write {write}: is one of the inputs")
        if cfg.on_invalid != "error":
            raise UsageError("--write copies every row of the dump: it needs --on-invalid error")
        if dataset.transforms:
            raise UsageError("--write copies the rows as stored: it cannot follow a --preset's transforms (use --map)")
    _require(dataset, cfg, write)
    batch_by = _resolve_batch_by(dataset, cfg)
    device = torch.device(cfg.device)
    files = tuple(str(p) for p in dataset.files)

    def passed(groups: list[Any], data: RolloutDataset = dataset) -> dict[str, Any]:
        # Every pass validates (and under --on-invalid skip drops) the same sequences; the last one reports it.
        return run(data, [ValidationGroup(), *groups], cfg, workers=workers, progress=progress).metrics

    table = passed([AdvSequencesGroup(batch_by)])["sequences"]
    seqs = sequences_from(table, dataset.columns, batch_by, device)
    recompute = Recompute(seqs, cfg)
    for phase in recompute.phases():
        moments = AdvMomentsGroup(recompute, phase, files)
        moments.load(passed([moments])["moments"])

    has_adv = "advantages" in dataset.columns
    per_token_column = has_adv and per_token_advantages(dataset)
    compare_all = per_token_column and not cfg.valid_only
    metrics: dict[str, Any] = {}
    omitted: dict[str, str] = {}
    variants: list[dict[str, Any]] = []
    matching: dict[str, Any] | None = None
    if has_adv:
        candidates = sequence_variants(seqs, recompute.scores, cfg)
        group = AdvCheckGroup(recompute, candidates, compare_all=compare_all, files=files)
        stashed = copy.copy(dataset)
        stashed.transforms = [*dataset.transforms, stash_advantages]
        metrics = passed([group], stashed)
        metrics.pop("n_valid_tokens", None)
        tried = metrics.pop("variants", [])
        if "adv_check/max_abs_diff" not in metrics:
            omitted["adv_check/max_abs_diff"] = "no token was compared (no valid tokens)"
        if int(metrics.get("adv_check/n_sequences_mismatch", 0)) > 0:
            variants = tried
            settings = {v.options: v.settings for v in candidates}
            for variant in tried:
                if variant["n_sequences_mismatch"] == 0:
                    matching = {"options": variant["options"], **settings[variant["options"]]}
                    break
    else:
        omitted["adv_check/*"] = "the dump has no 'advantages' column (recomputed values were written only)"
    if write is not None:
        _write(dataset, cfg, recompute, write)
    config = cfg.to_json()
    config["batch_by"] = batch_by
    config["compared"] = "all tokens" if compare_all else "valid tokens"
    return AdvantageCheckResult(
        metrics=metrics,
        omitted=omitted,
        inputs=list(files),
        config=config,
        columns=sorted(dataset.columns),
        written=None if write is None else str(write),
        variants=variants,
        matching_variant=matching,
    )


def _write(dataset: RolloutDataset, cfg: AdvantageCheckConfig, recompute: Recompute, out: DumpPath) -> None:
    """Write every row of the dump, in order, with the recomputed ``advantages`` (one sequential pass)."""
    device = torch.device(cfg.device)
    writer = _Writer(out, dataset, dataset.column_map.get("advantages", "advantages"), cfg)
    ok = False
    try:
        for batch in dataset.iter_batches(columns=recompute.columns(), batch_tokens=cfg.batch_tokens):
            batch = batch.to(device)
            idx = recompute.seqs.index_of(batch)
            if idx is None:
                raise InputError("the dump changed while it was being read", file=str(dataset.files[batch.file_index]))
            expected = recompute.expected(batch, idx)
            per_seq = None if recompute.per_sequence is None else recompute.per_sequence[idx]
            writer.write(batch, expected, per_seq)
        ok = True
    finally:
        writer.close(ok)


def per_token_advantages(dataset: RolloutDataset) -> bool:
    """Whether the dump stores one advantage per token (a list column, or any token-per-row file)."""
    if dataset.layout is Layout.TOKEN_PER_ROW:
        return True
    name = dataset.column_map.get("advantages", "advantages")
    schema = read_schema(dataset.files[0])
    dtype = schema.field(schema.get_field_index(name)).type
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)

