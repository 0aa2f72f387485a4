"""Scale-out: ``--workers`` processes and ``torchrun`` ranks over (file, row-group) units, merged exactly.

The dump is cut into *units*: contiguous runs of whole row groups (:class:`~grpo_cli.io.reader.Shard`) of at least
:data:`UNIT_BATCHES` ``× --batch-tokens`` tokens each, planned from the Parquet metadata alone. Each unit is
streamed into its own :class:`~grpo_cli.engine.group.Accumulator` (the batches are the same whoever reads the unit,
since a batch never crosses a row-group boundary), and the unit accumulators are merged **in unit order** with the
states' own exact merge. The reduction tree therefore depends on the data and ``--batch-tokens`` only, never on
the number of workers: ``--workers 1`` and ``--workers N`` give bitwise-identical figures.

Three ways to run the same units:

- in process (``workers == 1``, or a dump of one unit);
- ``--workers N``: a process pool (``fork`` on Linux for CPU runs, ``spawn`` for CUDA or elsewhere); workers take
  units in order as they become free, so big and small row groups balance themselves;
- ``--executor ray``: every unit is a Ray task on the cluster (:mod:`grpo_cli.engine.ray_executor`), the results
  merged in unit order as the pool's are;
- ``torchrun``: every rank takes a contiguous range of units balanced by byte size, folds it as above, and the
  ranks' states are all-reduced over the default process group (gloo for CPU tensors, NCCL for CUDA).
  ``--group-by`` keys are unioned across ranks first. Float sums then combine in a rank-dependent tree and agree
  with one process to 1e-12 relative (counts, extrema, histograms, quantiles and top-k tables are exact).

On a CPU every process computes with one torch thread (:func:`one_torch_thread`) while Arrow decodes the next
batch on the remaining cores; that is both the fastest setting measured and what keeps float sums independent of
the core count (torch splits a reduction by thread).

Example:
    >>> from grpo_cli.metrics import AnalyzeConfig, default_groups
    >>> from grpo_cli.io.reader import RolloutDataset
    >>> dataset = RolloutDataset(["sample_data/rollouts.parquet"])  # doctest: +SKIP
    >>> acc = accumulate(dataset, AnalyzeConfig(), default_groups(), workers=2)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import multiprocessing as mp
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from grpo_cli._launch import DistributedEnv, distributed_env, is_secondary_rank
from grpo_cli.core.keyed_state import all_reduce_states
from grpo_cli.core.state import MetricState
from grpo_cli.engine.config import StreamConfig, coded_group_by
from grpo_cli.engine.group import Accumulator, MetricGroup, per_key
from grpo_cli.engine.runner import accumulate_states
from grpo_cli.errors import GrpoCliError, UsageError
from grpo_cli.io.reader import RolloutDataset, Shard
from grpo_cli.io.storage import RemotePath

__all__ = [
    "MAX_COMPUTE_THREADS",
    "UNIT_BATCHES",
    "EXECUTORS",
    "DistributedEnv",
    "accumulate",
    "all_reduce_accumulator",
    "available_cores",
    "compute_threads",
    "distributed_env",
    "is_secondary_rank",
    "one_torch_thread",
    "plan_units",
    "split_by_bytes",
    "use_executor",
]

MAX_COMPUTE_THREADS = 4
"""Metric threads per process at most: the groups of a batch are the tasks, and the largest is about a fifth of
the work, so more threads would mostly wait at the end of each batch."""

EXECUTORS = ("local", "ray")
"""Where the units run: this machine's processes (``--workers``), or the tasks of a Ray cluster."""
_EXECUTOR: contextvars.ContextVar[str] = contextvars.ContextVar("grpo_cli_executor", default="local")


@contextlib.contextmanager
def use_executor(executor: str) -> Iterator[None]:
    """Run every :func:`accumulate` inside the block on ``executor`` (``"local"`` or ``"ray"``): how the CLI's
    ``--executor`` reaches the commands, and how a library caller sends ``grpo_cli.analyze`` to its Ray cluster.

    Example:
        >>> with use_executor("ray"):  # doctest: +SKIP
        ...     result = analyze(dataset, AnalyzeConfig())
    """
    if executor not in EXECUTORS:
        raise UsageError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


UNIT_BATCHES = 4
"""A unit holds at least this many ``--batch-tokens`` budgets of tokens (fewer, larger units merge less; more,
smaller units balance better across workers)."""


# -- planning --------------------------------------------------------------------------------------------------------
def available_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``, so containers and ``taskset`` are honoured)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def plan_units(shards: Sequence[Shard], min_tokens: int) -> list[tuple[Shard, ...]]:
    """Contiguous runs of ``shards`` (in dataset order) of at least ``min_tokens`` tokens each (the last may hold
    fewer). The plan depends on the data and ``min_tokens`` only, so every worker count folds the same tree.

    Example:
        >>> from grpo_cli.io.reader import Shard
        >>> shards = [Shard(0, (g,), 0, 1, n, 10 * n) for g, n in enumerate([5, 5, 20, 1])]
        >>> [[s.row_groups[0] for s in unit] for unit in plan_units(shards, 8)]
        [[0, 1], [2], [3]]
    """
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    units: list[tuple[Shard, ...]] = []
    current: list[Shard] = []
    tokens = 0
    for shard in shards:
        current.append(shard)
        tokens += shard.n_tokens
        if tokens >= min_tokens:
            units.append(tuple(current))
            current, tokens = [], 0
    if current:
        units.append(tuple(current))
    return units


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[range]:
    """``parts`` contiguous index ranges over ``sizes`` with about equal byte totals.

    Each boundary sits where the running total comes closest to its share (``r / parts`` of the whole), keeping
    every range non-empty while there are at least ``parts`` items (with fewer, some ranges are empty).

    Example:
        >>> split_by_bytes([4, 4, 4, 4], 2)
        [range(0, 2), range(2, 4)]
        >>> split_by_bytes([10, 1, 1], 3)
        [range(0, 1), range(1, 2), range(2, 3)]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    bounds = [0]
    for r in range(1, parts):
        share = prefix[-1] * r / parts
        lo = bounds[-1] + 1 if n >= parts else bounds[-1]
        hi = n - (parts - r) if n >= parts else n
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - share), i)))
    bounds.append(n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


# -- torch.distributed ------------------------------------------------------------------------------------------------
def _init_process_group(env: DistributedEnv, device: torch.device) -> None:
    """Join the default process group (``env://``: the launcher's ``MASTER_ADDR``/``MASTER_PORT``) unless the caller
    already did. It is kept for the life of the process (destroyed at exit): destroying and re-creating the default
    group reuses its store keys, and a rank could then read a peer's stale address and wait forever."""
    import atexit

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank % max(torch.cuda.device_count(), 1))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _device_for(config: StreamConfig) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def all_reduce_accumulator(acc: Accumulator, make_states: Callable[[], list[MetricState]]) -> None:
    """All-reduce ``acc`` in place over the default process group, so every rank holds the merged states.

    ``--group-by`` keys are unioned first (``all_gather_object`` of the key sets; a rank without a key gets fresh
    states from ``make_states``); then every state is all-reduced by
    :func:`~grpo_cli.core.keyed_state.all_reduce_states`, the implementation ``GRPOMetric`` uses too.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    key_sets: list[Any] = [None] * world
    dist.all_gather_object(key_sets, sorted(acc.by_key))
    for key in sorted({key for keys in key_sets for key in keys}):
        if key not in acc.by_key:
            acc.by_key[key] = make_states()
    states = list(acc.overall) + [s for key in sorted(acc.by_key) for s in acc.by_key[key]]
    all_reduce_states(states)


def _agree_on_errors(error: BaseException | None) -> None:
    """Every rank raises the first error of any rank (in rank order, i.e. file order), or none does."""
    import torch.distributed as dist

    payload: Any = None
    if error is not None:
        try:
            payload = pickle.loads(pickle.dumps(error))
        except Exception:  # an exception that does not pickle: keep its text
            payload = RuntimeError(f"{type(error).__name__}: {error}")
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, payload)
    first = next((e for e in everyone if e is not None), None)
    if first is not None:
        if error is not None and first is payload:
            raise error
        raise first


# -- worker processes -------------------------------------------------------------------------------------------------
_JOB: dict[str, Any] = {}


@contextlib.contextmanager
def one_torch_thread(device: torch.device) -> Iterator[None]:
    """On a CPU, run torch single-threaded for the duration (restoring the caller's setting after).

    The metric updates are hundreds of small element-wise ops per batch: torch's intra-op threads mostly spin-wait
    between them (twice the CPU time for the same wall time on 2 cores, far worse on a busy machine), while one
    thread leaves the other cores to Arrow's decoding, which runs ahead in the background (grpo_cli.engine.stream).
    It also makes float sums independent of the core count: torch splits a reduction by thread, so a different
    thread count could change the last bit of a sum.
    """
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _init_worker(job: dict[str, Any], arrow_threads: int, counter: Any) -> None:
    _JOB.clear()
    _JOB.update(job)
    _JOB["counter"] = counter
    torch.set_num_threads(1)
    try:
        import pyarrow

        pyarrow.set_cpu_count(arrow_threads)  # the decoding threads: the cores left to each worker
    except Exception:  # an Arrow build without the setter: its default pool size is only an oversubscription
        pass


def compute_threads(workers: int, processes: int, device: torch.device) -> int:
    """Metric threads per process: the ``workers`` cores left over by ``processes`` processes, at most
    :data:`MAX_COMPUTE_THREADS`; one on a GPU (it computes faster than one thread can feed it batches)."""
    if device.type != "cpu":
        return 1
    return max(1, min(workers // processes, MAX_COMPUTE_THREADS))


def _run_unit(index: int) -> bytes:
    counter = _JOB["counter"]

    def advance(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    acc = accumulate_states(
        _JOB["dataset"], _JOB["config"], _JOB["groups"], shards=_JOB["units"][index], progress=advance,
        threads=_JOB["threads"],
    )
    # Pickled bytes, not torch's shared-memory reductions: many tiny state tensors would each cost a file descriptor.
    return acc.dumps()


def _context(device: torch.device, remote: bool = False) -> mp.context.BaseContext:
    # fork starts a worker in milliseconds and inherits the opened dataset (the DataLoader pattern: one torch
    # thread per worker keeps OpenMP out of the child); CUDA cannot survive a fork, and only Linux forks safely.
    # Neither does the AWS SDK under pyarrow's S3 filesystem: a forked child shares its connection pool and threads
    # and reads garbage, so a dump in object storage gets fresh (spawned) workers, each with its own client.
    if device.type == "cpu" and sys.platform.startswith("linux") and not remote:
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _fold_in_pool(
    dataset: RolloutDataset,
    config: StreamConfig,
    groups: Sequence[MetricGroup],
    units: Sequence[tuple[Shard, ...]],
    workers: int,
    threads: int,
    device: torch.device,
    progress: Callable[[int], None] | None,
) -> Accumulator:
    ctx = _context(device, remote=any(isinstance(path, RemotePath) for path in dataset.files))
    counter = ctx.Value("q", 0)
    arrow_threads = max(1, available_cores() // workers)
    job = {"dataset": dataset, "config": config, "groups": list(groups), "units": list(units),
           "threads": threads}
    acc: Accumulator | None = None
    reported = 0

    def report() -> None:
        nonlocal reported
        if progress is not None:
            done = counter.value
            if done > reported:
                progress(done - reported)
                reported = done

    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(job, arrow_threads, counter))
    try:
        # Submitted in unit order, so free workers take the next unit; results are merged in the same order.
        futures = [pool.submit(_run_unit, i) for i in range(len(units))]
        for future in futures:
            while True:
                try:
                    blob = future.result(timeout=0.2)
                    break
                except FuturesTimeout:
                    report()
            part = Accumulator.loads(blob).to(device)
            acc = part if acc is None else acc.merge_(part, take=True)
            report()
    except BrokenProcessPool:
        raise GrpoCliError(
            "a --workers process died (killed for memory?); rerun with fewer --workers or a smaller --batch-tokens"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert acc is not None
    return acc


def _fold(
    dataset: RolloutDataset,
    config: StreamConfig,
    groups: Sequence[MetricGroup],
    units: Sequence[tuple[Shard, ...]],
    workers: int,
    device: torch.device,
    progress: Callable[[int], None] | None,
) -> Accumulator:
    if _EXECUTOR.get() == "ray":
        from grpo_cli.engine.ray_executor import fold_on_ray

        return fold_on_ray(dataset, config, groups, units, device, progress)
    # --workers counts cores: processes take whole units, and the cores a process is left with compute its groups
    # in threads (a single-row-group dump still uses every core for the metrics).
    processes = max(1, min(workers, len(units)))
    threads = compute_threads(workers, processes, device)
    if processes > 1:
        return _fold_in_pool(dataset, config, groups, units, processes, threads, device, progress)
    if not units:
        return accumulate_states(dataset, config, groups, shards=[], progress=progress, threads=threads)
    acc: Accumulator | None = None
    for unit in units:
        part = accumulate_states(dataset, config, groups, shards=unit, progress=progress, threads=threads)
        acc = part if acc is None else acc.merge_(part, take=True)
    assert acc is not None
    return acc


def accumulate(
    dataset: RolloutDataset,
    config: StreamConfig,
    groups: Sequence[MetricGroup],
    *,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> Accumulator:
    """Stream the whole dataset into one :class:`~grpo_cli.engine.group.Accumulator` with ``workers`` processes, or
    this rank's share of it under ``torchrun`` followed by an all-reduce.

    Raises:
        UsageError: ``workers < 1``, a ``--group-by`` column the dump lacks, too many ``--group-by`` values.
        InputError: the first invalid input in file order (from whichever worker or rank met it).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UsageError(f"--workers must be an integer >= 1, got {workers!r}")
    if config.group_by is not None and coded_group_by(config.group_by):
        problem = dataset.group_column_problem(config.group_by)
        if problem is not None:
            raise UsageError(f"--group-by {config.group_by}: {problem}")
        if len(dataset.group_values(config.group_by)) > config.max_groups:
            raise UsageError(f"--group-by {config.group_by}: more than {config.max_groups} distinct values")
    elif config.group_by is not None and config.group_by not in dataset.columns:
        raise UsageError(f"--group-by {config.group_by}: the dump has no '{config.group_by}' column")
    units = plan_units(dataset.shards(), UNIT_BATCHES * config.batch_tokens)
    device = _device_for(config)
    env = distributed_env()
    if env is not None and _EXECUTOR.get() == "ray":
        raise UsageError("--executor ray under torchrun: use one of the two (each already spreads the row groups)")
    if env is None:
        with one_torch_thread(device):
            acc = _fold(dataset, config, groups, units, workers, device, progress)
    else:
        _init_process_group(env, device)
        device = _device_for(config)  # after set_device: this rank's GPU
        mine = split_by_bytes([sum(s.n_bytes for s in unit) for unit in units], env.world_size)[env.rank]
        error: BaseException | None = None
        acc = None
        try:
            with one_torch_thread(device):
                acc = _fold(dataset, config, groups, [units[i] for i in mine], workers, device, progress)
        except Exception as exc:  # every rank must reach the collective below, or the others would wait
            error = exc
        _agree_on_errors(error)
        assert acc is not None
        all_reduce_accumulator(acc, lambda: [group.init_state(config, device) for group in per_key(groups)])
    assert acc is not None  # for mypy: set on both branches (the lambda above drops the narrowing)
    if config.group_by is not None and len(acc.by_key) > config.max_groups:
        raise UsageError(f"--group-by {config.group_by}: more than {config.max_groups} distinct values")
    return acc
