"""Benchmark: grpo-cli analyze / compare-prox against a bare Parquet decode and a pandas + numpy script.

    python bench/run.py                       # 20 M tokens, 3 alternating rounds
    python bench/run.py --tokens 2e6 --rounds 1 --workers 1

Writes a synthetic schema-v1 dump (sequence-per-row, pyarrow's default writer settings, lengths 600–1800, every
column) once under ``bench/out/``, then times each contender in its own subprocess (so peak RSS is per contender)
alternating between them, and prints the median wall time, tokens/s and peak RSS, and the ratios
analyze/decode and pandas/analyze.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def write_dump(path: Path, n_tokens: int, seed: int = 0) -> int:
    """A synthetic dump with plausible values; returns the exact token count."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < n_tokens:
        length = int(rng.integers(600, 1801))
        lengths.append(length)
        total += length
    lengths_np = np.asarray(lengths, dtype=np.int64)
    n_seq = len(lengths)
    offsets = np.zeros(n_seq + 1, dtype=np.int32)
    np.cumsum(lengths_np, out=offsets[1:])
    prompt = rng.integers(50, 400, n_seq)
    position = np.arange(total) - np.repeat(offsets[:-1], lengths_np)
    is_response = position >= np.repeat(prompt, lengths_np)

    new = -rng.exponential(0.8, total).astype(np.float32)
    old = np.minimum(new + rng.normal(0, 0.05, total).astype(np.float32), 0)
    prox = np.minimum(new + rng.normal(0, 0.02, total).astype(np.float32), 0)
    ref = np.minimum(new + rng.normal(0, 0.1, total).astype(np.float32), 0)
    entropy = rng.gamma(2.0, 0.5, total).astype(np.float32)
    current = rng.integers(4, 1000, n_seq)
    lag = rng.integers(0, 5, n_seq)
    versions = np.where(is_response, np.repeat(current - lag, lengths_np), -1).astype(np.int32)

    def listed(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    table = pa.table({
        "new_logp": listed(new),
        "old_logp": listed(old),
        "prox_logp": listed(prox),
        "ref_logp": listed(ref),
        "entropy": listed(entropy),
        "loss_mask": listed(is_response.astype(np.int8)),
        "versions": listed(versions),
        "advantages": pa.array(rng.normal(0, 1, n_seq).astype(np.float32)),
        "rewards": pa.array(rng.integers(0, 2, n_seq).astype(np.float32)),
        "current_version": pa.array(current),
        "step": pa.array(current),
        "group_id": pa.array(np.arange(n_seq) // 8),
        "seq_id": pa.array(np.arange(n_seq)),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)  # pyarrow's default writer settings, on purpose
    return total


# -- contenders (each runs in its own process) -----------------------------------------------------------------------
def analyze_columns() -> list[str]:
    from grpo_cli.analysis import default_groups

    columns = {"loss_mask"}
    for group in default_groups():
        columns |= set(group.columns())
    return sorted(columns)


def run_decode(path: str, columns: list[str]) -> None:
    """The floor: decode exactly the columns analyze reads, touching every buffer, nothing else."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path, memory_map=True)
    columns = [c for c in columns if c in parquet.schema_arrow.names]
    n = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=columns, use_threads=True):
        n += batch.num_rows
    print(n, file=sys.stderr)


def run_pandas(path: str) -> None:
    """What a user writes by hand: pandas + numpy for the GRPOMetric figures (means, k3 KL, clip fractions)."""
    import numpy as np
    import pandas as pd

    columns = ["new_logp", "old_logp", "loss_mask", "advantages", "entropy"]
    frame = pd.read_parquet(path, columns=columns)
    lengths = frame["new_logp"].map(len).to_numpy()
    new = np.concatenate(frame["new_logp"].to_numpy())
    old = np.concatenate(frame["old_logp"].to_numpy())
    mask = np.concatenate(frame["loss_mask"].to_numpy()).astype(bool)
    entropy = np.concatenate(frame["entropy"].to_numpy())
    adv = np.repeat(frame["advantages"].to_numpy(), lengths)
    d = (new - old)[mask]
    r = np.exp(d)
    a = adv[mask]
    figures = {
        "logp/new_mean": float(new[mask].mean(dtype=np.float64)),
        "logp/old_mean": float(old[mask].mean(dtype=np.float64)),
        "kl/k3": float((np.expm1(d) - d).mean(dtype=np.float64)),
        "entropy/mean": float(entropy[mask].mean(dtype=np.float64)),
        "clip/low": float(((r < 0.8) & (a < 0)).mean()),
        "clip/high": float(((r > 1.2) & (a > 0)).mean()),
    }
    print(json.dumps(figures), file=sys.stderr)


def _cli(args: list[str]) -> None:
    from grpo_cli.cli import main

    code = main(args)
    if code != 0:
        raise SystemExit(code)


CONTENDERS = {
    "decode": lambda path, extra: run_decode(path, extra),
    "pandas": lambda path, extra: run_pandas(path),
    "analyze": lambda path, extra: _cli(["analyze", path, "-f", "json", "-o", os.devnull, "-q", *extra]),
    "compare-prox": lambda path, extra: _cli(["compare-prox", path, "-f", "json", "-o", os.devnull, "-q", *extra]),
}
IMPORTS = {
    "decode": ["pyarrow.parquet"],
    "pandas": ["pandas", "pyarrow.parquet"],
    "analyze": ["grpo_cli.cli", "grpo_cli.analysis"],
    "compare-prox": ["grpo_cli.cli", "grpo_cli.analysis"],
}


def _child(name: str, path: str, extra: list[str]) -> None:
    import importlib

    # Interpreter start-up and imports (torch: about a second) are constant costs, excluded for every contender.
    for module in IMPORTS[name]:
        importlib.import_module(module)
    start = time.perf_counter()
    CONTENDERS[name](path, extra)
    seconds = time.perf_counter() - start
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_rss_mib": rss_kib / 1024}))


def measure(name: str, path: Path, extra: list[str]) -> dict[str, float] | None:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, str(path), *extra],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        print(f"  {name}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=20e6, help="tokens in the synthetic dump (default 20M)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument("--only", default="decode,pandas,analyze,compare-prox", help="comma-separated contenders")
    parser.add_argument("--file", type=Path, default=None, help="benchmark this dump instead of a synthetic one")
    parser.add_argument("--child", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args()
    if args.child:
        _child(args.child[0], args.child[1], extra)
        return

    if args.file is not None:
        path = args.file
        import pyarrow.parquet as pq

        n_tokens = sum(len(v) for b in pq.ParquetFile(path).iter_batches(columns=["new_logp"])
                       for v in b.column(0).to_pylist())
    else:
        path = OUT / f"synthetic-{int(args.tokens)}.parquet"
        meta = path.with_suffix(".json")
        if path.exists() and meta.exists():
            n_tokens = json.loads(meta.read_text())["tokens"]
        else:
            print(f"writing {path} ...", file=sys.stderr)
            n_tokens = write_dump(path, int(args.tokens))
            meta.write_text(json.dumps({"tokens": n_tokens}))
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    print(f"dump: {path} ({n_tokens:,} tokens, {path.stat().st_size / 2**20:.0f} MiB); "
          f"{os.cpu_count()} cores; extra args: {' '.join(extra) or '-'}")
    columns = analyze_columns()
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for round_index in range(args.rounds):
        for name in names:  # alternate contenders so drift hits all of them alike
            result = measure(name, path, columns if name == "decode" else extra)
            if result is not None:
                runs[name].append(result)
        print(f"  round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    medians: dict[str, float] = {}
    print(f"{'contender':<14}{'median s':>10}{'M tokens/s':>12}{'peak RSS MiB':>14}")
    for name, results in runs.items():
        if not results:
            print(f"{name:<14}{'failed':>10}")
            continue
        seconds = statistics.median(r["seconds"] for r in results)
        rss = max(r["peak_rss_mib"] for r in results)
        medians[name] = seconds
        print(f"{name:<14}{seconds:>10.2f}{n_tokens / seconds / 1e6:>12.1f}{rss:>14.0f}")
    if "analyze" in medians and "decode" in medians:
        print(f"analyze / decode = {medians['analyze'] / medians['decode']:.2f}x (target <= 1.25)")
    if "analyze" in medians and "pandas" in medians:
        print(f"pandas / analyze = {medians['pandas'] / medians['analyze']:.2f}x (target >= 2.5)")


if __name__ == "__main__":
    main()
