"""`grpo-cli check`: rules files, every rule kind, exit codes, per-step gates, baselines and CI reports.

Expected figures come from ``reference.policy_reference`` (plain float64 loops over the sequences) or from numpy on
the Parquet file, never from grpo-cli itself; thresholds are placed around those reference values.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import Seq, policy_reference, random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.commands.check import (
    Baseline,
    Rule,
    Severity,
    Status,
    evaluate_rule,
    parse_rules,
    sanity_figures,
)
from grpo_cli.errors import UsageError

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


def run(capsys, *args):
    """``grpo-cli ARGS``; a ``check`` here tests rules, so the findings of the random test dumps (whose log-probs
    disagree and whose advantages ignore the rewards, as faults do) are ignored unless the test picks detectors."""
    argv = [str(a) for a in args]
    if argv and argv[0] == "check" and "--select" not in argv and "--ignore" not in argv:
        argv += ["--ignore", "GRP"]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def rules_file(tmp_path: Path, text: str, name: str = "rules.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def drifted_sequences() -> list[Seq]:
    """40 sequences, steps 0..3 (index // 10); step 2's behaviour log-probs are shifted by −1 nat, so its
    d = new − old is +1 and its KL is far above the other steps'."""
    seqs = random_sequences(40, seed=11)
    for s in seqs[20:30]:
        s.old = [x - 1.0 for x in s.new]
    return seqs


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("check") / "d.parquet"
    seqs = drifted_sequences()
    write_sequences(str(path), seqs, row_group_size=7)
    return path, seqs


def step_reference(seqs: list[Seq], key: str) -> dict[int, float]:
    steps = sorted({s.step for s in seqs})
    return {step: policy_reference([s for s in seqs if s.step == step])[key] for step in steps}


# -- evaluation of each rule kind (hand-derived limits) -------------------------------------------------------------


def result_of(rule: Rule, value, base: float | None = None):
    baseline = Baseline("base.json", {rule.metric: base}) if base is not None else None
    return evaluate_rule(rule, {rule.metric: value}, {}, baseline)


@pytest.mark.parametrize(
    "rule, value, base, status, fragment",
    [
        (Rule("kl/k3", max=0.05), 0.05, None, Status.PASS, ""),  # bounds are inclusive
        (Rule("kl/k3", max=0.05), 0.0500001, None, Status.FAIL, "is above max 0.05"),
        (Rule("n_valid_tokens", min=10), 10, None, Status.PASS, ""),
        (Rule("n_valid_tokens", min=10), 9, None, Status.FAIL, "= 9 is below min 10"),
        (Rule("clip/ratio", min=0.1, max=0.2), 0.25, None, Status.FAIL, "above max 0.2"),
        (Rule("clip/ratio", min=0.1, max=0.2), 0.05, None, Status.FAIL, "below min 0.1"),
        # max_rel_increase 0.5 on base 0.02: limit 0.02 + 0.5·0.02 = 0.03
        (Rule("kl/k3", max_rel_increase=0.5), 0.03, 0.02, Status.PASS, ""),
        (Rule("kl/k3", max_rel_increase=0.5), 0.031, 0.02, Status.FAIL, "baseline 0.02 +50% = 0.03"),
        # a negative base: (v − b)/|b| ≤ 0.5 ⇔ v ≤ −0.02 + 0.01 = −0.01
        (Rule("logp/diff_mean", max_rel_increase=0.5), -0.011, -0.02, Status.PASS, ""),
        (Rule("logp/diff_mean", max_rel_increase=0.5), -0.009, -0.02, Status.FAIL, "= -0.01"),
        # base 0: any increase is infinite, so the limit is 0
        (Rule("clip/ratio", max_rel_increase=10.0), 0.0, 0.0, Status.PASS, ""),
        (Rule("clip/ratio", max_rel_increase=10.0), 1e-9, 0.0, Status.FAIL, "above baseline 0 +1000%"),
        # max_abs_change 0.25 on base 1: [0.75, 1.25]
        (Rule("ratio/max", max_abs_change=0.25), 1.25, 1.0, Status.PASS, ""),
        (Rule("ratio/max", max_abs_change=0.25), 1.3, 1.0, Status.FAIL, "above baseline 1 + 0.25 = 1.25"),
        (Rule("ratio/max", max_abs_change=0.25), 0.7, 1.0, Status.FAIL, "below baseline 1 − 0.25 = 0.75"),
        # several bounds intersect: max 1.2 binds before base + 0.25 = 1.25
        (Rule("ratio/max", max=1.2, max_abs_change=0.25), 1.22, 1.0, Status.FAIL, "above max 1.2"),
        # non-finite values violate every rule
        (Rule("kl/k3", min=0.0), math.nan, None, Status.FAIL, "kl/k3 is NaN"),
        (Rule("kl/k3", min=0.0), math.inf, None, Status.FAIL, "kl/k3 is +inf"),
        (Rule("prox/linear/max_safe_lag", min=1), None, None, Status.FAIL, "has no value (null)"),
        (Rule("kl/k3", max=0.01, severity="warn"), 0.02, None, Status.WARN, "above max 0.01"),
    ],
)
def test_each_rule_kind(rule, value, base, status, fragment):
    result = result_of(rule, value, base)
    assert result.status is status, result.message
    assert fragment in result.message


def test_per_group_reports_the_worst_group_and_every_violation():
    groups = {"step": [{"key": k, "metrics": {"kl/k3": v}} for k, v in [(0, 0.01), (1, 0.3), (2, 0.5), (3, 0.02)]]}
    rule = Rule("kl/k3", max=0.1, per="step", hint="look at the sampler")
    result = evaluate_rule(rule, {"kl/k3": 0.2}, groups, None)
    assert result.status is Status.FAIL
    assert (result.group, result.value, result.n_groups) == (2, 0.5, 4)
    assert result.violations == [{"group": 2, "value": 0.5}, {"group": 1, "value": 0.3}]  # worst first
    assert "at step 2; 2 of 4 steps violate: 2, 1 — look at the sampler" in result.message
    # Passing: the group closest to the bound is reported.
    result = evaluate_rule(Rule("kl/k3", max=1.0, per="step"), {}, groups, None)
    assert result.status is Status.PASS and result.group == 2 and result.where == "step 2 (closest of 4)"
    # A group without the figure (no valid token there) is not evaluated.
    groups["step"].append({"key": 4, "metrics": {}})
    assert evaluate_rule(Rule("kl/k3", max=1.0, per="step"), {}, groups, None).n_groups == 4


def test_missing_metric_is_an_error_unless_optional():
    omitted = {"kl/k3": "needs an 'old_logp' column"}
    with pytest.raises(UsageError, match="cannot be computed for this dump: needs an 'old_logp' column"):
        evaluate_rule(Rule("kl/k3", max=1), {}, {}, None, omitted=omitted)
    skipped = evaluate_rule(Rule("kl/k3", max=1, optional=True), {}, {}, None, omitted=omitted)
    assert skipped.status is Status.SKIPPED and "old_logp" in skipped.message
    with pytest.raises(UsageError, match="not a number"):
        evaluate_rule(Rule("top_kl", max=1), {"top_kl": [{"kl": 1.0}]}, {}, None)


def test_sanity_figures_sum_the_validation_counts():
    # Two columns' NaN counts add up; positive counts are separate; absent reasons are 0.
    metrics = {"invalid/new_logp_not_finite": 2, "invalid/ref_logp_not_finite": 1, "invalid/old_logp_positive": 4,
               "invalid/entropy_not_finite": 7}
    assert sanity_figures(metrics) == {"sanity/n_nonfinite_logp": 3, "sanity/n_positive_logp": 4}
    assert sanity_figures({}) == {"sanity/n_nonfinite_logp": 0, "sanity/n_positive_logp": 0}


# -- rules files ------------------------------------------------------------------------------------------------------


def test_parse_rules_file():
    rs = parse_rules(
        '[analyze]\nepsilon = 0.28\n\n[[rule]]\nmetric = "clip/ratio"\nmax = 0.2\nseverity = "warn"\nper = "step"\n'
        '\n[[rule]]\nmetric = "kl/k3"\nmax_rel_increase = 0.5\nname = "kl drift"\n',
        "r.toml",
    )
    first, second = rs.rules
    assert first.severity is Severity.WARN and first.per == "step" and first.label == "clip/ratio per step"
    assert second.label == "kl drift" and second.needs_baseline and second.source == "r.toml rule 2 (kl/k3)"
    assert rs.analyze == {"epsilon": 0.28}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('[[rule]]\nmetric = "kl/k3"\nmaxx = 1\n', "rule 1 (kl/k3): unknown key 'maxx' (did you mean 'max'"),
        ("[[rule]]\nmax = 1\n", "rule 1: 'metric' is required"),
        ('[[rule]]\nmetric = "kl/k3"\n', "no bound"),
        ('[[rule]]\nmetric = "kl/k3"\nmax = 1\nseverity = "fatal"\n', "'severity' must be 'error' or 'warn'"),
        ('[[rule]]\nmetric = "kl/k3"\nmax = 1\nper = 3\n', "'per' must be a per-sequence column name"),
        ('[[rule]]\nmetric = "kl/k3"\nmin = 2\nmax = 1\n', "min 2 is above max 1"),
        ('[[rule]]\nmetric = "kl/k3"\nmax = "high"\n', "'max' must be a number"),
        ('[[rule]]\nmetric = "kl/k3"\nmax_abs_change = -1\n', "'max_abs_change' must be >= 0"),
        ('[[rule]]\nmetric = "kl/k3"\nmax = nan\n', "'max' must be finite"),
        ("[[rule]\n", "not valid TOML"),
        ('[[rules]]\nmetric = "kl/k3"\n', "unknown top-level key 'rules' (did you mean 'rule'"),
        ('rule = "x"\n', "'rule' must be an array of tables"),
    ],
)
def test_rules_file_errors(text, fragment):
    with pytest.raises(UsageError, match=None) as info:
        parse_rules(text, "r.toml")
    assert fragment in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(UsageError) as info:
        parse_rules('[[rule]]\nmetric = "a"\nmaxx = 1\n[[rule]]\nmetric = "b"\nmax = 1\nseverity = "x"\n', "r.toml")
    assert "rule 1 (a)" in str(info.value) and "rule 2 (b)" in str(info.value)


# -- the command: exit codes ------------------------------------------------------------------------------------------


def test_pass_warn_fail_and_warn_only(capsys, tmp_path, dump):
    path, seqs = dump
    kl = policy_reference(seqs)["kl/k3"]
    passing = rules_file(tmp_path, f'[[rule]]\nmetric = "kl/k3"\nmax = {kl * 1.01}\n')
    code, out, _ = run(capsys, "check", path, "--rules", passing, "-f", "json")
    doc = json.loads(out)
    assert code == 0 and doc["summary"]["status"] == "pass" and doc["schema_version"] == 1
    (rule,) = [r for r in doc["rules"] if r["metric"] == "kl/k3"]
    assert rule["value"] == pytest.approx(kl, rel=1e-6) and rule["status"] == "pass" and rule["group"] is None
    assert set(rule) >= {"metric", "value", "bound", "status", "group", "severity", "message"}
    assert doc["metrics"]["kl/k3"] == pytest.approx(kl, rel=1e-6)  # so the document can serve as a baseline
    assert "loss/grpo" not in doc["metrics"]  # a gate computes only the loss figures its rules name

    warning = rules_file(tmp_path, f'[[rule]]\nmetric = "kl/k3"\nmax = {kl * 0.99}\nseverity = "warn"\n', "w.toml")
    code, out, _ = run(capsys, "check", path, "--rules", warning, "-f", "json")
    assert code == 0 and json.loads(out)["summary"]["status"] == "warn"

    failing = rules_file(tmp_path, f'[[rule]]\nmetric = "kl/k3"\nmax = {kl * 0.99}\n', "f.toml")
    code, out, err = run(capsys, "check", path, "--rules", failing)
    assert code == 1 and "FAIL" in out and "kl/k3" in err and "Traceback" not in err
    code, out, _ = run(capsys, "check", path, "--rules", failing, "--warn-only", "-f", "json")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["status"] == "fail" and summary["warn_only"] is True


def test_every_rule_is_evaluated(capsys, tmp_path, dump):
    path, seqs = dump
    ref = policy_reference(seqs)
    text = "".join(
        f'[[rule]]\nmetric = "{key}"\nmax = {ref[key] * 0.5}\n' for key in ("kl/k3", "clip/ratio", "ratio/max")
    )
    code, out, _ = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json")
    doc = json.loads(out)
    assert code == 1 and [r["status"] for r in doc["rules"]] == ["pass", "fail", "fail", "fail"]
    assert doc["rules"][0]["name"] == "input passes validation"
    assert doc["summary"]["n_failed"] == 3


@pytest.mark.parametrize(
    "rule, fragment",
    [
        ('metric = "kl/k33"\nmax = 1', "unknown metric 'kl/k33' (did you mean 'kl/k3'"),
        ('metric = "kl/k3"\nmax_rel_increase = 1', "need --baseline"),
        ('metric = "kl/k3"\nmax = 1\nper = "step"', "per = 'step' but the dump has no 'step' column"),
    ],
)
def test_usage_errors_exit_2(capsys, tmp_path, rule, fragment):
    seqs = random_sequences(10, seed=2)
    for s in seqs:
        s.step = None
    path = tmp_path / "nostep.parquet"
    write_sequences(str(path), seqs)
    code, out, err = run(capsys, "check", path, "--rules", rules_file(tmp_path, f"[[rule]]\n{rule}\n"))
    assert code == 2 and fragment in err and out == "" and "Traceback" not in err


def test_metric_the_data_cannot_provide_exits_2(capsys, tmp_path):
    seqs = random_sequences(10, seed=5)
    for s in seqs:
        s.old = None
    path = tmp_path / "noold.parquet"
    write_sequences(str(path), seqs)
    rules = rules_file(tmp_path, '[[rule]]\nmetric = "kl/k3"\nmax = 1\n[[rule]]\nmetric = "n_tokens"\nmin = 1\n')
    code, _, err = run(capsys, "check", path, "--rules", rules)
    assert code == 2 and "'kl/k3' cannot be computed for this dump: needs an 'old_logp' column" in err
    optional = rules_file(tmp_path, '[[rule]]\nmetric = "kl/k3"\nmax = 1\noptional = true\n', "o.toml")
    code, out, _ = run(capsys, "check", path, "--rules", optional, "-f", "json")
    assert code == 0 and json.loads(out)["rules"][1]["status"] == "skipped"


def test_empty_and_invalid_input_exit_2(capsys, tmp_path):
    rules = rules_file(tmp_path, '[[rule]]\nmetric = "n_tokens"\nmin = 0\n')
    masked = random_sequences(5, seed=1)
    for s in masked:
        s.mask = [0] * len(s.new)
    write_sequences(str(tmp_path / "masked.parquet"), masked)
    code, _, err = run(capsys, "check", tmp_path / "masked.parquet", "--rules", rules)
    assert code == 2 and "no valid tokens" in err  # a rule that passes trivially cannot rescue an empty dump
    schema = pa.schema([("new_logp", pa.list_(pa.float32())), ("loss_mask", pa.list_(pa.int8()))])
    pq.write_table(schema.empty_table(), tmp_path / "empty.parquet")
    code, _, err = run(capsys, "check", tmp_path / "empty.parquet", "--rules-preset", "sanity")
    assert code == 2 and "no rows" in err
    (tmp_path / "junk.parquet").write_text("not parquet")
    code, _, err = run(capsys, "check", tmp_path / "junk.parquet", "--rules", rules)
    assert code == 2 and "not a readable Parquet file" in err
    # Without rules, check runs its built-in detectors: an all-masked dump still never passes.
    code, _, err = run(capsys, "check", tmp_path / "masked.parquet")
    assert code == 2 and "no valid tokens" in err
    code, _, err = run(capsys, "check", tmp_path / "masked.parquet", "--rules", tmp_path / "nope.toml")
    assert code == 2 and "cannot read" in err
    code, _, err = run(capsys, "check", tmp_path / "masked.parquet", "--rules-preset", "santy")
    assert code == 2 and "did you mean 'sanity'" in err


def test_invalid_values_fail_the_check_and_the_sanity_preset(capsys, tmp_path):
    seqs = random_sequences(20, seed=6)
    seqs[3].new[-1] = float("nan")  # the last token is always valid (prompts come first)
    seqs[8].old[-1] = 0.5
    path = tmp_path / "bad.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "check", path, "--rules-preset", "sanity", "-f", "json")
    doc = json.loads(out)
    status = {r["name"]: r["status"] for r in doc["rules"]}
    assert code == 1
    assert status["input passes validation"] == "fail"
    assert status["sanity: no NaN/inf log-prob"] == "fail" and status["sanity: log-probs <= 0"] == "fail"
    assert status["sanity: at least one valid token"] == "pass"
    assert doc["metrics"]["sanity/n_nonfinite_logp"] == 1 and doc["metrics"]["sanity/n_positive_logp"] == 1
    assert doc["metrics"]["n_sequences"] == 18  # the other figures leave the two bad sequences out
    # --on-invalid error stops at the first offender (exit 2); an explicit skip accepts the dropped sequences.
    code, _, err = run(capsys, "check", path, "--rules-preset", "sanity", "--on-invalid", "error")
    assert code == 2 and "row 3" in err and "new_logp" in err
    rules = rules_file(tmp_path, '[[rule]]\nmetric = "n_sequences"\nmin = 1\n')
    code, out, err = run(capsys, "check", path, "--rules", rules, "--on-invalid", "skip", "-f", "json")
    assert code == 0 and len(json.loads(out)["rules"]) == 1 and "skipped 2" in err


# -- per-step gates ---------------------------------------------------------------------------------------------------


def test_per_step_failure_names_the_step(capsys, tmp_path, dump):
    path, seqs = dump
    per_step = step_reference(seqs, "kl/k3")
    ranked = sorted(per_step, key=per_step.get, reverse=True)
    worst, runner_up = ranked[0], ranked[1]
    bound = (per_step[worst] + per_step[runner_up]) / 2  # exactly one step violates
    overall = policy_reference(seqs)["kl/k3"]
    assert overall < bound  # the overall figure alone would pass: only the per-step rule catches it
    text = f'[[rule]]\nmetric = "kl/k3"\nmax = {bound}\nper = "step"\n[[rule]]\nmetric = "kl/k3"\nmax = {bound}\n'
    code, out, err = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json")
    doc = json.loads(out)
    per_rule, overall_rule = doc["rules"][1], doc["rules"][2]
    assert code == 1 and per_rule["status"] == "fail" and overall_rule["status"] == "pass"
    assert per_rule["group"] == worst and per_rule["per"] == "step"
    assert per_rule["value"] == pytest.approx(per_step[worst], rel=1e-6)
    assert per_rule["violations"] == [{"group": worst, "value": per_rule["value"]}]
    assert per_rule["n_groups"] == len(per_step)
    assert f"at step {worst}; 1 of {len(per_step)} steps violate" in per_rule["message"]
    assert "kl/k3 per step" in err


def test_rules_on_two_grouping_columns(capsys, tmp_path, dump):
    path, seqs = dump
    n_valid = {}
    for s in seqs:
        n_valid[s.group_id] = n_valid.get(s.group_id, 0) + len(s.valid())
    smallest = min(n_valid, key=lambda g: (n_valid[g], g))
    text = (f'[[rule]]\nmetric = "n_valid_tokens"\nmin = {n_valid[smallest] + 1}\nper = "group_id"\n'
            f'[[rule]]\nmetric = "n_sequences"\nmin = 10\nmax = 10\nper = "step"\n')
    code, out, _ = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json")
    by_group, by_step = json.loads(out)["rules"][1:]
    assert code == 1
    assert by_group["status"] == "fail" and by_group["group"] == smallest and by_group["value"] == n_valid[smallest]
    assert by_step["status"] == "pass" and by_step["n_groups"] == 4


# -- baselines --------------------------------------------------------------------------------------------------------


def test_baselines_from_analyze_and_check_json(capsys, tmp_path, dump):
    path, seqs = dump
    code, out, _ = run(capsys, "analyze", path, "-f", "json")
    analyze_json = tmp_path / "analyze.json"
    analyze_json.write_text(out)
    rules = rules_file(tmp_path, '[[rule]]\nmetric = "kl/k3"\nmax_rel_increase = 0.0\n'
                                 '[[rule]]\nmetric = "clip/ratio"\nmax_abs_change = 0.0\n')
    # The same data against its own figures: zero increase and zero change pass.
    code, out, _ = run(capsys, "check", path, "--rules", rules, "--baseline", analyze_json, "-f", "json",
                       "--save-baseline", tmp_path / "saved.json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["rules"][1]["baseline"] == pytest.approx(policy_reference(seqs)["kl/k3"], rel=1e-6)
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved["tool"]["command"] == "check" and saved["metrics"]["kl/k3"] == doc["metrics"]["kl/k3"]
    assert "loss/grpo" in saved["metrics"]  # a saved baseline holds every figure, even those no rule names

    # A drifted run (every behaviour log-prob 0.5 nat lower) against each kind of baseline.
    drifted = drifted_sequences()
    for s in drifted:
        s.old = [x - 0.5 for x in s.old]
    worse = tmp_path / "worse.parquet"
    write_sequences(str(worse), drifted)
    base_kl = policy_reference(seqs)["kl/k3"]
    new_kl = policy_reference(drifted)["kl/k3"]
    assert new_kl > 1.5 * base_kl
    rel = rules_file(tmp_path, '[[rule]]\nmetric = "kl/k3"\nmax_rel_increase = 0.5\n', "rel.toml")
    for baseline in (analyze_json, tmp_path / "saved.json"):
        code, out, _ = run(capsys, "check", worse, "--rules", rel, "--baseline", baseline, "-f", "json")
        rule = json.loads(out)["rules"][1]
        assert code == 1 and rule["status"] == "fail"
        assert rule["limits"]["max"] == pytest.approx(1.5 * base_kl, rel=1e-6)
        assert "+50%" in rule["message"] and rule["value"] == pytest.approx(new_kl, rel=1e-6)


def test_baseline_problems(capsys, tmp_path, dump):
    path, _ = dump
    rules = rules_file(tmp_path, '[[rule]]\nmetric = "kl/k3"\nmax_rel_increase = 0.5\n')
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run(capsys, "check", path, "--rules", rules, "--baseline", tmp_path / "bad.json")
    assert code == 2 and "not JSON" in err
    (tmp_path / "other.json").write_text('{"rows": []}')
    code, _, err = run(capsys, "check", path, "--rules", rules, "--baseline", tmp_path / "other.json")
    assert code == 2 and "no 'metrics' object" in err
    (tmp_path / "lacks.json").write_text('{"metrics": {"n_tokens": 5}, "omitted": {"kl/k3": "needs old_logp"}}')
    code, _, err = run(capsys, "check", path, "--rules", rules, "--baseline", tmp_path / "lacks.json")
    assert code == 2 and "has no 'kl/k3' (not computed there: needs old_logp)" in err
    # A baseline computed with another ε still works, with a warning that clip figures are not comparable.
    (tmp_path / "eps.json").write_text('{"metrics": {"kl/k3": 1.0}, "config": {"epsilon": 0.28}}')
    code, _, err = run(capsys, "check", path, "--rules", rules, "--baseline", tmp_path / "eps.json")
    assert code == 0 and "epsilon: baseline 0.28, this run 0.2" in err


def test_analyze_options_from_the_rules_file(capsys, tmp_path, dump):
    path, seqs = dump
    text = '[analyze]\nepsilon = 0.3\n[[rule]]\nmetric = "clip/ratio"\nmax = 1\n'
    code, out, _ = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json")
    doc = json.loads(out)
    assert code == 0 and doc["config"]["epsilon"] == 0.3
    assert doc["metrics"]["clip/ratio"] == pytest.approx(policy_reference(seqs, eps=0.3)["clip/ratio"])
    code, out, _ = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json", "--epsilon", 0.1)
    assert json.loads(out)["metrics"]["clip/ratio"] == pytest.approx(policy_reference(seqs, eps=0.1)["clip/ratio"])
    code, _, err = run(capsys, "check", path, "--rules", rules_file(tmp_path, "[analyze]\nepsilon_hi = 1\n", "x.toml"))
    assert code == 2 and "unknown option 'epsilon_hi'" in err and "did you mean 'epsilon_high'" in err


def test_prox_rules_run_compare_prox_with_the_rules_options(capsys, tmp_path):
    seqs = random_sequences(30, seed=9, with_prox=True)
    path = tmp_path / "prox.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "compare-prox", path, "--method", "linear", "--tolerance", 0.05, "-f", "json")
    assert code == 0
    expected = json.loads(out)["metrics"]
    text = ('[compare_prox]\ntolerance = 0.05\n'
            '[[rule]]\nmetric = "prox/linear/abs_error_mean"\nmax = 100\n'
            '[[rule]]\nmetric = "prox/linear/max_safe_lag"\nmin = 1\nseverity = "warn"\n')
    code, out, _ = run(capsys, "check", path, "--rules", rules_file(tmp_path, text), "-f", "json")
    doc = json.loads(out)
    assert code == 0
    assert doc["metrics"]["prox/linear/abs_error_mean"] == expected["prox/linear/abs_error_mean"]
    lag = expected["prox/linear/max_safe_lag"]  # null when no lag is safe: a violation, like NaN
    assert doc["rules"][2]["value"] == lag
    assert doc["rules"][2]["status"] == ("pass" if lag is not None and lag >= 1 else "warn")
    assert doc["config"]["compare_prox"]["tolerance"] == 0.05
    code, _, err = run(capsys, "check", path, "--rules",
                       rules_file(tmp_path, '[[rule]]\nmetric = "prox/linear/rmse"\nmax = 1\nper = "step"\n', "p.toml"))
    assert code == 2 and "'per' is not supported for prox/ keys" in err


# -- CI reports -------------------------------------------------------------------------------------------------------


@pytest.fixture
def mixed_rules(tmp_path, dump):
    """Four rules on the drifted dump: pass, per-step fail, warn, and an optional prox rule that is skipped (the
    dump has no prox_logp)."""
    _, seqs = dump
    per_step = step_reference(seqs, "kl/k3")
    worst = max(per_step, key=per_step.get)
    text = (
        '[[rule]]\nmetric = "n_sequences"\nmin = 1\n'
        f'[[rule]]\nmetric = "kl/k3"\nmax = {per_step[worst] * 0.9}\nper = "step"\nname = "kl & drift"\n'
        '[[rule]]\nmetric = "ratio/max"\nmax = 1.0\nseverity = "warn"\n'
        '[[rule]]\nmetric = "prox/loglinear/abs_error_mean"\nmax = 1\noptional = true\n'
    )
    return rules_file(tmp_path, text), worst


def test_junit_xml(capsys, tmp_path, dump, mixed_rules):
    path, _ = dump
    rules, worst = mixed_rules
    target = tmp_path / "junit.xml"
    code, _, _ = run(capsys, "check", path, "--rules", rules, "--junit-xml", target)
    assert code == 1
    root = ET.parse(target).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    assert suite.get("tests") == "5" and suite.get("failures") == "1" and suite.get("skipped") == "1"
    cases = {case.get("name"): case for case in suite.findall("testcase")}
    assert list(cases) == ["input passes validation", "n_sequences", "kl & drift", "ratio/max",
                           "prox/loglinear/abs_error_mean"]
    failure = cases["kl & drift"].find("failure")
    assert failure is not None and f"at step {worst}" in failure.get("message")
    assert cases["n_sequences"].find("failure") is None
    assert cases["ratio/max"].find("failure") is None and "warning:" in cases["ratio/max"].find("system-out").text
    assert cases["prox/loglinear/abs_error_mean"].find("skipped") is not None


def test_github_format_and_step_summary(capsys, tmp_path, dump, mixed_rules, monkeypatch):
    path, _ = dump
    rules, worst = mixed_rules
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out, _ = run(capsys, "check", path, "--rules", rules, "-f", "github")
    assert code == 1
    lines = out.splitlines()
    errors = [line for line in lines if line.startswith("::error ")]
    warnings = [line for line in lines if line.startswith("::warning ")]
    assert len(errors) == 1 and len(warnings) == 1
    # Property values escape ':' and ',' (%3A, %2C); the message follows the second '::'.
    assert errors[0].startswith("::error title=grpo-cli check%3A kl & drift::kl/k3 = ")
    assert f"at step {worst}" in errors[0]
    assert warnings[0].startswith("::warning title=grpo-cli check%3A ratio/max::ratio/max = ")
    assert lines[-1].startswith("grpo-cli check: FAILED")
    text = summary.read_text()
    assert text.startswith("earlier step\n")  # appended, never overwritten
    assert "| status | rule | value | bound | worst group | message |" in text
    assert "❌ fail | kl & drift" in text and f"step {worst}" in text
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    code, out, _ = run(capsys, "check", path, "--rules", rules, "-f", "github")
    assert code == 1 and summary.read_text() == text


def test_table_output(capsys, dump, mixed_rules):
    path, _ = dump
    rules, worst = mixed_rules
    code, out, _ = run(capsys, "check", path, "--rules", rules)
    assert code == 1
    assert "FAIL" in out and "WARN" in out and "SKIPPED" in out and f"step {worst}" in out
    assert "FAILED — 5 rules: 1 failed (kl & drift)" in out


# -- the sample run ---------------------------------------------------------------------------------------------------


def sample_step_k3() -> dict[int, float]:
    """Per-step mean k3 (d = new − old over valid tokens) of the sample, with numpy from the Parquet file."""
    table = pq.read_table(SAMPLE / "rollouts.parquet", columns=["step", "new_logp", "old_logp", "loss_mask"])
    lengths = pa.compute.list_value_length(table["new_logp"]).to_numpy()
    step = np.repeat(table["step"].to_numpy(), lengths)
    new = pa.compute.list_flatten(table["new_logp"]).to_numpy().astype(np.float64)
    old = pa.compute.list_flatten(table["old_logp"]).to_numpy().astype(np.float64)
    mask = pa.compute.list_flatten(table["loss_mask"]).to_numpy().astype(bool)
    d = (new - old)[mask]
    k3 = np.exp(d) - 1 - d
    return {int(s): float(k3[step[mask] == s].mean()) for s in np.unique(step[mask])}


def test_sample_rules_pass_and_a_tightened_rule_fails_naming_rule_and_step(capsys, tmp_path):
    code, out, err = run(capsys, "check", SAMPLE / "rollouts.parquet", "--rules", SAMPLE / "rules.toml",
                         "--rules-preset", "sanity")
    assert code == 0, out + err
    assert "FAIL" not in out and "passed" in out
    per_step = sample_step_k3()
    worst = max(per_step, key=per_step.get)
    text = (SAMPLE / "rules.toml").read_text()
    assert 'max = 0.2\nper = "step"' in text
    tightened = rules_file(tmp_path, text.replace('max = 0.2\nper = "step"', f'max = {per_step[worst] * 0.95}\n'
                                                                             'per = "step"'))
    code, out, err = run(capsys, "check", SAMPLE / "rollouts.parquet", "--rules", tightened)
    assert code == 1
    assert "FAIL: kl/k3 per step" in out and f"at step {worst};" in out
    assert "1 failed (kl/k3 per step)" in err


def test_without_rules_no_empty_rules_line(capsys, tmp_path, dump, monkeypatch):
    # check with no --rules/--rules-preset runs only its validation rule: there is no rules file to name.
    path, _ = dump
    code, out, _ = run(capsys, "check", path)
    assert code == 0
    assert not any(line.strip() in ("rules:", "rules: ") or line.startswith("rules: ;") for line in out.splitlines())
    assert "rules:" not in out.split("\n", 2)[1]
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out, _ = run(capsys, "check", path, "-f", "github")
    assert code == 0 and "; rules:" not in summary.read_text()  # (the headline says "1 rules: 1 passed")
    code, out, _ = run(capsys, "check", path, "--rules-preset", "sanity")
    assert code == 0 and out.splitlines()[1] == "rules: preset sanity"
