"""The single-process streaming fold: decode a dump's batches once, validate each, and update every metric group's
state (in the calling thread or in metric threads). :mod:`grpo_cli.engine.parallel` runs it per unit of the dump."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import cast

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.state import MetricState
from grpo_cli.engine.blocks import block_keys
from grpo_cli.engine.config import StreamConfig, coded_group_by
from grpo_cli.engine.group import Accumulator, MetricGroup, per_key
from grpo_cli.engine.stream import streamed
from grpo_cli.engine.validate import BatchValidator, ValidationGroup
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import RolloutDataset, Shard

__all__ = ["accumulate_states"]


BATCHES_IN_FLIGHT = 2
"""Batches whose metric updates may be queued at once with ``threads`` > 1 (each holds its tensors until done)."""

PROBE_BATCHES = 2
"""Batches run in the calling thread, timed per group, before the metric threads start."""

MIN_THREAD_SPEEDUP = 1.5
"""Metric threads are kept only if the groups' times on the last probe batch allow at least this speed-up (their
sum over the longest one)."""

MIN_MEASURED_SPEEDUP = 1.1
"""...and only if the first batch run in the threads then took at most 1 / this of the probe batches' time per token
(:func:`threads_paid_off`): work of many small ops (``--group-by`` with many keys) is bound by the interpreter lock,
and threads handing it over to each other are slower than one."""


def threads_paid_off(probe_seconds_per_token: Sequence[float], threaded_seconds_per_token: float) -> bool:
    """Whether the batch timed in the metric threads was at least :data:`MIN_MEASURED_SPEEDUP` times faster per token
    than the fastest probe batch run in the caller (the fastest: the first pays one-time costs, and a shared
    machine only ever slows a batch down)."""
    return threaded_seconds_per_token * MIN_MEASURED_SPEEDUP <= min(probe_seconds_per_token)


Update = tuple[MetricState, TokenBatch, TokenBatch]
"""One group update: the state, the batch (or a key's sub-batch) and its valid view."""


class _GroupRunner:
    """Runs each group's updates of a batch: in the caller's thread, or spread over ``threads`` threads.

    Each group owns its states, so a batch's groups are independent tasks; a task is one group's updates of the
    batch: the whole batch's, or (for a ``--group-by`` slot) every key's sub-batch in turn. With threads, the caller
    hands a batch over and moves on to validating the next one (decoded meanwhile by the prefetch thread) while they
    compute; at most :data:`BATCHES_IN_FLIGHT` batches are handed over at a time (memory stays bounded). A task first
    waits for the same slot's task on the previous batch, so every state still sees the batches in order, and no
    figure depends on ``threads`` (torch computes each op on the calling thread, with one intra-op thread per
    process). torch releases the GIL inside its kernels, so the threads run in parallel. The first
    :data:`PROBE_BATCHES` batches run in the caller, timed per slot; after them, a batch's tasks start in decreasing
    order of the time each slot has taken so far (longest first balances the threads without a hand-kept cost
    table), or, if one slot dominates (:data:`MIN_THREAD_SPEEDUP`) or the first threaded batch was not faster
    (:data:`MIN_MEASURED_SPEEDUP`), every batch runs in the caller.
    """

    def __init__(self, threads: int, n_slots: int) -> None:
        threads = min(threads, n_slots)  # more would idle
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grpo-cli-metrics") if threads > 1 else None
        self.seconds: dict[int, float] = {}
        self.probed = 0
        self.probe_seconds_per_token: list[float] = []  # each probe batch's, in the caller
        self.in_flight: deque[list[Future[None]]] = deque()
        self.last: dict[int, Future[None]] = {}  # slot -> its latest task

    def __enter__(self) -> _GroupRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def update(self, tasks: Sequence[tuple[MetricGroup, Sequence[Update]]], config: StreamConfig, tokens: int) -> None:
        """Run one batch's ``tasks`` (task ``i`` is slot ``i``: a group and its updates, done in order) now (one
        thread), or queue them (threads: see :meth:`finish`); the batch holds ``tokens`` tokens."""

        def run(index: int) -> None:
            group, updates = tasks[index]
            for state, batch, valid in updates:
                group.update(state, batch, valid, config)

        if self.pool is None:
            for index in range(len(tasks)):
                run(index)
            return
        if self.probed < PROBE_BATCHES:
            # The first batches run here, timed slot by slot (the last one counts: the first pays one-time
            # costs); the threads stay only if the work can be spread, not when one slot dominates.
            for index in range(len(tasks)):
                start = time.perf_counter()
                run(index)
                self.seconds[index] = time.perf_counter() - start
            self.probed += 1
            self.probe_seconds_per_token.append(sum(self.seconds.values()) / max(tokens, 1))
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
            run(index)
            self.seconds[index] = self.seconds.get(index, 0.0) + time.perf_counter() - start

        futures: list[Future[None]] = [None] * len(tasks)  # type: ignore[list-item]  # every slot filled below
        start = time.perf_counter()
        for i in sorted(range(len(tasks)), key=lambda i: -self.seconds.get(i, 0.0)):
            futures[i] = self.pool.submit(task, i, self.last.get(i))
            self.last[i] = futures[i]
        self.in_flight.append(futures)
        if self.probed == PROBE_BATCHES:
            # The first threaded batch is waited for and timed against the probe batches.
            self.probed += 1
            self.finish()
            if not threads_paid_off(self.probe_seconds_per_token, (time.perf_counter() - start) / max(tokens, 1)):
                self.pool.shutdown()
                self.pool = None

    def finish(self) -> None:
        """Wait for every queued update; raise the first failure in batch and slot order."""
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        futures = self.in_flight.popleft()
        wait(futures)
        for future in futures:
            future.result()


def accumulate_states(
    dataset: RolloutDataset,
    config: StreamConfig,
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
    coded = coded_group_by(config.group_by)
    if config.group_by is not None and not coded:
        if config.group_by not in dataset.columns:
            raise UsageError(f"--group-by {config.group_by}: the dump has no '{config.group_by}' column")
        wanted.add(config.group_by)
    if _blocks(config) and "group_id" in dataset.columns:
        wanted.add("group_id")  # block_keys keeps a prompt's group in one block
    # Validation sits between the reader and every group (io/validate.py): it sees the raw loss-mask values, and
    # under --on-invalid skip it drops sequences before any figure (or group_by key) sees them.
    validator = BatchValidator.for_dataset(dataset, config.on_invalid, config.current_version)
    skip_counts = next((s for g, s in zip(groups, acc.overall) if isinstance(g, ValidationGroup)), None)
    batches = dataset.iter_batches(columns=wanted, batch_tokens=config.batch_tokens, shards=shards, raw_mask=True,
                                   group_key=config.group_by if coded else None)
    # Decoding runs ahead in a thread (into pinned memory for CUDA) while the groups compute (grpo_cli.engine.stream).
    slots = len(groups) + (len(per_key(groups)) if _keyed(config) else 0)
    with _GroupRunner(threads, slots) as runner:
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
    config: StreamConfig,
    device: torch.device,
    validator: BatchValidator,
    skip_counts: MetricState | None,
    runner: _GroupRunner,
) -> None:
    if batch.device != device:
        batch = batch.to(device, non_blocking=True)
    batch = validator(batch, skip_counts)
    valid = batch.valid()
    tasks: list[tuple[MetricGroup, Sequence[Update]]] = [
        (group, [(state, batch, valid)]) for group, state in zip(groups, acc.overall)]
    if _keyed(config):
        if blocks := _blocks(config):
            keys = block_keys(batch, blocks)
        elif coded_group_by(config.group_by):
            keys = cast(Tensor, batch.group_key)  # the reader fills it for a coded --group-by column
        else:
            keys = getattr(batch, cast(str, config.group_by))  # not None: the caller checked group_by
        keyed = per_key(groups)
        parts = _key_parts(acc, keyed, batch, keys, config, device)
        # One task per keyed group runs every key of the batch: a task per key and group would cost more in
        # hand-overs between threads than the few hundred small ops of a key's update.
        tasks += [(group, [(states[slot], part, valid) for states, part, valid in parts])
                  for slot, group in enumerate(keyed)]
    runner.update(tasks, config, batch.n_tokens)


def _key_parts(
    acc: Accumulator, keyed: Sequence[MetricGroup], batch: TokenBatch, keys: Tensor, config: StreamConfig,
    device: torch.device,
) -> list[tuple[list[MetricState], TokenBatch, TokenBatch]]:
    """Each key's states (created at its first sequence), sub-batch and its valid view, in key order."""
    # One gather puts each key's sequences together (none when the dump is written key by key, as steps are); every
    # key's sub-batch is then a run of views, and its valid view a run of the sorted batch's.
    if bool((keys[1:] < keys[:-1]).any()):
        order = torch.argsort(keys, stable=True)
        batch, keys = batch.select_sequences(order), keys.index_select(0, order)
    values, counts = torch.unique_consecutive(keys, return_counts=True)
    parts = []
    start = 0
    for key, count in zip(values.tolist(), counts.tolist()):
        if key not in acc.by_key:
            if len(acc.by_key) >= config.max_groups:
                raise UsageError(f"--group-by {config.group_by}: more than {config.max_groups} distinct values")
            acc.by_key[key] = [group.init_state(config, device) for group in keyed]
        part = batch.sequence_range(start, start + count)
        parts.append((acc.by_key[key], part, part.valid()))
        start += count
    return parts


def _keyed(config: StreamConfig) -> bool:
    """Whether states are also kept per key: per ``--group-by`` value or per hash block."""
    return config.group_by is not None or bool(_blocks(config))


def _blocks(config: StreamConfig) -> int:
    # A config with ``hash_blocks`` > 0 (``diff``'s) splits by a hash block per sequence instead of ``group_by``
    # (grpo_cli.engine.blocks); the other commands' configs have no such field.
    return int(getattr(config, "hash_blocks", 0) or 0)
