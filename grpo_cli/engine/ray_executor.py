"""``--executor ray``: the units of :mod:`grpo_cli.engine.parallel` as Ray tasks, merged exactly as ``--workers`` does.

The cluster is the one ``RAY_ADDRESS`` names (``ray.init()``'s own rule, https://docs.ray.io/en/latest/ray-core/api/
doc/ray.init.html), else a local one started for the run; a caller that already called ``ray.init`` (a verl or
OpenRLHF driver) keeps its cluster. Each task streams one unit (contiguous row groups of one or more files) straight
from where the dump lives and returns the unit's pickled :class:`~grpo_cli.engine.group.Accumulator`, the same bytes
a ``--workers`` process returns; the driver merges them **in unit order**, so the figures are bitwise those of one
process whatever the cluster's size or the order tasks finish in.

Where tasks run ("near the data"): only the unit descriptions travel (file, row groups), never the rows. A dump in
object storage is read by every node directly, so its tasks are spread over the nodes (``SPREAD``: the aggregate
bandwidth to the store grows with the nodes); local files exist on the driver's node only, so their tasks are
pinned there (``NodeAffinitySchedulingStrategy``). Every task asks for one CPU and computes with one torch thread,
as a ``--workers`` process does.

Credentials: a task opens object storage with its node's own credential chain (the endpoint travels with the path;
docs/storage.md). ``grpo-cli`` must be importable on every node, in the same version as on the driver.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from grpo_cli.engine.config import StreamConfig
from grpo_cli.engine.group import Accumulator, MetricGroup
from grpo_cli.engine.runner import accumulate_states
from grpo_cli.errors import GrpoCliError, UsageError
from grpo_cli.io.reader import RolloutDataset, Shard
from grpo_cli.io.storage import RemotePath

__all__ = ["WINDOW_PER_CPU", "fold_on_ray", "ray_available"]

WINDOW_PER_CPU = 2
"""Tasks in flight or finished but not yet merged, per CPU of the cluster: enough to keep every CPU busy while the
driver merges in unit order, few enough that the results waiting for it stay bounded."""


def ray_available() -> bool:
    """Whether the ``ray`` package (the ``ray`` extra) is installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'grpo-cli[ray]'") from None
    return ray


def _connect(ray: Any) -> None:
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        else:
            # A local cluster for this run: no dashboard (seconds of start-up, nothing to look at for one command).
            ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "a local Ray cluster"
        raise UsageError(f"--executor ray: cannot start or reach {where} ({str(exc).splitlines()[0]})") from None


def _unit_task(job: tuple[RolloutDataset, StreamConfig, list[MetricGroup]], unit: tuple[Shard, ...]) -> bytes:
    # What a --workers process does for one unit (parallel._run_unit): one torch thread, the same accumulate_states,
    # the accumulator pickled on the CPU, so the driver merges the same bytes.
    dataset, config, groups = job
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acc = accumulate_states(dataset, config, groups, shards=unit, threads=1)
        return acc.dumps()
    finally:
        torch.set_num_threads(previous)


def _scheduling(ray: Any, dataset: RolloutDataset) -> Any:
    if all(isinstance(path, RemotePath) for path in dataset.files):
        return "SPREAD"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


@contextlib.contextmanager
def _cancel_on_exit(ray: Any, refs: dict[int, Any]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for ref in refs.values():
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        raise


def fold_on_ray(
    dataset: RolloutDataset,
    config: StreamConfig,
    groups: Sequence[MetricGroup],
    units: Sequence[tuple[Shard, ...]],
    device: torch.device,
    progress: Callable[[int], None] | None = None,
) -> Accumulator:
    """Every unit as a Ray task; the accumulators merged in unit order (module docstring).

    Raises:
        UsageError: Ray is not installed, the cluster cannot be reached, or ``device`` is not the CPU.
        InputError: the first invalid input in unit (file) order, as one process would report it.
        GrpoCliError: a task died (a node lost, a worker killed for memory).
    """
    if device.type != "cpu":
        raise UsageError("--executor ray computes on the CPUs of the cluster's nodes: leave --device at cpu")
    ray = _ray()
    _connect(ray)
    if not units:
        return accumulate_states(dataset, config, groups, shards=[], threads=1)
    # A unit is a pure read, so Ray may rerun its task when a worker or node dies (its default for system failures);
    # an exception of the task itself (bad input) is not retried.
    task = ray.remote(num_cpus=1)(_unit_task).options(scheduling_strategy=_scheduling(ray, dataset))
    # The dataset (paths, footers, options) is put in the object store once, not pickled into every task; Ray hands
    # a task the value of an ObjectRef argument.
    job = ray.put((dataset, config, list(groups)))
    # At most WINDOW_PER_CPU tasks per cluster CPU are submitted ahead of the merge, so the results waiting in the
    # object store stay bounded whatever the number of units.
    window = max(4, WINDOW_PER_CPU * int(ray.cluster_resources().get("CPU", 1)))
    refs: dict[int, Any] = {}
    submitted = 0
    acc: Accumulator | None = None
    with _cancel_on_exit(ray, refs):
        for index, unit in enumerate(units):
            while submitted < len(units) and submitted < index + window:
                refs[submitted] = task.remote(job, units[submitted])
                submitted += 1
            part = Accumulator.loads(_result(ray, refs.pop(index))).to(device)
            acc = part if acc is None else acc.merge_(part, take=True)
            if progress is not None:
                progress(sum(shard.n_tokens for shard in unit))
    assert acc is not None
    return acc


def _result(ray: Any, ref: Any) -> bytes:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, GrpoCliError):
            raise cause from None  # bad input: the same one line as in one process
        raise GrpoCliError(f"a Ray task failed: {str(cause or exc).splitlines()[0]}") from None
    except ray.exceptions.RayError as exc:
        raise GrpoCliError(
            f"a Ray task died ({type(exc).__name__}: killed for memory, or its node lost?); rerun with a smaller "
            "--batch-tokens or more memory per node"
        ) from None
