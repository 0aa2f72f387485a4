"""CPU time of each metric group's update on one core, for finding what to optimise (docs/performance.md).

    python bench/profile_groups.py bench/out/synthetic-20000000.parquet            # 6 M tokens, 3 passes
    python bench/profile_groups.py DUMP --tokens 2e6 --batch-tokens 1048576 --ops  # plus torch's top operators
    python bench/profile_groups.py DUMP --only diag/by_step --ops                  # one group's operators
    python bench/profile_groups.py DUMP --floor                                     # the float sums' share

Reads about ``--tokens`` tokens into memory once (decoding is not timed), validates each batch, then times every
group's ``update`` with ``time.process_time`` (CPU time: far steadier than wall time on a shared machine) on one
torch thread, as analyze runs. ``--ops`` adds a ``torch.profiler`` table of the operators by self CPU time.
``--floor`` adds, per group, the time of its floating-point sums alone (``sum``, ``index_add``, ``segment_reduce``,
``scatter_add``, ``cumsum``, … on float inputs that are not all whole numbers): the part no byte-identical rewrite
can remove, since such a sum's last bits depend on the order its terms are added in, so each must keep its kernel
and its materialised input.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump")
    parser.add_argument("--tokens", type=float, default=6e6)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--no-findings", action="store_true", help="leave out the findings' statistics groups")
    parser.add_argument("--floor", action="store_true", help="time each group's floating-point sums alone")
    parser.add_argument("--only", default=None, help="comma-separated group names: time (and --ops) these alone")
    args = parser.parse_args()

    from grpo_cli.engine.validate import BatchValidator
    from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset
    from grpo_cli.metrics import AnalyzeConfig, default_groups
    from grpo_cli.metrics.diagnosis import diagnosis_groups

    torch.set_num_threads(1)
    batch_tokens = args.batch_tokens or DEFAULT_BATCH_TOKENS
    dataset = RolloutDataset([args.dump])
    config = AnalyzeConfig(batch_tokens=batch_tokens)
    groups = default_groups() + ([] if args.no_findings else diagnosis_groups())
    if args.only:
        groups = [group for group in groups if group.name in args.only.split(",")]
    columns = {"loss_mask"}.union(*(group.columns() for group in groups))
    batches, n = [], 0
    for batch in dataset.iter_batches(columns=columns, raw_mask=True, batch_tokens=batch_tokens):
        batches.append(batch)
        n += batch.n_tokens
        if n >= args.tokens:
            break
    validator = BatchValidator.for_dataset(dataset, "error")
    states = [group.init_state(config, "cpu") for group in groups]
    seconds: dict[str, float] = {}

    def one_pass() -> None:
        for raw in batches:
            start = time.process_time()
            batch = validator(raw)
            seconds["validate (+ compaction)"] = seconds.get("validate (+ compaction)", 0.0) + (
                time.process_time() - start
            )
            valid = batch.valid()
            for group, state in zip(groups, states):
                start = time.process_time()
                group.update(state, batch, valid, config)
                seconds[group.name] = seconds.get(group.name, 0.0) + time.process_time() - start

    for _ in range(args.passes):
        one_pass()
    total = sum(seconds.values())
    print(f"{n:,} tokens in {len(batches)} batches of {batch_tokens:,}; mean of {args.passes} passes, one thread")
    for name, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{name:<24}{value / args.passes * 1e3:9.1f} ms {value / total:7.1%}")
    print(f"{'total':<24}{total / args.passes * 1e3:9.1f} ms   {n * args.passes / total / 1e6:.1f} M tokens/s")
    if args.floor:
        _print_floor(groups, states, batches, validator, config, args.passes)
    if args.ops:
        from torch.profiler import profile

        with profile() as prof:
            one_pass()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


FLOAT_SUMS = frozenset({
    "sum", "nansum", "mean", "cumsum", "index_add", "index_add_", "segment_reduce", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "bincount", "matmul", "dot", "var", "std",
})
"""Reductions whose result's last bits depend on the order of their (floating-point) terms."""


def _print_floor(groups, states, batches, validator, config, passes: int) -> None:  # type: ignore[no-untyped-def]
    from torch.overrides import TorchFunctionMode

    spent: dict[str, float] = {}
    current = [""]

    class FloatSums(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
            # A sum of whole numbers below 2**53 is exact in any order: counts kept in float64 are not part of it.
            if name in FLOAT_SUMS and floats and not all(bool((x == torch.trunc(x)).all()) for x in floats):
                start = time.perf_counter()
                out = func(*args, **kwargs)
                spent[current[0]] = spent.get(current[0], 0.0) + time.perf_counter() - start
                return out
            return func(*args, **kwargs)

    n = sum(batch.n_tokens for batch in batches)
    with FloatSums():
        for _ in range(passes):
            for raw in batches:
                batch = validator(raw)
                valid = batch.valid()
                for group, state in zip(groups, states):
                    current[0] = group.name
                    group.update(state, batch, valid, config)
    total = sum(spent.values()) / passes
    print(f"floating-point sums alone (wall, one thread): {total * 1e3:.1f} ms, {n / total / 1e6:.1f} M tokens/s")
    for name, value in sorted(spent.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {name:<22}{value / passes * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
