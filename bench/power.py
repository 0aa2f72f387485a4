"""The findings' power table: detection rate against fault magnitude and dump size, and false-alarm rate on healthy
runs, from the physically real corpus (``grpo_cli.commands.corpus``) on seeds the thresholds were not set with.

    python bench/power.py                      # 3 seeds, dumps of 64, 256 and 1024 sequences (~15 min on 2 cores)
    python bench/power.py --seeds 100 101 --sizes 64 256

Writes ``bench/power_table.md`` and regenerates ``docs/findings.md`` (whose last section is that table). A fault
counts as detected when a finding of its category is at ``warning`` or ``error``; a healthy run raises a false alarm
when any finding is at ``warning`` or ``error``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _corpus_eval import LOUD, run_case  # noqa: E402

from grpo_cli.commands.corpus_catalog import CONTROLS, FAULTS  # noqa: E402

SIZES = {64: {"steps": 8, "prompts_per_step": 1}, 256: {"steps": 8, "prompts_per_step": 4},
         1024: {"steps": 8, "prompts_per_step": 16}}
"""Dump size in sequences (groups of 8) → the corpus run's shape."""


READING = """
How to read it. Every healthy control stays quiet at every size (0 false alarms in 36 runs). Faults written into
the dump (alignment, masks, reference, duplicates, advantages, re-tokenisation, the proximal recompute, length) are
found from 64 sequences on, wherever the dump can hold them: the 64-sequence shape has one GRPO group per step, which
no grouping or normalisation fault can touch. Engine-side faults need more: a temperature or a top-k/top-p engine is
found from 256 sequences, a stale engine (weight sync) from about 1,000 when every engine is stale, and one stale
engine of four is not reliably found at these sizes; an int4-quantised engine on this small model (mean exp|Δ| ≈
1.03 against the 1.02 threshold) is found only in about half the runs, and a learning-rate spike shows as clipping or
entropy collapse in about half.
"""
"""What the table says, in words (reviewed against the table each time it is regenerated)."""


def _shape(sequences: int, case_spec: dict[str, object]) -> dict[str, object]:
    shape = dict(SIZES[sequences])
    if "steps" in case_spec:  # a fault that needs its steps (weight sync) keeps them; the size comes from prompts
        shape["prompts_per_step"] = max(1, sequences // 8 // int(case_spec["steps"]))  # type: ignore[call-overload]
    return shape


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[100, 101, 102])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    start = time.time()
    detected: dict[tuple[str, int], list[bool]] = defaultdict(list)
    alarms: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for size in args.sizes:
        for seed in args.seeds:
            for cases in FAULTS.values():
                for case in cases:
                    outcome = run_case(case, seed, base=_shape(size, case.spec))
                    detected[(case.name, size)].append(outcome.named())
            for case in CONTROLS.values():
                if case.name in ("small", "one_step"):
                    continue  # their size is fixed; the sizes here stand for them
                outcome = run_case(case, seed, base=_shape(size, case.spec))
                alarms[(case.name, size)].append(any(f["severity"] in LOUD for f in outcome.findings))
        print(f"size {size}: done ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    sizes = args.sizes
    head = "| fault (category) | magnitude | " + " | ".join(f"{s} seq." for s in sizes) + " |"
    lines = [
        f"Detection rate (a finding of the fault's category at `warning` or `error`) over seeds "
        f"{', '.join(map(str, args.seeds))}, by dump size in sequences (GRPO groups of 8; about 4 response tokens "
        "each). Produced by `python bench/power.py`.",
        "",
        head,
        "|" + "---|" * (len(sizes) + 2),
    ]
    for fault, cases in FAULTS.items():
        for case in cases:
            rates = [detected[(case.name, s)] for s in sizes]
            cells = " | ".join(f"{sum(r)}/{len(r)}" for r in rates)
            lines.append(f"| {fault} ({case.category}) | {case.magnitude:g} | {cells} |")
    lines += ["", "False alarms (any finding at `warning` or `error`) on healthy runs:", "",
              "| healthy control | " + " | ".join(f"{s} seq." for s in sizes) + " |",
              "|" + "---|" * (len(sizes) + 1)]
    for name in CONTROLS:
        if (name, sizes[0]) in alarms:
            cells = " | ".join(f"{sum(alarms[(name, s)])}/{len(alarms[(name, s)])}" for s in sizes)
            lines.append(f"| {name} | {cells} |")
    table = "\n".join(lines) + "\n" + READING
    (ROOT / "bench" / "power_table.md").write_text(table, encoding="utf-8")
    docs = subprocess.run([sys.executable, "-m", "grpo_cli.findings.catalog"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    (ROOT / "docs" / "findings.md").write_text(docs, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
