"""``check`` computes only the groups its rules and detectors read (``check_groups``), with the same rule results
and findings as computing every figure: compared on the sample dump and on simulated faulty dumps, and each
detector's declared inputs checked against the keys it actually reads."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from simulate import fault_config, simulate

from grpo_cli.commands.analyze import analyze
from grpo_cli.commands.check import (
    analyze_config,
    check_groups,
    grouped_by,
    load_rules,
    parse_rules,
    preset,
    run_check,
)
from grpo_cli.engine.group import per_key
from grpo_cli.findings import DetectConfig, detector_inputs
from grpo_cli.findings._base import _Ctx
from grpo_cli.findings.detect import DETECTORS
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data" / "rollouts.parquet"
_SMALL = {"prompts_per_step": 8}
_FAULTS = ("shift_late", "mismatch", "weight_sync", "adv_sign", "staleness", "heavy_tails", "mask_prompt",
           "ref_old", "prox_lag")
_RULES = """
[[rule]]
metric = "kl/k3"
max = 0.5
[[rule]]
metric = "clip/ratio"
max = 0.3
per = "step"
[[rule]]
metric = "is/ess"
min = 0.5
optional = true
"""
_SELECTIONS: tuple[tuple[list[str] | None, tuple[str, ...]], ...] = (
    (None, ()), (["GRP2"], ()), (["alignment", "advantage"], ()), (None, ("GRP1", "clipping")),
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {"sample": SAMPLE}
    for fault in _FAULTS:
        path = tmp_path_factory.mktemp(fault)
        simulate(fault_config(fault, 0.5, **_SMALL), path)
        out[fault] = path
    return out


def _outcome(report: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    # Keep the figures the rules read (plus the counts), not every figure the full run reports.
    return [r.to_json() for r in report.results], report.findings, report.summary()


def _both(path: Path, rules_text: str | None, select: list[str] | None, ignore: tuple[str, ...],
          findings: DetectConfig) -> Iterator[Any]:
    rule_set = preset("sanity")
    if rules_text is not None:
        rule_set = rule_set.merge(parse_rules(rules_text, "rules.toml"))
    config, require_valid = analyze_config(rule_set)
    for every in (True, False):
        yield run_check(RolloutDataset([str(path)]), rule_set, config, require_valid_input=require_valid,
                        findings=findings, select=select, ignore=ignore, all_figures=every)


@pytest.mark.parametrize("name", ["sample", *_FAULTS])
def test_selected_groups_give_the_same_rules_and_findings(dumps, name):
    findings = DetectConfig(prox_approximation="loglinear") if name == "prox_lag" else DetectConfig()
    for select, ignore in _SELECTIONS if name != "sample" else _SELECTIONS[:1]:
        full, selected = _both(dumps[name], _RULES, select, ignore, findings)
        assert _outcome(selected) == _outcome(full), (name, select, ignore)
        assert set(selected.metrics) < set(full.metrics)  # fewer figures were computed
        for key in ("kl/k3", "clip/ratio", "n_valid_tokens", "invalid/n_sequences_skipped"):
            assert selected.metrics.get(key) == full.metrics.get(key)


def test_the_sample_rules_file_gives_the_same_report(dumps):
    rule_set = load_rules(ROOT / "sample_data" / "rules.toml").merge(preset("sanity"))
    config, require_valid = analyze_config(rule_set)
    full, selected = (run_check(RolloutDataset([str(SAMPLE)]), rule_set, config, require_valid_input=require_valid,
                                all_figures=every) for every in (True, False))
    assert _outcome(selected) == _outcome(full)
    assert len(full.results) > 5


def test_an_invalid_value_in_a_column_no_selected_group_reads_still_fails(tmp_path):
    """Validation reads every column a full run reads: a NaN ref_logp fails 'input passes validation' even when no
    rule or detector reads ref_logp."""
    table = pq.read_table(SAMPLE)
    column = table.column("ref_logp").combine_chunks()
    values = column.flatten().to_numpy().copy()
    offsets = column.offsets.to_numpy()
    values[offsets[0]:offsets[1]] = np.nan  # every token of the first sequence, its valid ones included
    broken = pa.ListArray.from_arrays(column.offsets, pa.array(values, pa.float32()))
    table = table.set_column(table.column_names.index("ref_logp"), "ref_logp", broken)
    path = tmp_path / "broken.parquet"
    pq.write_table(table, path)
    full, selected = _both(path, '[[rule]]\nmetric = "n_valid_tokens"\nmin = 1\n', ["GRP304"], (), DetectConfig())
    assert _outcome(selected) == _outcome(full)
    statuses = {r["name"]: r["status"] for r in _outcome(selected)[0]}
    assert statuses["input passes validation"] == "fail"
    assert statuses["sanity: no NaN/inf log-prob"] == "fail"


def test_check_groups_runs_only_what_is_named():
    rule_set = parse_rules('[[rule]]\nmetric = "kl/k3"\nmax = 1\n')
    groups, diagnosis = check_groups(rule_set.rules, select=["GRP304"])
    names = [g.name for g in groups]
    assert names == ["invalid", "counts", "policy", "sequences"]  # kl/k3 is the policy group's
    assert diagnosis == ["diag/groups"]  # GRP304 grades its fraction by the number of groups
    everything = check_groups([], select=None)
    assert len(everything[1]) == 8 and len(everything[0]) < len(default_groups())


def test_only_the_groups_of_per_rules_run_per_value():
    """A ``per`` rule's pass runs per value only the groups its metrics come from (validation, counts and policy
    always); the others, there for overall rules and the detectors, run over the whole dump only. That per-value
    figures stay the same bits is checked above: every rule result equals the run computing everything per step."""
    rule_set = parse_rules('[[rule]]\nmetric = "staleness/theta_mean"\nmax = 9\n'
                           '[[rule]]\nmetric = "is/ess"\nmin = 0.1\nper = "step"\n'
                           '[[rule]]\nmetric = "n_valid_tokens"\nmin = 1\nper = "group_id"\n')
    groups, _ = check_groups(rule_set.rules, select=[])
    assert [g.name for g in groups] == ["invalid", "counts", "policy", "importance", "staleness"]
    assert [g.name for g in per_key(grouped_by(groups, rule_set.rules, "step"))] == [
        "invalid", "counts", "policy", "importance"]
    assert [g.name for g in per_key(grouped_by(groups, rule_set.rules, "group_id"))] == ["invalid", "counts", "policy"]
    assert [g.name for g in grouped_by(groups, rule_set.rules, "step")] == [g.name for g in groups]  # all overall
    assert per_key(groups) == groups  # the copies leave check_groups' own groups as they were
    assert grouped_by(None, rule_set.rules, "step") is None  # --save-baseline: every group, per value too


class _Recording(dict):  # type: ignore[type-arg]
    """A figures dict that records every key read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def test_every_detector_reads_only_what_it_declares(dumps):
    """Each detector, given every figure of a faulty dump, reads only the counts, the keys it declares and the
    ``diag/*`` keys of the findings-only groups it declares."""
    produced: dict[str, set[str]] = {}
    from grpo_cli.metrics.diagnosis import diagnosis_groups

    for name in ("weight_sync", "prox_lag", "mask_prompt"):
        dataset = RolloutDataset([str(dumps[name])])
        full = analyze(dataset, AnalyzeConfig(), findings=DetectConfig())
        for group in diagnosis_groups():
            only = analyze(dataset, AnalyzeConfig(), groups=[], findings=DetectConfig(), diagnosis=[group.name])
            produced.setdefault(group.name, set()).update(only.evidence)
        figures = {**full.metrics, **full.evidence}
        for detector in DETECTORS:
            recording = _Recording(figures)
            detector.run(_Ctx(recording, [], DetectConfig(prox_approximation="loglinear")))
            allowed = {"n_valid_tokens", "n_sequences"} | {k for g in detector.groups for k in produced[g]}
            undeclared = {k for k in recording.read - allowed
                          if not any(fnmatch.fnmatchcase(k, p) for p in detector.keys)}
            assert not undeclared, (detector.codes, undeclared)


def test_detector_inputs_include_the_causes_that_demote():
    keys, groups = detector_inputs(["GRP202"])
    # GRP101/104, GRP201 and GRP102/103/108 can demote a mismatch
    assert {"diag/shift", "diag/zeros", "diag/by_step", "diag/pairs"} <= set(groups)
    keys, groups = detector_inputs(["GRP304"])
    assert (keys, groups) == (["groups/zero_std_frac"], ["diag/groups"])
