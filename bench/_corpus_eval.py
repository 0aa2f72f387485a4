"""Run corpus cases through ``grpo-cli analyze`` (in-process, JSON) and score the findings, and replay a dump step by
step into :class:`grpo_cli.Diagnoser`: shared by ``bench/power.py``, ``bench/replay_corpus.py`` and the findings and
Diagnoser tests."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli import Diagnoser
from grpo_cli.cli import main
from grpo_cli.commands.corpus import RunSpec, generate_run
from grpo_cli.commands.corpus_catalog import Case
from grpo_cli.commands.diagnoser import diagnoser_groups
from grpo_cli.core.packing import packed_to_padded
from grpo_cli.io import RolloutDataset

LOUD = ("warning", "error")
COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions", "advantages", "rewards",
           "group_id", "current_version", "eos", "seq_id", "step")
"""The dump's columns a trainer hands ``Diagnoser.update`` (besides ``loss_mask`` and the row layout)."""


@dataclass
class Outcome:
    case: Case
    seed: int
    findings: list[dict[str, Any]]
    hit: frozenset[tuple[int, int]]
    n_sequences: int
    replayed: list[dict[str, Any]] | None = None
    """The Diagnoser's findings after a step-by-step replay of the same dump (``run_case(..., replayed=True)``)."""

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


def run_case(case: Case, seed: int, base: dict[str, Any] | None = None, directory: str | None = None, *,
             replayed: bool = False) -> Outcome:
    spec = RunSpec(seed=seed, **{**(base or {}), **case.spec})
    with tempfile.TemporaryDirectory(dir=directory) as d:
        info = generate_run(spec, d)
        doc = analyze_json(d, *options_of(case))
        online = replay(info.files, case.options)[0].findings() if replayed else None
    return Outcome(case, seed, doc["findings"], info.hit, info.n_sequences, online)


def replay(files: list[Path], options: dict[str, Any], *, padded: bool = False,
           on_step: Callable[[Diagnoser], None] | None = None) -> tuple[Diagnoser, list[list[dict[str, Any]]]]:
    """Each part file is a step: its reader batches go to ``update`` (packed, or padded with ``lengths``), then
    ``step_end``; returns the diagnoser and what each ``step_end`` returned."""
    diagnoser = Diagnoser(**options)
    wanted = {"loss_mask"}.union(*(g.columns() for g in diagnoser_groups()))
    per_step = []
    for path in files:
        step = None
        for batch in RolloutDataset([path]).iter_batches(columns=wanted, raw_mask=True, batch_tokens=2000):
            given = {name: getattr(batch, name) for name in COLUMNS if getattr(batch, name) is not None}
            if padded:
                lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
                for name in ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions"):
                    given[name] = packed_to_padded(given[name], batch.cu_seqlens, pad_value=0.0)
                # per-sequence advantages ([B]), as a trainer holds them; the dump broadcast them to tokens
                given["advantages"] = given["advantages"][batch.cu_seqlens[:-1]]
                diagnoser.update(loss_mask=packed_to_padded(batch.loss_mask, batch.cu_seqlens), lengths=lengths,
                                 **given)
            else:
                diagnoser.update(loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens, **given)
            step = int(batch.step[0])
        assert step is not None, f"{path}: no rows"
        per_step.append(diagnoser.step_end(step))
        if on_step is not None:
            on_step(diagnoser)
    return diagnoser, per_step


def graded(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The findings' (code, severity) pairs, sorted: what replay equivalence compares."""
    return sorted((f["code"], f["severity"]) for f in findings)
