"""Orchestration: stream a dump once, feed every metric group's state, compute the figures.

A :class:`MetricGroup` owns a :class:`~grpo_cli.core.state.MetricState` and calls core functions on each batch;
the groups never do I/O and the reader never computes a figure. Because states merge exactly, the same code serves
one process, ``--workers`` shards and ``torchrun`` ranks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from grpo_cli.areal_groups import ActorStatsGroup
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.histogram import QUANTILE_REL_ERROR
from grpo_cli.core.policy_stats import policy_stats_compute, policy_stats_state, policy_stats_update
from grpo_cli.core.staleness import MAX_LAG
from grpo_cli.core.state import MetricState, count
from grpo_cli.distill_groups import DistillGroup
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset, Shard
from grpo_cli.io.schema import COLUMNS, ColumnKind
from grpo_cli.io.validate import BatchValidator, OnInvalid, ValidationGroup, require_data
from grpo_cli.loss_groups import LOSS_NAMES, LossGroup
from grpo_cli.offpolicy_groups import offpolicy_groups
from grpo_cli.options import PPOOptions, check_finite
from grpo_cli.streaming import streamed

GROUP_BY_COLUMNS = tuple(name for name, spec in COLUMNS.items() if spec.kind is ColumnKind.SEQUENCE_INT)
"""Per-sequence integer columns ``--group-by`` accepts."""

__all__ = [
    "GROUP_BY_COLUMNS",
    "Accumulator",
    "AnalysisResult",
    "AnalyzeConfig",
    "MetricGroup",
    "StreamOptions",
    "accumulate_states",
    "analyze",
    "default_groups",
    "finalize",
]


@dataclass
class AnalyzeConfig(PPOOptions):
    """Every option that changes a figure (reported in the JSON ``config``).

    Besides :class:`~grpo_cli.options.PPOOptions` (clip widths, dual clip, importance level, rejection sampling):
    ``losses`` selects the ``loss/*`` figures (``None``: all the data allows); ``beta``, ``tau_pos``, ``tau_neg`` and
    ``max_completion_length`` are the GRPO-family loss objects' parameters (``docs/losses.md``).
    """

    temperature: float = 1.0
    top_k: int = 10
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"
    group_by: str | None = None
    max_groups: int = 100_000
    losses: tuple[str, ...] | None = None
    beta: float = 0.0
    tau_pos: float = 1.0
    tau_neg: float | None = None
    max_completion_length: int = 1024
    on_invalid: str = "error"
    kl_clamp: float | None = None
    is_threshold: float = 2.0
    m2_threshold: float | None = None
    current_version: int | None = None
    distill_weight: float = 0.005
    rl_weight: float = 1.0
    max_new_tokens: int | None = None

    def validate(self) -> None:
        self.validate_ppo()
        if self.kl_clamp is not None:
            check_finite(self.kl_clamp, "--kl-clamp", above=0)
        check_finite(self.is_threshold, "--is-threshold", minimum=1)
        if self.m2_threshold is not None:
            check_finite(self.m2_threshold, "--m2-threshold")
        if self.on_invalid not in tuple(OnInvalid):
            raise UsageError(f"--on-invalid must be 'error' or 'skip', got '{self.on_invalid}'")
        check_finite(self.beta, "--beta", minimum=0)
        check_finite(self.distill_weight, "--distill-weight", minimum=0)
        check_finite(self.rl_weight, "--rl-weight", minimum=0)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        check_finite(self.tau_pos, "--tau-pos", above=0)
        if self.tau_neg is not None:
            check_finite(self.tau_neg, "--tau-neg", above=0)
        if self.max_completion_length < 1:
            raise UsageError(f"--max-completion-length must be >= 1, got {self.max_completion_length}")
        if self.losses is not None:
            unknown = [name for name in self.losses if name not in LOSS_NAMES]
            if unknown:
                raise UsageError(f"--loss: unknown {', '.join(unknown)} (choose from {', '.join(LOSS_NAMES)})")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be >= 1, got {self.batch_tokens}")
        if self.group_by is not None and self.group_by not in GROUP_BY_COLUMNS:
            raise UsageError(f"--group-by must be one of {', '.join(GROUP_BY_COLUMNS)}, got '{self.group_by}'")

    def to_json(self) -> dict[str, Any]:
        out = self.ppo_json(asdict(self))
        out.pop("device")  # where it ran does not change a figure
        out.pop("batch_tokens")
        out.pop("max_groups")
        out["losses"] = list(LOSS_NAMES if self.losses is None else self.losses)
        out["tau_neg"] = self.tau_pos if self.tau_neg is None else self.tau_neg
        # How the off-policy figures are binned (grpo_cli.core.histogram / .staleness), not options.
        out["quantile_rel_error"] = QUANTILE_REL_ERROR
        out["staleness_max_lag"] = MAX_LAG
        return out


class StreamOptions(Protocol):
    """What the streaming pass itself reads from a command's config (``AnalyzeConfig``, ``CompareProxConfig``):
    where and in what batches to compute, the validation policy, and the optional ``--group-by`` split."""

    device: str
    batch_tokens: int
    on_invalid: str
    current_version: int | None
    group_by: str | None
    max_groups: int


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
    return [
        ValidationGroup(), CountsGroup(), PolicyGroup(), LossGroup(), *offpolicy_groups(), DistillGroup(),
        ActorStatsGroup(),
    ]


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


BATCHES_IN_FLIGHT = 2
"""Batches whose metric updates may be queued at once with ``threads`` > 1 (each holds its tensors until done)."""

PROBE_BATCHES = 2
"""Batches run in the calling thread, timed per group, before the metric threads start."""

MIN_THREAD_SPEEDUP = 1.5
"""Metric threads are kept only if the groups' times on the last probe batch allow at least this speed-up (their
sum over the longest one)."""


class _GroupRunner:
    """Runs every group's ``update`` on each batch: in the caller's thread, or spread over ``threads`` threads.

    Each group owns its state, so a batch's groups are independent tasks. With threads, the caller hands a batch
    over and moves on to validating the next one (decoded meanwhile by the prefetch thread) while they compute; at most
    :data:`BATCHES_IN_FLIGHT` batches are handed over at a time (memory stays bounded). A task first waits for the
    same state's task on the previous batch, so every state still sees the batches in order, and no figure depends
    on ``threads`` (torch computes each op on the calling thread, with one intra-op thread per process). torch
    releases the GIL inside its kernels, so the threads run in parallel. The first :data:`PROBE_BATCHES` batches
    run in the caller, timed per group; after them, a batch's tasks start in decreasing order of the time each group
    has taken so far (longest first balances the threads without a hand-kept cost table), or, if one group
    dominates (:data:`MIN_THREAD_SPEEDUP`), every batch runs in the caller.
    """

    def __init__(self, threads: int, n_groups: int) -> None:
        threads = min(threads, n_groups)  # more would idle
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grpo-cli-metrics") if threads > 1 else None
        self.seconds: dict[int, float] = {}
        self.probed = 0
        self.in_flight: deque[list[Future[None]]] = deque()
        self.last: dict[int, Future[None]] = {}  # id(state) -> its latest task

    def __enter__(self) -> _GroupRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def update(
        self, groups: Sequence[MetricGroup], states: list[MetricState], batch: TokenBatch, config: StreamOptions
    ) -> None:
        """Update ``states`` with ``batch`` now (one thread), or queue the updates (threads: see :meth:`finish`)."""
        valid = batch.valid()
        if self.pool is None:
            for group, state in zip(groups, states):
                group.update(state, batch, valid, config)  # type: ignore[arg-type]
            return
        if self.probed < PROBE_BATCHES:
            # The first batches run here, timed group by group (the last one counts: the first pays one-time
            # costs); the threads stay only if the work can be spread, not when one group dominates.
            for i, (group, state) in enumerate(zip(groups, states)):
                start = time.perf_counter()
                group.update(state, batch, valid, config)  # type: ignore[arg-type]
                self.seconds[i] = time.perf_counter() - start
            self.probed += 1
            if self.probed == PROBE_BATCHES and (
                sum(self.seconds.values()) < MIN_THREAD_SPEEDUP * max(self.seconds.values(), default=0.0)
            ):
                self.pool.shutdown()
                self.pool = None
            return
        while len(self.in_flight) >= BATCHES_IN_FLIGHT:
            self._finish_oldest()

        def task(index: int, previous: Future[None] | None) -> None:
            if previous is not None:
                previous.result()  # queued before this task (FIFO), so already running or done: no deadlock
            start = time.perf_counter()
            groups[index].update(states[index], batch, valid, config)  # type: ignore[arg-type]
            # (with --group-by two states of one group may race here: that only skews the ordering heuristic)
            self.seconds[index] = self.seconds.get(index, 0.0) + time.perf_counter() - start

        futures: list[Future[None]] = [None] * len(groups)  # type: ignore[list-item]
        for i in sorted(range(len(groups)), key=lambda i: -self.seconds.get(i, 0.0)):
            futures[i] = self.pool.submit(task, i, self.last.get(id(states[i])))
            self.last[id(states[i])] = futures[i]
        self.in_flight.append(futures)

    def finish(self) -> None:
        """Wait for every queued update; raise the first failure in batch and group order."""
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        futures = self.in_flight.popleft()
        wait(futures)
        for future in futures:
            future.result()


def accumulate_states(
    dataset: RolloutDataset,
    config: StreamOptions,
    groups: Sequence[MetricGroup],
    *,
    shards: Sequence[Shard] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int = 1,
) -> Accumulator:
    """Stream ``shards`` (default: all) once, updating one state per metric group (and per ``group_by`` key).

    ``threads`` > 1 runs the groups of each batch in that many threads (:class:`_GroupRunner`); the figures are
    the same bits whatever it is.
    """
    device = torch.device(config.device)
    acc = Accumulator([group.init_state(config, device) for group in groups])
    wanted: set[str] = {"loss_mask"}
    for group in groups:
        wanted |= group.columns()
    if config.group_by is not None:
        if config.group_by not in dataset.columns:
            raise UsageError(f"--group-by {config.group_by}: the dump has no '{config.group_by}' column")
        wanted.add(config.group_by)
    # Validation sits between the reader and every group (io/validate.py): it sees the raw loss-mask values, and
    # under --on-invalid skip it drops sequences before any figure (or group_by key) sees them.
    validator = BatchValidator.for_dataset(dataset, config.on_invalid, config.current_version)
    skip_counts = next((s for g, s in zip(groups, acc.overall) if isinstance(g, ValidationGroup)), None)
    batches = dataset.iter_batches(columns=wanted, batch_tokens=config.batch_tokens, shards=shards, raw_mask=True)
    # Decoding runs ahead in a thread (into pinned memory for CUDA) while the groups compute (grpo_cli.streaming).
    with _GroupRunner(threads, len(groups)) as runner:
        for batch in streamed(batches, device):
            _update_batch(acc, groups, batch, config, device, validator, skip_counts, runner)
            if progress is not None:
                progress(batch.n_tokens)
        runner.finish()
    return acc


def _update_batch(
    acc: Accumulator,
    groups: Sequence[MetricGroup],
    batch: TokenBatch,
    config: StreamOptions,
    device: torch.device,
    validator: BatchValidator,
    skip_counts: MetricState | None,
    runner: _GroupRunner,
) -> None:
    if batch.device != device:
        batch = batch.to(device, non_blocking=True)
    batch = validator(batch, skip_counts)
    runner.update(groups, acc.overall, batch, config)
    if config.group_by is None:
        return
    keys = getattr(batch, config.group_by)
    for key in torch.unique(keys).tolist():
        if key not in acc.by_key:
            if len(acc.by_key) >= config.max_groups:
                raise UsageError(f"--group-by {config.group_by}: more than {config.max_groups} distinct values")
            acc.by_key[key] = [group.init_state(config, device) for group in groups]
        runner.update(groups, acc.by_key[key], batch.select_sequences(keys == key), config)


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
        hidden = [k for k in metrics if "/" in k and not k.startswith("invalid/")]
        omitted.update(dict.fromkeys(hidden, "no valid tokens (loss_mask is 0 everywhere)"))
        metrics = {k: v for k, v in metrics.items() if k not in hidden}
    return metrics, omitted


def finalize(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    groups: Sequence[MetricGroup],
    acc: Accumulator,
) -> AnalysisResult:
    """Compute every group's figures from merged states and collect the omitted keys with reasons."""
    metrics, omitted = _figures(dataset, config, groups, acc.overall)
    require_data(metrics, [str(p) for p in dataset.files])  # zero rows / all skipped / no valid tokens: exit 2
    by_key = [
        {"key": key, "metrics": _without_skip_counts(_figures(dataset, config, groups, acc.by_key[key])[0])}
        for key in sorted(acc.by_key)
    ]
    return AnalysisResult(
        metrics=metrics,
        omitted=omitted,
        inputs=[str(p) for p in dataset.files],
        config=config.to_json(),
        columns=sorted(dataset.columns),
        groups=by_key,
    )


def _without_skip_counts(metrics: dict[str, Any]) -> dict[str, Any]:
    # Sequences are dropped before they are split by key, so skip counts exist for the whole dump only.
    return {k: v for k, v in metrics.items() if not k.startswith("invalid/")}


def analyze(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    *,
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> AnalysisResult:
    """Run every metric group over the whole dataset in one streaming pass.

    ``workers`` processes share the (file, row-group) units of the dump; under ``torchrun`` each rank takes its
    share and the states are all-reduced (:func:`grpo_cli.parallel.accumulate`). No figure depends on either.
    """
    from grpo_cli.parallel import accumulate

    config.validate()
    groups = default_groups() if groups is None else list(groups)
    acc = accumulate(dataset, config, groups, workers=workers, progress=progress)
    return finalize(dataset, config, groups, acc)
