"""The findings on the physically real corpus (a tiny LM trained by an asynchronous GRPO loop, faults injected where
stacks break; ``grpo_cli.commands.corpus``), with a seed the detectors were never tuned on.

Everything is read from the CLI's JSON or screen, as users script against it: every fault at its realistic magnitude
is named in its category at warning or error, no healthy control raises a warning or an error, the named rows are the
broken ones, the temperature ratio is recovered, and a CI-sized dump with a temperature bug fails ``check``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from grpo_cli.cli import main
from grpo_cli.commands.corpus import RunSpec, generate_run
from grpo_cli.commands.corpus_catalog import CONTROLS, FAULTS, Case
from grpo_cli.findings.catalog import RULES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _corpus_eval import Outcome, analyze_json, graded, options_of, replay

SEED = 7
"""Not a seed the thresholds were looked at with (those were 1 and 2)."""
_SIZE = {"steps": 6, "prompts_per_step": 12}
_CACHE: dict[str, tuple[Outcome, dict[str, Any], Path]] = {}
REALISTIC = [cases[0] for cases in FAULTS.values()]


def _outcome(case: Case, tmp_path_factory: pytest.TempPathFactory) -> tuple[Outcome, dict[str, Any]]:
    """The case's findings (generated and analysed once per session) and its analyze JSON."""
    return _cached(case, tmp_path_factory)[:2]  # type: ignore[return-value]


def _cached(case: Case, tmp_path_factory: pytest.TempPathFactory) -> tuple[Outcome, dict[str, Any], Path]:
    if case.name not in _CACHE:
        path = tmp_path_factory.mktemp(case.name.replace("@", "-"))
        spec = RunSpec(seed=SEED, **{**_SIZE, **case.spec})
        info = generate_run(spec, path)
        doc = analyze_json(path, *options_of(case))
        _CACHE[case.name] = (Outcome(case, SEED, doc["findings"], info.hit, info.n_sequences), doc, path)
    return _CACHE[case.name]


@pytest.mark.parametrize("case", [*REALISTIC, *CONTROLS.values()], ids=lambda c: c.name)
def test_a_step_by_step_replay_ends_with_the_same_findings(
    case: Case, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``grpo_cli.Diagnoser`` fed each part file as a training step reports, at the end, ``analyze``'s codes at
    ``analyze``'s severities: one implementation online and offline."""
    outcome, _, path = _cached(case, tmp_path_factory)
    diagnoser, _ = replay(sorted(path.glob("part-*.parquet")), case.options)
    assert graded(diagnoser.findings()) == graded(outcome.findings)


@pytest.mark.parametrize("case", REALISTIC, ids=lambda c: c.name)
def test_every_fault_is_named_in_its_category(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    outcome, _ = _outcome(case, tmp_path_factory)
    loud = [(f["code"], f["category"], f["severity"]) for f in outcome.loud()]
    assert outcome.named(), f"{case.name}: expected {case.category} at warning/error, got {loud}"


@pytest.mark.parametrize("case", [c for c in REALISTIC if c.localised], ids=lambda c: c.name)
def test_named_rows_are_the_broken_ones(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    outcome, _ = _outcome(case, tmp_path_factory)
    precision = outcome.precision()
    assert precision is not None, f"{case.name}: the finding names no rows"
    assert precision >= 0.9


@pytest.mark.parametrize("case", list(CONTROLS.values()), ids=lambda c: c.name)
def test_healthy_controls_raise_nothing_above_info(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    outcome, _ = _outcome(case, tmp_path_factory)
    assert [(f["code"], f["severity"], f["title"]) for f in outcome.findings
            if f["severity"] in ("warning", "error", "inconclusive")] == []


@pytest.mark.parametrize("case", FAULTS["temperature"], ids=lambda c: c.name)
def test_temperature_ratio_is_recovered_with_an_interval_that_covers_it(
    case: Case, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outcome, _ = _outcome(case, tmp_path_factory)
    (finding,) = [f for f in outcome.findings if f["code"] == "GRP102"]
    ratio = finding["evidence"]["diag/temperature_ratio"]
    truth = case.spec["behaviour_temperature"] / 1.0
    assert math.isclose(ratio["value"], truth, rel_tol=0.15)
    assert ratio["low"] <= truth <= ratio["high"]


def _run_small(tmp_path: Path, **spec: Any) -> Path:
    generate_run(RunSpec(seed=SEED + 1, steps=4, prompts_per_step=2, **spec), tmp_path)
    return tmp_path


def test_ci_sized_dump_with_a_temperature_bug_fails_check_with_the_fix_on_the_first_screen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _run_small(tmp_path, behaviour_temperature=0.7)
    assert main(["check", str(path)]) == 1
    screen = capsys.readouterr().out.splitlines()[:40]
    text = "\n".join(screen)
    assert "GRP102" in text and "error" in text
    assert f"fix: {RULES['GRP102'].fix[:40]}" in text


def test_its_healthy_twin_passes_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run_small(tmp_path)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GRP102" not in out


def test_small_dump_findings_are_not_silenced(tmp_path: Path) -> None:
    """64 sequences: the temperature bug is an error on evidence alone (no size cap), with its interval."""
    doc = analyze_json(_run_small(tmp_path, behaviour_temperature=0.7))
    (finding,) = [f for f in doc["findings"] if f["code"] == "GRP102"]
    assert finding["severity"] == "error"
    ev = finding["evidence"]["diag/temperature_ratio"]
    assert set(ev) >= {"value", "low", "high", "threshold"}
    assert ev["low"] < ev["value"] < ev["high"]
