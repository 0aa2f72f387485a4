"""Replay equivalence on the whole corpus: every fault at every magnitude and every healthy control, replayed step by
step into :class:`grpo_cli.Diagnoser`, ends with the codes and severities ``analyze`` gives for the whole dump.

    python bench/replay_corpus.py                    # seeds 7 and 11, every case (~5 min on 2 cores)
    python bench/replay_corpus.py --seeds 7 --cases temperature@0.85 async

Each case's run is generated at the findings tests' size (6 steps of 12 prompts, unless the case sets its own),
analysed with the case's options (``analyze -f json``) and replayed one part file per step (a ``Diagnoser.update``
per reader batch, then ``step_end``). Prints one row per case and seed: analyze's findings (code:severity), whether
the replay ends with the same, and what differs. Exits 1 if any case differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _corpus_eval import graded, run_case  # noqa: E402

from grpo_cli.commands.corpus_catalog import CONTROLS, FAULTS  # noqa: E402

SIZE = {"steps": 6, "prompts_per_step": 12}
"""The findings tests' run shape (tests/test_findings_corpus.py); a case's own ``steps`` or size wins."""


def _show(pairs: list[tuple[str, str]] | Counter[tuple[str, str]]) -> str:
    return " ".join(f"{code}:{severity}" for code, severity in sorted(pairs)) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 11])
    parser.add_argument("--cases", nargs="+", help="case names (default: every fault magnitude and control)")
    args = parser.parse_args()
    cases = [*(c for cs in FAULTS.values() for c in cs), *CONTROLS.values()]
    if args.cases:
        unknown = set(args.cases) - {c.name for c in cases}
        if unknown:
            parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c.name in args.cases]
    start = time.time()
    differ = 0
    print("| case | seed | analyze (code:severity) | replay equal | difference (analyze only / replay only) |")
    print("|---|---|---|---|---|")
    for case in cases:
        for seed in args.seeds:
            outcome = run_case(case, seed, base=SIZE, replayed=True)
            offline, online = graded(outcome.findings), graded(outcome.replayed or [])
            equal = offline == online
            diff = ""
            if not equal:
                differ += 1
                only_offline = Counter(offline) - Counter(online)
                only_online = Counter(online) - Counter(offline)
                diff = f"{_show(only_offline)} / {_show(only_online)}"
            print(f"| {case.name} | {seed} | {_show(offline)} | {'yes' if equal else 'NO'} | {diff} |", flush=True)
    runs = len(cases) * len(args.seeds)
    print(f"\n{runs} dumps ({len(cases)} cases x seeds {', '.join(map(str, args.seeds))}): "
          f"{runs - differ} equal, {differ} differ ({time.time() - start:.0f} s)", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
