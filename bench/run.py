"""Benchmark: grpo-cli analyze / compare-prox against a bare Parquet decode and a pandas + numpy script.

    python bench/run.py                                        # 20 M tokens, 3 alternating rounds (make bench)
    python bench/run.py --tokens 2e6 --rounds 1                # a quick look
    python bench/run.py --workers 1,2 --row-group-tokens 2e6 --only decode,analyze   # --workers sweep
    python bench/run.py --tokens 2e8 --only decode,analyze,compare-prox --device cuda --batch-tokens 4194304
    python bench/run.py --only decode,analyze,analyze-1core,analyze-step,check-step --baseline /path/to/old/checkout
    python bench/run.py --seqs-per-step 17 --only analyze,analyze-step,check-step   # steps in runs, as trainers write

The contenders: ``decode`` (the floor), ``pandas`` (a hand-written 6-figure script), ``analyze`` (findings on, every
core), ``analyze-nofindings``, ``analyze-1core`` (pinned to one core), ``analyze-step`` (``--group-by step``),
``check-step`` (``check`` with two ``per = "step"`` rules) and ``compare-prox``. ``--baseline DIR`` also runs every
grpo-cli contender from another checkout (``DIR`` on ``PYTHONPATH``, labelled ``@base``) in the same alternating
rounds, so "before" and "after" see the same machine at the same time.

Writes a synthetic schema-v1 dump (sequence-per-row, pyarrow's default writer settings, lengths 600–1800, every
column) once under ``bench/out/``, in chunks of ``--row-group-tokens`` (each chunk is one row group, so memory stays
flat however large the dump; ``--seqs-per-step N`` writes the steps in runs of N sequences instead of interleaved
through the file), then times each contender in its own subprocess (so peak RSS is per contender)
alternating between them, and prints the median wall time, tokens/s and peak RSS, and the ratios analyze/decode and
pandas/analyze. Arguments it does not know (``--device cuda``, ``--batch-tokens N``) go to analyze and compare-prox.
Interpreter start-up and imports are excluded from every contender's time (torch's import is about a second).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
CHUNK_SEQUENCES_MAX = 1 << 20  # pyarrow's default max rows per row group: a chunk must stay below it


def write_dump(path: Path, n_tokens: int, *, row_group_tokens: int, seed: int = 0,
               seqs_per_step: int | None = None) -> int:
    """A synthetic dump with plausible values, written chunk by chunk; returns the exact token count.

    Each sequence's step (= current version) is drawn from 4 … 999 at random, so about a thousand steps are
    interleaved through the file; with ``seqs_per_step`` the steps come in runs of that many sequences instead, in
    order, as a trainer writes them step by step.
    """
    import numpy as np
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    total = 0
    first_seq = 0
    writer: pq.ParquetWriter | None = None
    while total < n_tokens:
        want = min(row_group_tokens, n_tokens - total)
        lengths = []
        chunk = 0
        while chunk < want and len(lengths) < CHUNK_SEQUENCES_MAX:
            length = int(rng.integers(600, 1801))
            lengths.append(length)
            chunk += length
        table = _chunk_table(rng, np.asarray(lengths, dtype=np.int64), first_seq, seqs_per_step)
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema)  # pyarrow's default writer settings, on purpose
        writer.write_table(table)
        total += chunk
        first_seq += len(lengths)
    assert writer is not None
    writer.close()
    tmp.replace(path)
    return total


def _chunk_table(rng, lengths, first_seq: int, seqs_per_step: int | None):  # type: ignore[no-untyped-def]
    import numpy as np
    import pyarrow as pa

    n_seq = len(lengths)
    total = int(lengths.sum())
    offsets = np.zeros(n_seq + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    prompt = rng.integers(50, 400, n_seq)
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    is_response = position >= np.repeat(prompt, lengths)

    new = -rng.exponential(0.8, total).astype(np.float32)
    old = np.minimum(new + rng.normal(0, 0.05, total).astype(np.float32), 0)
    prox = np.minimum(new + rng.normal(0, 0.02, total).astype(np.float32), 0)
    ref = np.minimum(new + rng.normal(0, 0.1, total).astype(np.float32), 0)
    entropy = rng.gamma(2.0, 0.5, total).astype(np.float32)
    current = rng.integers(4, 1000, n_seq)
    lag = rng.integers(0, 5, n_seq)
    seq_ids = first_seq + np.arange(n_seq)
    if seqs_per_step is not None:
        current = 4 + seq_ids // seqs_per_step  # drawn above all the same, so the other columns stay as they were
    versions = np.where(is_response, np.repeat(current - lag, lengths), -1).astype(np.int32)

    def listed(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    return pa.table({
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
        "group_id": pa.array(seq_ids // 8),
        "seq_id": pa.array(seq_ids),
    })


# -- contenders (each runs in its own process) -----------------------------------------------------------------------
def analyze_columns() -> list[str]:
    from grpo_cli.metrics import default_groups

    columns = {"loss_mask"}
    for group in default_groups():
        columns |= set(group.columns())
    return sorted(columns)


def run_decode(path: str, args: list[str]) -> None:
    """The floor: decode exactly the columns analyze reads, as analyze's reader does (streamed pages, batches of
    whole rows of about --batch-tokens tokens, one row group at a time), touching every buffer, nothing else."""
    import pyarrow.parquet as pq

    batch_tokens, buffer_bytes, columns = int(args[0]), int(args[1]), args[2:]
    parquet = pq.ParquetFile(path, memory_map=False, pre_buffer=False, buffer_size=buffer_bytes)
    columns = [c for c in columns if c in parquet.schema_arrow.names]
    md = parquet.metadata
    leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path.startswith("new_logp"))
    n = 0
    for rg in range(md.num_row_groups):
        meta = md.row_group(rg)
        rows = max(1, batch_tokens * meta.num_rows // max(meta.column(leaf).num_values, 1))
        for batch in parquet.iter_batches(batch_size=rows, row_groups=[rg], columns=columns, use_threads=True):
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


STEP_RULES = """
[[rule]]
metric = "kl/k3"
max = 1e9
per = "step"

[[rule]]
metric = "clip/ratio"
max = 1.0
per = "step"
"""
"""Two per-step rules that always pass: what a CI gate on every step costs, not whether it fails."""


def _check_step(path: str, extra: list[str]) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as rules:
        rules.write(STEP_RULES)
    from grpo_cli.cli import main

    try:
        # exit 1 is a verdict (the synthetic dump's random advantages fail a finding), not a failed run
        code = main(["check", path, "--rules", rules.name, "-f", "json", "-o", os.devnull, "-q", *extra])
        if code not in (0, 1):
            raise SystemExit(code)
    finally:
        os.unlink(rules.name)


def _analyze(*options: str) -> Callable[[str, list[str]], None]:
    return lambda path, extra: _cli(["analyze", path, "-f", "json", "-o", os.devnull, "-q", *options, *extra])


CONTENDERS: dict[str, Callable[[str, list[str]], None]] = {
    "decode": lambda path, extra: run_decode(path, extra),
    "pandas": lambda path, extra: run_pandas(path),
    "analyze": _analyze(),
    "analyze-nofindings": _analyze("--no-findings"),
    "analyze-1core": _analyze(),  # the child pins itself to one core first
    "analyze-step": _analyze("--group-by", "step"),
    "check-step": _check_step,
    "compare-prox": lambda path, extra: _cli(["compare-prox", path, "-f", "json", "-o", os.devnull, "-q", *extra]),
}
IMPORTS = {
    "decode": ["pyarrow.parquet"],
    "pandas": ["pandas", "pyarrow.parquet"],
    **{name: ["grpo_cli.cli", "grpo_cli.engine.run"]
       for name in ("analyze", "analyze-nofindings", "analyze-1core", "analyze-step", "check-step")},
    "compare-prox": ["grpo_cli.cli", "grpo_cli.engine.run", "grpo_cli.commands.compare_prox"],
}


class _WorkerPeaks:
    """The largest peak RSS (``VmHWM``) among this process's children, sampled from ``/proc`` while it runs.

    ``RUSAGE_CHILDREN`` cannot tell workers apart from the short-lived ldconfig torch's import runs, so the worker
    processes are watched directly (Linux only; elsewhere the figure stays 0)."""

    def __init__(self) -> None:
        import threading

        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        me = os.getpid()
        while not self._stop.wait(0.05):
            try:
                children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
            except OSError:
                return
            for pid in children:
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                except (OSError, ValueError):
                    continue

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kib / 1024


def _child(name: str, path: str, extra: list[str]) -> None:
    import importlib

    for module in IMPORTS[name]:
        importlib.import_module(module)
    after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peaks = _WorkerPeaks()
    start = time.perf_counter()
    cpu = time.process_time()
    CONTENDERS[name](path, extra)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu
    worker_peak = peaks.stop()
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = workers.ru_utime + workers.ru_stime - before.ru_utime - before.ru_stime
    print(json.dumps({
        "seconds": seconds,
        "cpu_seconds": cpu_seconds + worker_cpu,
        "peak_rss_mib": own.ru_maxrss / 1024,
        "imports_rss_mib": after_imports / 1024,
        "worker_peak_rss_mib": worker_peak,
    }))


def _info() -> dict[str, object]:
    """What analyze reads and how, asked in a subprocess: Linux carries a process's peak RSS across fork and exec,
    so this process must never import torch, or every contender would start from torch's footprint."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import run; "
        "from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, READ_BUFFER_BYTES; "
        "print(json.dumps({'columns': run.analyze_columns(), 'batch_tokens': DEFAULT_BATCH_TOKENS, "
        "'buffer_bytes': READ_BUFFER_BYTES}))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def measure(name: str, path: Path, extra: list[str], checkout: Path | None = None) -> dict[str, float] | None:
    env = None
    if checkout is not None:  # grpo_cli imported from another checkout (PYTHONPATH precedes site-packages)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, str(path), *extra],
        capture_output=True, text=True, check=False, env=env,
    )
    if proc.returncode != 0:
        print(f"  {name}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _option(extra: list[str], name: str) -> str | None:
    for i, arg in enumerate(extra):
        if arg == name and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # the child's arguments belong to the contender, not to this parser
        if sys.argv[2].endswith("-1core") and hasattr(os, "sched_setaffinity"):
            # before torch and Arrow size their thread pools, as `taskset -c N` would
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        _child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=20e6, help="tokens in the synthetic dump (default 20M)")
    parser.add_argument("--row-group-tokens", type=float, default=20e6,
                        help="tokens per written chunk = row group (default 20M: one row group for the 20M dump)")
    parser.add_argument("--seqs-per-step", type=int, default=None,
                        help="steps in runs of this many sequences, as a trainer writes them (default: about a "
                             "thousand steps interleaved through the file)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument("--only", default="decode,pandas,analyze,compare-prox", help="comma-separated contenders")
    parser.add_argument("--workers", default=None,
                        help="comma-separated --workers values for analyze and compare-prox (a sweep); default: "
                             "the commands' own default (the available cores)")
    parser.add_argument("--file", type=Path, default=None, help="benchmark this dump instead of a synthetic one")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--prepare", action="store_true", help="only write the synthetic dump (if missing)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of grpo-cli: run its grpo-cli contenders too, labelled @base")
    args, extra = parser.parse_known_args()

    import pyarrow.parquet as pq

    if args.file is not None:
        path = args.file
        md = pq.ParquetFile(path).metadata
        leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path.startswith("new_logp"))
        n_tokens = sum(md.row_group(rg).column(leaf).num_values for rg in range(md.num_row_groups))
    else:
        suffix = "" if args.row_group_tokens == 20e6 else f"-rg{int(args.row_group_tokens)}"
        suffix += "" if args.seqs_per_step is None else f"-steps{args.seqs_per_step}"
        path = OUT / f"synthetic-{int(args.tokens)}{suffix}.parquet"
        meta = path.with_suffix(".json")
        if path.exists() and meta.exists():
            n_tokens = json.loads(meta.read_text())["tokens"]
        else:
            print(f"writing {path} ...", file=sys.stderr)
            # In a subprocess: Linux carries a process's peak RSS across fork and exec, so the numpy arrays of the
            # dump must not inflate every contender's figure.
            code = (
                "import json, sys; sys.path.insert(0, sys.argv[1]); import run; from pathlib import Path; "
                "print(run.write_dump(Path(sys.argv[2]), int(sys.argv[3]), row_group_tokens=int(sys.argv[4]), "
                "seqs_per_step=json.loads(sys.argv[5])))"
            )
            out = subprocess.run(
                [sys.executable, "-c", code, str(Path(__file__).parent), str(path), str(int(args.tokens)),
                 str(int(args.row_group_tokens)), json.dumps(args.seqs_per_step)],
                capture_output=True, text=True, check=True,
            )
            n_tokens = int(out.stdout.strip())
            meta.write_text(json.dumps({"tokens": n_tokens}))
    row_groups = pq.ParquetFile(path).metadata.num_row_groups
    if args.prepare:
        print(f"dump: {path} ({n_tokens:,} tokens, {row_groups} row groups)")
        return

    info = _info()
    batch_tokens = int(_option(extra, "--batch-tokens") or info["batch_tokens"])
    decode_args = [str(batch_tokens), str(info["buffer_bytes"]), *info["columns"]]
    runs: list[tuple[str, str, list[str], Path | None]] = []  # (label, contender, arguments, checkout)
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r} (choose from {', '.join(CONTENDERS)})")
        checkouts: list[tuple[str, Path | None]] = [("", None)]
        if args.baseline is not None and name not in ("decode", "pandas"):
            checkouts.append(("@base", args.baseline.resolve()))
        for suffix, checkout in checkouts:
            if name in ("analyze", "compare-prox") and args.workers:
                for w in args.workers.split(","):
                    runs.append((f"{name} w={int(w)}{suffix}", name, [*extra, "--workers", str(int(w))], checkout))
            else:
                runs.append((name + suffix, name, decode_args if name == "decode" else extra, checkout))

    print(f"dump: {path} ({n_tokens:,} tokens, {row_groups} row groups, {path.stat().st_size / 2**20:.0f} MiB); "
          f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'} "
          f"usable); {platform.processor() or platform.machine()}; batch tokens {batch_tokens:,}; "
          f"extra args: {' '.join(extra) or '-'}")
    print(f"load average before: {_load()}")
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _, _ in runs}
    for round_index in range(args.rounds):
        for label, name, run_args, checkout in runs:  # alternate contenders so drift hits all of them alike
            result = measure(name, path, run_args, checkout)
            if result is not None:
                results[label].append(result)
        print(f"  round {round_index + 1}/{args.rounds} done (load {_load()})", file=sys.stderr)
    print(f"load average after: {_load()}")

    medians: dict[str, float] = {}
    rows = []
    # peak RSS: the measured process (imports included: torch alone is about 0.7 GiB); workers: the largest
    # worker process's peak, if it ran any.
    header = f"{'contender':<26}{'median s':>10}{'M tokens/s':>12}{'CPU s':>8}{'peak RSS MiB':>14}{'imports':>9}" \
             f"{'workers':>9}"
    print(header)
    for label, found in results.items():
        if not found:
            print(f"{label:<26}{'failed':>10}")
            continue
        seconds = statistics.median(r["seconds"] for r in found)
        cpu = statistics.median(r["cpu_seconds"] for r in found)
        rss = max(r["peak_rss_mib"] for r in found)
        imports = max(r["imports_rss_mib"] for r in found)
        worker_rss = max(r["worker_peak_rss_mib"] for r in found)
        medians[label] = seconds
        rows.append({"contender": label, "median_s": seconds, "runs_s": [r["seconds"] for r in found],
                     "m_tokens_per_s": n_tokens / seconds / 1e6, "cpu_s": cpu, "peak_rss_mib": rss,
                     "imports_rss_mib": imports, "worker_peak_rss_mib": worker_rss})
        workers_text = f"{worker_rss:.0f}" if worker_rss else "-"
        print(f"{label:<26}{seconds:>10.2f}{n_tokens / seconds / 1e6:>12.1f}{cpu:>8.2f}{rss:>14.0f}{imports:>9.0f}"
              f"{workers_text:>9}")
    ratios = {}
    # Each ratio with the target it is held to (docs/performance.md), for this checkout and the baseline's.
    for suffix in ("", "@base"):
        pairs = [
            (f"analyze{suffix} / decode", f"analyze{suffix}", "decode", "<= 3"),
            (f"analyze-nofindings{suffix} / decode", f"analyze-nofindings{suffix}", "decode", ""),
            (f"pandas / analyze{suffix}", "pandas", f"analyze{suffix}", ">= 1.5"),
            (f"analyze-step{suffix} / analyze{suffix}", f"analyze-step{suffix}", f"analyze{suffix}", "<= 1.5"),
            (f"check-step{suffix} / analyze{suffix}", f"check-step{suffix}", f"analyze{suffix}", "<= 1.2"),
            (f"analyze-1core{suffix} / analyze{suffix}", f"analyze-1core{suffix}", f"analyze{suffix}", ">= 1.6"),
        ]
        for key, num, den, target in pairs:
            if num in medians and den in medians:
                ratios[key] = medians[num] / medians[den]
                print(f"{key} = {ratios[key]:.2f}x" + (f" (target {target})" if target else ""))
    for label in medians:
        if label.endswith("@base") and label[: -len("@base")] in medians:
            now = label[: -len("@base")]
            ratios[f"{now}: base / now"] = medians[label] / medians[now]
            print(f"{now}: {ratios[f'{now}: base / now']:.2f}x faster than the baseline")
    if args.workers:
        for name in ("analyze", "compare-prox"):
            base = medians.get(f"{name} w=1")
            for w in args.workers.split(","):
                label = f"{name} w={int(w)}"
                if base and label in medians and int(w) > 1:
                    speedup = base / medians[label]
                    print(f"{label}: speed-up {speedup:.2f}x, parallel efficiency {speedup / int(w):.0%}")
    if args.json is not None:
        args.json.write_text(json.dumps({"dump": str(path), "tokens": n_tokens, "row_groups": row_groups,
                                         "extra": extra, "rows": rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
