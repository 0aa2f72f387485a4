"""Run corpus cases through ``grpo-cli analyze`` (in-process, JSON) and score the findings: shared by
``bench/power.py`` and the findings tests."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.cli import main
from grpo_cli.commands.corpus import RunSpec, generate_run
from grpo_cli.commands.corpus_catalog import Case

LOUD = ("warning", "error")


@dataclass
class Outcome:
    case: Case
    seed: int
    findings: list[dict[str, Any]]
    hit: frozenset[tuple[int, int]]
    n_sequences: int

    def loud(self) -> list[dict[str, Any]]:
        return [f for f in self.findings if f["severity"] in LOUD]

    def named(self) -> bool:
        return any(f["category"] in (self.case.category, *self.case.also) for f in self.loud())

    def precision(self) -> float | None:
        rows = [(w["file"], w["row"]) for f in self.loud() if f["category"] == self.case.category
                for w in (f.get("where") or {}).get("sequences", []) if w.get("row") is not None]
        if not rows:
            return None
        return sum(r in self.hit for r in rows) / len(rows)


def analyze_json(path: str | Path, *options: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["analyze", str(path), "-f", "json", "-q", *options])
    if code != 0:
        raise RuntimeError(f"analyze exited {code}: {err.getvalue()}")
    return json.loads(out.getvalue())


def options_of(case: Case) -> list[str]:
    out: list[str] = []
    for key, value in case.options.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def run_case(case: Case, seed: int, base: dict[str, Any] | None = None, directory: str | None = None) -> Outcome:
    spec = RunSpec(seed=seed, **{**(base or {}), **case.spec})
    with tempfile.TemporaryDirectory(dir=directory) as d:
        info = generate_run(spec, d)
        doc = analyze_json(d, *options_of(case))
    return Outcome(case, seed, doc["findings"], info.hit, info.n_sequences)
