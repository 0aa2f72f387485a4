"""``--executor ray`` scaling on this machine, and the costs a projection to N nodes needs (docs/performance.md).

    python bench/ray_scaling.py                      # 4 M tokens in 16 row groups; prints a table, --json FILE too

What it measures, every figure checked bitwise against one process:

- ``analyze`` of a local dump in one process, and as Ray tasks on a local cluster of 1 and 2 CPUs (the cluster's
  start-up reported apart: a verl/OpenRLHF driver already has its cluster);
- the same dump in object storage (SeaweedFS on 127.0.0.1, tests/seaweed.py), in one process and on Ray;
- per unit: the time to stream and fold one unit (local and from the store) and the driver's cost to unpickle and
  merge one unit's accumulator, from which the projection for N nodes is computed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT)]


def _timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=4e6)
    parser.add_argument("--row-group-tokens", type=float, default=262144)
    parser.add_argument("--batch-tokens", type=int, default=65536, help="units of 4 batches: 16 units by default")
    parser.add_argument("--rounds", type=int, default=3, help="runs per setting; the median is reported")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import ray
    import seaweed
    import torch
    from run import write_dump

    from grpo_cli.commands.analyze import analyze
    from grpo_cli.engine.group import Accumulator
    from grpo_cli.engine.parallel import UNIT_BATCHES, plan_units, use_executor
    from grpo_cli.engine.runner import accumulate_states
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.metrics import AnalyzeConfig, default_groups

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="ray-scaling-"))
    local = work / "dump"
    n_tokens = write_dump(local / "part-0.parquet", int(args.tokens), row_group_tokens=int(args.row_group_tokens))
    server = seaweed.start(work)
    results: dict[str, object] = {"tokens": n_tokens, "cores": os.cpu_count(), "rounds": args.rounds,
                                  "batch_tokens": args.batch_tokens, "load_before": os.getloadavg()[0]}
    try:
        os.environ.update(server.env)
        uri = server.upload(local, "bench/dump")
        config = AnalyzeConfig(batch_tokens=args.batch_tokens)
        reference = analyze(RolloutDataset([local]), config).metrics

        def run(paths: list[str], executor: str) -> float:
            times = []
            for _ in range(args.rounds):
                with use_executor(executor):
                    seconds, result = _timed(lambda: analyze(RolloutDataset(paths), config))
                assert result.metrics == reference, "figures differ from one process"
                times.append(seconds)
            return statistics.median(times)

        results["local_1_process_s"] = run([str(local)], "local")
        results["s3_1_process_s"] = run([f"{uri}/"], "local")
        for cpus in (1, 2):
            start, _ = _timed(lambda c=cpus: ray.init(num_cpus=c, include_dashboard=False, logging_level="ERROR",
                                                      log_to_driver=False))
            with use_executor("ray"):  # the first run starts the workers (imports torch)
                analyze(RolloutDataset([str(local)]), config)
            results[f"ray_{cpus}cpu_start_s"] = start
            results[f"ray_{cpus}cpu_local_s"] = run([str(local)], "ray")
            results[f"ray_{cpus}cpu_s3_s"] = run([f"{uri}/"], "ray")
            ray.shutdown()

        # Per-unit and merge costs: what one task and the driver each spend on a unit.
        groups = default_groups()
        for name, paths in (("local", [str(local)]), ("s3", [f"{uri}/"])):
            dataset = RolloutDataset(paths)
            units = plan_units(dataset.shards(), UNIT_BATCHES * config.batch_tokens)
            unit_times, blobs = [], []
            for unit in units:
                start = time.perf_counter()
                acc = accumulate_states(dataset, config, groups, shards=unit, threads=1)
                unit_times.append(time.perf_counter() - start)
                blobs.append(pickle.dumps(acc))
            results[f"{name}_units"] = len(units)
            results[f"{name}_unit_s"] = statistics.median(unit_times)
        merged: Accumulator = pickle.loads(blobs[0])
        merge_times = []
        for blob in blobs[1:]:  # what the driver does per finished task: unpickle, merge
            start = time.perf_counter()
            merged.merge_(pickle.loads(blob))
            merge_times.append(time.perf_counter() - start)
        results["merge_s"] = statistics.median(merge_times)
        results["accumulator_bytes"] = len(blobs[0])
    finally:
        seaweed.stop(server)
    results["load_after"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
