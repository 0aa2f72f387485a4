"""``grpo-cli advantages``: recompute a dump's advantages from its rewards and compare (``docs/advantages.md``).

The math lives in the core (:mod:`grpo_cli.core.rewards`, :mod:`grpo_cli.core.advantages`,
:mod:`grpo_cli.core.adv_check`); this module streams the dump through it. Group and batch statistics need whole
groups and whole training batches, which streaming by row group may split, so the check runs in passes:

1. one pass collects the per-sequence scalars — reward, ``group_id``, ``step`` (the training batch), ``eos``,
   response length and location — for every sequence: **O(n_sequences) memory** (about 100 bytes per sequence), never
   per-token tensors of the whole dump. Reward shaping, ``reward_norm`` and the per-sequence estimators (GRPO,
   Dr.GRPO, RLOO) run on these arrays at once, so a group split across row groups or files is still one group;
2. per-token estimators whose result is normalised over a training batch (GAE with ``adv_norm``, REINFORCE++'s
   whitening) stream the token data once or twice more to accumulate float64 batch/group statistics;
3. a last pass recomputes each batch's advantages, compares them with the dump's and (``--write``) writes the dump
   with the recomputed column.

Training batches: batch-level statistics (AReaL ``batch`` levels, REINFORCE++ whitening) and groups are taken per
value of ``batch_by`` (default: the ``step`` column when the dump has one, else the whole dump is one batch); group
keys are ``(batch, group_id)``, so reused group ids in different steps never merge.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor

from grpo_cli.core.adv_check import (
    StreamingNormalization,
    StreamingWhiten,
    adv_diff_compute,
    adv_diff_state,
    adv_diff_update,
)
from grpo_cli.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    NormConfig,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    normalize,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    roll_to_next_token,
)
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.packing import segment_ids, segment_sum
from grpo_cli.core.rewards import KL_ESTIMATORS, kl_regularized_rewards, reward_overlong_penalty, shape_rewards
from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.align import unroll_next_token
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset
from grpo_cli.io.schema import COLUMNS, ColumnKind, Layout

__all__ = [
    "PER_SEQUENCE_ESTIMATORS",
    "AdvantageCheckConfig",
    "AdvantageCheckResult",
    "check_advantages",
    "parse_norm_spec",
]

PER_SEQUENCE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
"""Estimators with one advantage per sequence (broadcast over its valid tokens, 0 elsewhere)."""

_DEFAULT_STD_EPS = {"grpo": 1e-6, "reinforce_pp": 1e-8}
_F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------


def parse_norm_spec(text: str | None, option: str = "--adv-norm") -> NormConfig | None:
    """``MEAN[/STD][,leave1out][,biased][,eps=E][,group_size=N]`` → :class:`NormConfig` (``none`` → None).

    ``MEAN`` and ``STD`` are ``batch``, ``group`` or ``none``; a lone level is used for both. ``biased`` divides
    the std by N instead of N − 1; ``eps`` defaults to AReaL's 1e-5.

    Example:
        >>> parse_norm_spec("group,leave1out,eps=0")
        NormConfig(mean_level='group', mean_leave1out=True, std_level='group', std_unbiased=True, eps=0.0, \
group_size=1)
        >>> parse_norm_spec("batch/none").std_level is None
        True
    """
    if text is None or text.strip().lower() == "none":
        return None
    head, *options = [part.strip() for part in text.split(",")]
    levels = [level.strip().lower() for level in head.split("/")]
    if len(levels) not in (1, 2) or any(level not in ("batch", "group", "none") for level in levels):
        raise UsageError(f"{option}: expected MEAN[/STD] with levels batch|group|none, got '{head}'")
    mean = None if levels[0] == "none" else levels[0]
    std = mean if len(levels) == 1 else (None if levels[1] == "none" else levels[1])
    kwargs: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        try:
            if key == "leave1out" and not sep:
                kwargs["mean_leave1out"] = True
            elif key == "biased" and not sep:
                kwargs["std_unbiased"] = False
            elif key == "eps" and sep:
                kwargs["eps"] = float(value)
            elif key == "group_size" and sep:
                kwargs["group_size"] = int(value)
            else:
                raise UsageError(f"{option}: unknown option '{item}' (leave1out, biased, eps=E, group_size=N)")
        except ValueError:
            raise UsageError(f"{option}: bad value in '{item}'") from None
    try:
        return NormConfig(mean_level=mean, std_level=std, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{option}: {exc}") from None


@dataclass
class AdvantageCheckConfig:
    """Every option of ``grpo-cli advantages`` that changes a figure (reported in the JSON ``config``).

    Defaults are neutral — no shaping, no KL reward, no normalisation — rather than AReaL's (which clip rewards at
    20 and add a 0.1·k1 KL reward): state the trainer's configuration explicitly (``docs/advantages.md``).
    """

    estimator: str
    atol: float = 1e-5
    rtol: float = 0.0
    valid_only: bool = False
    top_k: int = 10
    batch_by: str | None = "auto"
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float | None = None
    overlong_tokens: int | None = None
    overlong_penalty_factor: float | None = None
    max_new_tokens: int | None = None
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"
    discount: float = 1.0
    gae_lambda: float = 1.0
    mask_no_eos_with_zero: bool = False
    std_eps: float | None = None
    std_unbiased: bool = True
    rloo_singleton: str = "keep"
    alignment: str = "token"
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"

    def validate(self) -> None:
        """Raise :class:`UsageError` for a bad value or an option the estimator does not use."""
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise UsageError(f"--estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got '{self.estimator}'")
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        if self.reward_clip is not None and not self.reward_clip >= 0:
            raise UsageError(f"--reward-clip must be >= 0, got {self.reward_clip}")
        if (self.overlong_tokens is None) != (self.overlong_penalty_factor is None):
            raise UsageError("--overlong-tokens and --overlong-penalty-factor go together")
        if self.overlong_tokens is not None and self.overlong_tokens < 1:
            raise UsageError(f"--overlong-tokens must be >= 1, got {self.overlong_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise UsageError(f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}, got '{self.kl_estimator}'")
        if self.std_eps is not None and not (math.isfinite(self.std_eps) and self.std_eps >= 0):
            raise UsageError(f"--std-eps must be a finite number >= 0, got {self.std_eps}")
        if self.rloo_singleton not in ("keep", "zero"):
            raise UsageError(f"--rloo-singleton must be keep or zero, got '{self.rloo_singleton}'")
        if self.alignment not in ("token", "next"):
            raise UsageError(f"--alignment must be token or next, got '{self.alignment}'")
        est = self.estimator
        unused = {
            "--kl-ctl": self.kl_ctl != 0 and est != "gae",
            "--gae-lambda": self.gae_lambda != 1.0 and est != "gae",
            "--discount": self.discount != 1.0 and est not in ("gae", "reinforce_pp"),
            "--adv-norm": self.adv_norm is not None and est != "gae",
            "--mask-no-eos-with-zero": self.mask_no_eos_with_zero and est != "gae",
            "--alignment next": self.alignment != "token" and est != "gae",
            "--std-eps": self.std_eps is not None and est not in _DEFAULT_STD_EPS,
            "--std-biased": not self.std_unbiased and est != "grpo",
            "--rloo-singleton zero": self.rloo_singleton != "keep" and est != "rloo",
        }
        for option, bad in unused.items():
            if bad:
                raise UsageError(f"{option} does not apply to --estimator {est}")

    @property
    def eps(self) -> float | None:
        """The std ε of the estimator (GRPO 1e-6 as verl, REINFORCE++ whitening 1e-8), None for the others."""
        return self.std_eps if self.std_eps is not None else _DEFAULT_STD_EPS.get(self.estimator)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("reward_norm", "adv_norm"):
            value = getattr(self, name)
            out[name] = None if value is None else asdict(value)
        out["std_eps"] = self.eps
        out.pop("device")
        out.pop("batch_tokens")
        return out


@dataclass
class AdvantageCheckResult:
    """What every output format renders."""

    metrics: dict[str, Any]
    omitted: dict[str, str]
    inputs: list[str]
    config: dict[str, Any]
    columns: list[str] = field(default_factory=list)
    written: str | None = None

    @property
    def mismatch(self) -> bool:
        """True when any compared sequence disagrees beyond the tolerance."""
        return int(self.metrics.get("adv_check/n_sequences_mismatch", 0)) > 0


# ----------------------------------------------------------------------------------------------------
# pass 1: per-sequence scalars
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Sequences:
    """One entry per sequence of the dump, in stream order (O(n_sequences))."""

    file_index: Tensor
    rows: Tensor
    rewards: Tensor
    response_len: Tensor
    group_id: Tensor | None
    batch_key: Tensor | None
    eos: Tensor | None
    batch_index: Tensor = field(init=False)
    group_index: Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        n = self.rewards.numel()
        device = self.rewards.device
        if self.batch_key is None:
            self.batch_index = torch.zeros(n, dtype=torch.int64, device=device)
        else:
            self.batch_index = torch.unique(self.batch_key, return_inverse=True)[1].to(torch.int64)
        if self.group_id is None:
            self.group_index = None
        else:
            pairs = torch.stack([self.batch_index, self.group_id], dim=1)
            self.group_index = torch.unique(pairs, dim=0, return_inverse=True)[1].to(torch.int64)

    @property
    def n(self) -> int:
        return self.rewards.numel()


def _collect_sequences(dataset: RolloutDataset, cfg: AdvantageCheckConfig, batch_by: str | None) -> _Sequences:
    columns = {"rewards", "loss_mask", "group_id", "eos"} | ({batch_by} if batch_by else set())
    device = torch.device(cfg.device)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("file", "rows", "rewards", "resp", "group", "key", "eos")}
    for batch in dataset.iter_batches(columns=columns, batch_tokens=cfg.batch_tokens):
        batch = batch.to(device)
        parts["file"].append(torch.full((batch.n_sequences,), batch.file_index, dtype=torch.int64, device=device))
        parts["rows"].append(batch.rows)
        parts["rewards"].append(batch.rewards.to(_F64))
        parts["resp"].append(segment_sum(batch.loss_mask.to(torch.int64), batch.cu_seqlens))
        if batch.group_id is not None:
            parts["group"].append(batch.group_id)
        if batch_by is not None:
            parts["key"].append(getattr(batch, batch_by))
        if batch.eos is not None:
            parts["eos"].append(batch.eos)

    def cat(name: str) -> Tensor | None:
        return torch.cat(parts[name]) if parts[name] else None

    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return _Sequences(
        file_index=cat("file") if parts["file"] else empty,
        rows=cat("rows") if parts["rows"] else empty,
        rewards=cat("rewards") if parts["rewards"] else empty.to(_F64),
        response_len=cat("resp") if parts["resp"] else empty,
        group_id=cat("group"),
        batch_key=cat("key"),
        eos=cat("eos"),
    )


def _segments_in_order(index: Tensor) -> Iterator[Tensor]:
    """The positions of each value of ``index`` (ascending values), each in stream order."""
    if index.numel() == 0:
        return
    order = torch.sort(index, stable=True).indices
    sizes = torch.bincount(index).tolist()
    start = 0
    for size in sizes:
        if size:
            yield order[start : start + size]
        start += size


def _scores(seqs: _Sequences, cfg: AdvantageCheckConfig) -> Tensor:
    """AReaL's order: overlong penalty → bias/scaling/clip → ``reward_norm`` per training batch (float64)."""
    scores = seqs.rewards
    if cfg.overlong_tokens is not None:
        scores = reward_overlong_penalty(
            scores,
            seqs.response_len,
            overlong_tokens=cfg.overlong_tokens,
            overlong_penalty_factor=float(cfg.overlong_penalty_factor),
            max_response_length=cfg.max_new_tokens or 1024,
        )
    scores = shape_rewards(
        scores, reward_bias=cfg.reward_bias, reward_scaling=cfg.reward_scaling, reward_clip=cfg.reward_clip
    )
    if cfg.reward_norm is not None:
        out = torch.empty_like(scores)
        for idx in _segments_in_order(seqs.batch_index):  # AReaL normalises each training batch on its own
            ids = None if seqs.group_id is None else seqs.group_id[idx]
            out[idx] = normalize(scores[idx], None, cfg.reward_norm, group_ids=ids)
        scores = out
    return scores


def _no_eos(seqs: _Sequences, cfg: AdvantageCheckConfig) -> Tensor:
    """Per sequence "cut off without EOS": the ``eos`` column, else ``response length ≥ --max-new-tokens``."""
    if seqs.eos is not None:
        return seqs.eos == 0
    if cfg.max_new_tokens is not None:
        return seqs.response_len >= cfg.max_new_tokens
    return torch.zeros(seqs.n, dtype=torch.bool, device=seqs.rewards.device)


# ----------------------------------------------------------------------------------------------------
# per-token recomputation
# ----------------------------------------------------------------------------------------------------


class _Recompute:
    """Per-batch recomputation of the advantages, in token alignment, from the per-sequence table."""

    def __init__(self, seqs: _Sequences, cfg: AdvantageCheckConfig) -> None:
        self.seqs, self.cfg = seqs, cfg
        self.scores = _scores(seqs, cfg)
        self.no_eos = _no_eos(seqs, cfg)
        self.per_sequence: Tensor | None = None
        self.norm: StreamingNormalization | StreamingWhiten | None = None
        est = cfg.estimator
        if est in PER_SEQUENCE_ESTIMATORS:
            assert seqs.group_index is not None
            if est == "grpo":
                self.per_sequence = grpo_advantages(
                    self.scores, seqs.group_index, eps=float(cfg.eps), std_unbiased=cfg.std_unbiased
                )
            elif est == "drgrpo":
                self.per_sequence = drgrpo_advantages(self.scores, seqs.group_index)
            else:
                self.per_sequence = rloo_advantages(self.scores, seqs.group_index, singleton=cfg.rloo_singleton)
        elif est == "gae" and cfg.adv_norm is not None:
            self.norm = StreamingNormalization(cfg.adv_norm, seqs.batch_index, seqs.group_index)
        elif est == "reinforce_pp":
            self.norm = StreamingWhiten(seqs.batch_index, eps=float(cfg.eps))

    def columns(self) -> set[str]:
        """Token columns the recomputation reads (besides the per-sequence ones already collected)."""
        if self.cfg.estimator == "gae" and self.cfg.kl_ctl != 0:
            return {"loss_mask", "old_logp", "ref_logp"}
        return {"loss_mask"}

    def raw(self, batch: TokenBatch, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(un-normalised token advantages, their mask) in the estimator's own alignment."""
        cfg, cu = self.cfg, batch.cu_seqlens
        mask = batch.loss_mask
        if cfg.estimator == "reinforce_pp":
            token_rewards = outcome_to_token_rewards(self.scores[idx], mask, cu_seqlens=cu)
            _, returns = reinforce_pp_advantages(token_rewards, mask, gamma=cfg.discount, cu_seqlens=cu)
            return returns.to(_F64), mask
        old, ref = batch.old_logp, batch.ref_logp
        if cfg.alignment == "token":  # AReaL works on next-token-aligned tensors; the dump is token-aligned
            mask = roll_to_next_token(mask, cu_seqlens=cu)
            old = None if old is None else roll_to_next_token(old, cu_seqlens=cu)
            ref = None if ref is None else roll_to_next_token(ref, cu_seqlens=cu)
        no_eos = self.no_eos[idx]
        tot_rewards, _ = kl_regularized_rewards(
            self.scores[idx],
            old,
            ref,
            mask,
            kl_ctl=cfg.kl_ctl,
            kl_estimator=cfg.kl_estimator,
            cu_seqlens=cu,
            no_eos=no_eos,
            mask_no_eos_with_zero=cfg.mask_no_eos_with_zero,
        )
        adv, _ = gae_advantages(
            tot_rewards.to(_F64), None, mask, discount=cfg.discount, gae_lambda=cfg.gae_lambda, no_eos=no_eos,
            cu_seqlens=cu,
        )
        return adv, mask

    def update_first(self, batch: TokenBatch, idx: Tensor) -> None:
        if self.norm is None or not _needs_first(self.norm):
            return
        values, mask = self.raw(batch, idx)
        self.norm.update_mean(values, mask, idx, batch.cu_seqlens)

    def update_second(self, batch: TokenBatch, idx: Tensor) -> None:
        if self.norm is None or not _needs_second(self.norm):
            return
        values, mask = self.raw(batch, idx)
        if isinstance(self.norm, StreamingWhiten):
            self.norm.update_var(values, mask, idx, batch.cu_seqlens)
        else:
            self.norm.update_std(values, mask, idx, batch.cu_seqlens)

    def passes(self) -> int:
        """Token passes before the final one (0, 1 or 2)."""
        if self.norm is None:
            return 0
        return int(_needs_first(self.norm)) + int(_needs_second(self.norm))

    def expected(self, batch: TokenBatch, idx: Tensor) -> Tensor:
        """``[N]`` float64 recomputed advantages of the batch, token-aligned like the dump's columns."""
        cu = batch.cu_seqlens
        if self.per_sequence is not None:  # verl: scores.unsqueeze(-1) * response_mask
            seq = segment_ids(cu, batch.n_tokens)
            return torch.where(batch.loss_mask, self.per_sequence[idx].to(_F64)[seq], 0.0)
        values, mask = self.raw(batch, idx)
        if self.norm is not None:
            values = self.norm.apply(values, mask, idx, cu)
        if self.cfg.estimator == "gae" and self.cfg.alignment == "token":
            values = unroll_next_token(values, cu, 0.0)
        return values


def _needs_first(norm: StreamingNormalization | StreamingWhiten) -> bool:
    return norm.needs_mean_pass if isinstance(norm, StreamingNormalization) else True


def _needs_second(norm: StreamingNormalization | StreamingWhiten) -> bool:
    return norm.needs_std_pass if isinstance(norm, StreamingNormalization) else True


# ----------------------------------------------------------------------------------------------------
# --write
# ----------------------------------------------------------------------------------------------------


class _RowSource:
    """Rows ``[start, stop)`` of one Parquet file, row groups read lazily and dropped once passed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = pq.ParquetFile(path, memory_map=True)
        self.tables: list[tuple[int, pa.Table]] = []  # (first row, row group) still needed
        self.next_group = 0
        self.next_row = 0

    def rows(self, start: int, stop: int) -> pa.Table:
        self.tables = [(first, t) for first, t in self.tables if first + t.num_rows > start]
        while self.next_row < stop:
            table = self.file.read_row_group(self.next_group)
            self.tables.append((self.next_row, table))
            self.next_row += table.num_rows
            self.next_group += 1
        first = self.tables[0][0]
        table = pa.concat_tables([t for _, t in self.tables]) if len(self.tables) > 1 else self.tables[0][1]
        return table.slice(start - first, stop - start)


class _Writer:
    """Writes every input row, in order, to one Parquet file with the recomputed ``advantages`` column."""

    def __init__(self, out: Path, dataset: RolloutDataset, column: str, cfg: AdvantageCheckConfig) -> None:
        self.out, self.dataset, self.column = out, dataset, column
        self.tmp = out.with_name(out.name + ".tmp")
        self.sources: dict[int, _RowSource] = {}
        self.writer: pq.ParquetWriter | None = None
        self.schema: pa.Schema | None = None
        first = pq.read_schema(dataset.files[0])
        index = first.get_field_index(column)
        old_type = first.field(index).type if index >= 0 else None
        inner = old_type.value_type if old_type is not None and pa.types.is_list(old_type) else old_type
        self.value_type = pa.float64() if inner is not None and pa.types.is_float64(inner) else pa.float32()
        per_token_column = dataset.layout is Layout.TOKEN_PER_ROW or (
            old_type is not None and (pa.types.is_list(old_type) or pa.types.is_large_list(old_type))
        )
        self.per_token = per_token_column or cfg.estimator not in PER_SEQUENCE_ESTIMATORS
        self.metadata = {b"grpo_cli.advantages": json.dumps(cfg.to_json()).encode()}

    def write(self, batch: TokenBatch, expected: Tensor, per_sequence: Tensor | None) -> None:
        source = self.sources.get(batch.file_index)
        if source is None:
            source = self.sources[batch.file_index] = _RowSource(self.dataset.files[batch.file_index])
        rows = batch.rows.cpu()
        start = int(rows[0]) if rows.numel() else 0
        if self.dataset.layout is Layout.TOKEN_PER_ROW:
            stop = start + batch.n_tokens
        else:
            stop = int(rows[-1]) + 1 if rows.numel() else start
        table = source.rows(start, stop)
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
        index = table.schema.get_field_index(self.column)
        if index >= 0:
            table = table.set_column(index, pa.field(self.column, array.type), array)
        else:
            table = table.append_column(pa.field(self.column, array.type), array)
        if self.writer is None:
            metadata = dict(table.schema.metadata or {})
            metadata.update(self.metadata)
            self.schema = table.schema.with_metadata(metadata)
            try:
                self.writer = pq.ParquetWriter(self.tmp, self.schema)
            except OSError as exc:
                raise UsageError(f"--write {self.out}: cannot write ({exc.strerror or exc})") from None
        assert self.schema is not None
        try:
            table = table.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InputError(
                f"--write: schema differs from the first file's ({exc})", file=str(source.path)
            ) from None
        self.writer.write_table(table)

    def close(self, ok: bool) -> None:
        if self.writer is not None:
            self.writer.close()
        if ok and self.writer is not None:
            os.replace(self.tmp, self.out)
        elif self.tmp.exists():
            self.tmp.unlink()


# ----------------------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------------------


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


def _require(dataset: RolloutDataset, cfg: AdvantageCheckConfig, write: Path | None) -> None:
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
    dataset: RolloutDataset, cfg: AdvantageCheckConfig, *, write: Path | None = None
) -> AdvantageCheckResult:
    """Recompute the advantages of ``dataset`` with ``cfg`` and compare them with its ``advantages`` column.

    Args:
        dataset: the dump (read without transforms: ``--write`` copies its rows as stored).
        cfg: the estimator and its options (validated here).
        write: also write the dump with the recomputed advantages to this Parquet file.

    Returns:
        The ``adv_check/*`` figures (:func:`~grpo_cli.core.adv_check.adv_diff_compute`), with the reasons for any
        omitted ones.
    """
    cfg.validate()
    if write is not None:
        out = write.resolve()
        if any(out == path.resolve() for path in dataset.files):
            raise UsageError(f"--write {write}: is one of the inputs")
    _require(dataset, cfg, write)
    batch_by = _resolve_batch_by(dataset, cfg)
    device = torch.device(cfg.device)
    seqs = _collect_sequences(dataset, cfg, batch_by)
    recompute = _Recompute(seqs, cfg)
    token_columns = recompute.columns()

    def stream(columns: set[str]) -> Iterator[tuple[TokenBatch, Tensor]]:
        start = 0
        for batch in dataset.iter_batches(columns=columns, batch_tokens=cfg.batch_tokens):
            batch = batch.to(device)
            idx = torch.arange(start, start + batch.n_sequences, device=device)
            start += batch.n_sequences
            # The stream is deterministic; a dump that changes under us would silently misalign sequences.
            if not (bool((seqs.file_index[idx] == batch.file_index).all()) and torch.equal(seqs.rows[idx], batch.rows)):
                raise InputError("the dump changed while it was being read", file=str(dataset.files[batch.file_index]))
            yield batch, idx

    if recompute.passes() >= 1:
        for batch, idx in stream(token_columns):
            recompute.update_first(batch, idx)
    if recompute.passes() == 2:
        for batch, idx in stream(token_columns):
            recompute.update_second(batch, idx)

    has_adv = "advantages" in dataset.columns
    per_token_column = has_adv and _per_token_advantages(dataset)
    state = adv_diff_state(cfg.top_k, device)
    writer = None if write is None else _Writer(write, dataset, dataset.column_map.get("advantages", "advantages"),
                                                cfg)
    ok = False
    try:
        final_columns = token_columns | ({"advantages"} if has_adv else set())
        for batch, idx in stream(final_columns):
            expected = recompute.expected(batch, idx)
            if has_adv:
                assert batch.advantages is not None
                compare = batch.loss_mask if (cfg.valid_only or not per_token_column) else torch.ones_like(
                    batch.loss_mask
                )
                adv_diff_update(
                    state,
                    expected=expected,
                    dumped=batch.advantages,
                    compare=compare,
                    loss_mask=batch.loss_mask,
                    cu_seqlens=batch.cu_seqlens,
                    sequence_keys=batch.sequence_keys(),
                    group_id=None if seqs.group_id is None else seqs.group_id[idx],
                    step=None if seqs.batch_key is None else seqs.batch_key[idx],
                    atol=cfg.atol,
                    rtol=cfg.rtol,
                )
            if writer is not None:
                per_seq = None if recompute.per_sequence is None else recompute.per_sequence[idx]
                writer.write(batch, expected, per_seq)
        ok = True
    finally:
        if writer is not None:
            writer.close(ok)
    metrics: dict[str, Any] = {}
    omitted: dict[str, str] = {}
    if has_adv:
        metrics = adv_diff_compute(state)
        if "adv_check/max_abs_diff" not in metrics:
            omitted["adv_check/max_abs_diff"] = "no token was compared (no valid tokens)"
    else:
        omitted["adv_check/*"] = "the dump has no 'advantages' column (recomputed values were written only)"
    config = cfg.to_json()
    config["batch_by"] = batch_by
    config["compared"] = "valid tokens" if (cfg.valid_only or not per_token_column) else "all tokens"
    return AdvantageCheckResult(
        metrics=metrics,
        omitted=omitted,
        inputs=[str(p) for p in dataset.files],
        config=config,
        columns=sorted(dataset.columns),
        written=None if write is None else str(write),
    )


def _per_token_advantages(dataset: RolloutDataset) -> bool:
    """Whether the dump stores one advantage per token (a list column, or any token-per-row file)."""
    if dataset.layout is Layout.TOKEN_PER_ROW:
        return True
    name = dataset.column_map.get("advantages", "advantages")
    schema = pq.read_schema(dataset.files[0])
    dtype = schema.field(schema.get_field_index(name)).type
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)

