"""Orchestration: stream a dump once, feed every metric group's state, compute the figures.

A :class:`MetricGroup` owns a :class:`~grpo_cli.core.state.MetricState` and calls core functions on each batch;
the groups never do I/O and the reader never computes a figure. Because states merge exactly, the same code serves
one process, ``--workers`` shards and ``torchrun`` ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.policy_stats import policy_stats_compute, policy_stats_state, policy_stats_update
from grpo_cli.core.state import MetricState, count
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset, Shard
from grpo_cli.io.schema import COLUMNS, ColumnKind

GROUP_BY_COLUMNS = tuple(name for name, spec in COLUMNS.items() if spec.kind is ColumnKind.SEQUENCE_INT)
"""Per-sequence integer columns ``--group-by`` accepts."""

__all__ = [
    "GROUP_BY_COLUMNS",
    "Accumulator",
    "AnalysisResult",
    "AnalyzeConfig",
    "MetricGroup",
    "accumulate_states",
    "analyze",
    "default_groups",
    "finalize",
]


@dataclass
class AnalyzeConfig:
    """Every option that changes a figure (reported in the JSON ``config``)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0
    top_k: int = 10
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"
    group_by: str | None = None
    max_groups: int = 100_000

    def validate(self) -> None:
        if not self.epsilon >= 0:
            raise UsageError(f"--epsilon must be >= 0, got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high >= 0:
            raise UsageError(f"--epsilon-high must be >= 0, got {self.epsilon_high}")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        if self.group_by is not None and self.group_by not in GROUP_BY_COLUMNS:
            raise UsageError(f"--group-by must be one of {', '.join(GROUP_BY_COLUMNS)}, got '{self.group_by}'")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("device")  # where it ran does not change a figure
        out.pop("batch_tokens")
        out.pop("max_groups")
        out["epsilon_high"] = self.eps_high
        return out


class MetricGroup(Protocol):
    """A family of figures computed from one mergeable state."""

    name: str

    def columns(self) -> frozenset[str]:
        """Canonical columns this group reads when present."""
        ...

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        """Keys this group cannot report for a dump with ``columns``, each with the reason."""
        ...

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState: ...

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        """Fold one batch (``valid`` = its loss-mask tokens) into ``state``."""
        ...

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]: ...


class CountsGroup:
    """``n_sequences`` and ``n_tokens`` (all tokens, masked or not)."""

    name = "counts"

    def columns(self) -> frozenset[str]:
        return frozenset()

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        return {}

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return MetricState({"n_sequences": count(), "n_tokens": count()}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        state.update(n_sequences=torch.tensor(batch.n_sequences), n_tokens=torch.tensor(batch.n_tokens))

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return {"n_sequences": int(state["n_sequences"]), "n_tokens": int(state["n_tokens"])}


_NEEDS_OLD = ("logp/old_mean", "logp/diff_mean", "kl/k3", "kl/k3_token_max", "top_kl")
_NEEDS_RATIO = ("ratio/max", "clip/cispo", "clip/cispo_low", "clip/cispo_high")
_NEEDS_ADV = ("clip/ratio", "clip/low", "clip/high", "clip/seq_ratio", "clip/seq_low", "clip/seq_high")


class PolicyGroup:
    """The GRPOMetric family (``core.policy_stats``): log-prob means, k3 KL, ratio maximum, clip fractions.

    ``kl/*`` compares ``new_logp`` with ``old_logp``; ``ratio/*`` and ``clip/*`` use the PPO ratio against
    ``prox_logp`` when the dump has it (decoupled PPO), else against ``old_logp``.
    """

    name = "policy"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "advantages", "entropy"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "entropy" not in columns:
            out["entropy/mean"] = "needs an 'entropy' column"
        if "old_logp" not in columns:
            out.update(dict.fromkeys(_NEEDS_OLD, "needs an 'old_logp' column"))
        if not {"old_logp", "prox_logp"} & columns:
            out.update(dict.fromkeys(_NEEDS_RATIO + _NEEDS_ADV, "needs 'old_logp' or 'prox_logp'"))
        elif "advantages" not in columns:
            out.update(dict.fromkeys(_NEEDS_ADV, "needs an 'advantages' column"))
        if config.top_k == 0:
            out.setdefault("top_kl", "disabled with --top-k 0")
        return out

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return policy_stats_state(config.top_k, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        policy_stats_update(
            state,
            new_logp=valid.new_logp,
            cu_seqlens=valid.cu_seqlens,
            old_logp=valid.old_logp,
            ratio_base_logp=valid.prox_logp if valid.prox_logp is not None else valid.old_logp,
            advantages=valid.advantages,
            entropy=valid.entropy,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            temperature=config.temperature,
            sequence_keys=valid.sequence_keys(),
            positions=valid.positions,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return policy_stats_compute(state)


def default_groups() -> list[MetricGroup]:
    """The metric groups ``analyze`` runs, in report order."""
    return [CountsGroup(), PolicyGroup()]


@dataclass
class AnalysisResult:
    """What every output format renders."""

    metrics: dict[str, Any]
    omitted: dict[str, str]
    inputs: list[str]
    config: dict[str, Any]
    columns: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    """With ``group_by``: ``[{"key": value, "metrics": {...}}, ...]`` in ascending key order."""


@dataclass
class Accumulator:
    """One state per metric group for the whole dump, and (with ``group_by``) one set per key value."""

    overall: list[MetricState]
    by_key: dict[int, list[MetricState]] = field(default_factory=dict)

    def merge_(self, other: Accumulator) -> Accumulator:
        for mine, theirs in zip(self.overall, other.overall):
            mine.merge_(theirs)
        for key, states in other.by_key.items():
            if key in self.by_key:
                for mine, theirs in zip(self.by_key[key], states):
                    mine.merge_(theirs)
            else:
                self.by_key[key] = [state.clone() for state in states]
        return self


def _update_all(
    groups: Sequence[MetricGroup], states: list[MetricState], batch: TokenBatch, config: AnalyzeConfig
) -> None:
    valid = batch.valid()
    for group, state in zip(groups, states):
        group.update(state, batch, valid, config)


def accumulate_states(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    groups: Sequence[MetricGroup],
    *,
    shards: Sequence[Shard] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Accumulator:
    """Stream ``shards`` (default: all) once, updating one state per metric group (and per ``group_by`` key)."""
    device = torch.device(config.device)
    acc = Accumulator([group.init_state(config, device) for group in groups])
    wanted: set[str] = {"loss_mask"}
    for group in groups:
        wanted |= group.columns()
    if config.group_by is not None:
        if config.group_by not in dataset.columns:
            raise UsageError(f"--group-by {config.group_by}: the dump has no '{config.group_by}' column")
        wanted.add(config.group_by)
    for batch in dataset.iter_batches(columns=wanted, batch_tokens=config.batch_tokens, shards=shards):
        if batch.device != device:
            batch = batch.to(device, non_blocking=True)
        _update_all(groups, acc.overall, batch, config)
        if config.group_by is not None:
            keys = getattr(batch, config.group_by)
            for key in torch.unique(keys).tolist():
                if key not in acc.by_key:
                    if len(acc.by_key) >= config.max_groups:
                        raise UsageError(
                            f"--group-by {config.group_by}: more than {config.max_groups} distinct values"
                        )
                    acc.by_key[key] = [group.init_state(config, device) for group in groups]
                _update_all(groups, acc.by_key[key], batch.select_sequences(keys == key), config)
        if progress is not None:
            progress(batch.n_tokens)
    return acc


def _figures(
    dataset: RolloutDataset, config: AnalyzeConfig, groups: Sequence[MetricGroup], states: Sequence[MetricState]
) -> tuple[dict[str, Any], dict[str, str]]:
    metrics: dict[str, Any] = {}
    omitted: dict[str, str] = {}
    for group, state in zip(groups, states):
        figures = group.compute(state, config)
        reasons = group.omitted(dataset.columns, config)
        metrics.update({k: v for k, v in figures.items() if k not in reasons})
        omitted.update(reasons)
    if metrics.get("n_valid_tokens", 0) == 0:
        omitted.update({k: "no valid tokens (loss_mask is 0 everywhere)" for k in list(metrics) if "/" in k})
        metrics = {k: v for k, v in metrics.items() if "/" not in k}
    return metrics, omitted


def finalize(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    groups: Sequence[MetricGroup],
    acc: Accumulator,
) -> AnalysisResult:
    """Compute every group's figures from merged states and collect the omitted keys with reasons."""
    metrics, omitted = _figures(dataset, config, groups, acc.overall)
    by_key = [
        {"key": key, "metrics": _figures(dataset, config, groups, acc.by_key[key])[0]} for key in sorted(acc.by_key)
    ]
    return AnalysisResult(
        metrics=metrics,
        omitted=omitted,
        inputs=[str(p) for p in dataset.files],
        config=config.to_json(),
        columns=sorted(dataset.columns),
        groups=by_key,
    )


def analyze(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    *,
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
) -> AnalysisResult:
    """Run every metric group over the whole dataset in one streaming pass."""
    config.validate()
    groups = default_groups() if groups is None else list(groups)
    acc = accumulate_states(dataset, config, groups, progress=progress)
    return finalize(dataset, config, groups, acc)
