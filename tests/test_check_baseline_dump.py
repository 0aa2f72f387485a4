"""``check --baseline DUMP``: baseline-relative bounds fail only when the change is beyond noise (``diff``'s
jackknife interval excludes the allowed bound); a JSON baseline keeps its fixed margins."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from simulate import fault_config, healthy_async, simulate

from grpo_cli.cli import main
from grpo_cli.commands.diff import DiffConfig, diff
from grpo_cli.io.reader import RolloutDataset

_SMALL = {"prompts_per_step": 8}
# Zero allowed change: any difference at all violates the bound as a fixed margin.
_STRICT = """
[[rule]]
metric = "kl/abs_diff_mean"
max_abs_change = 0
[[rule]]
metric = "kl/k3"
max_rel_increase = 0
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, cfg in (("base", healthy_async(seed=1, **_SMALL)), ("reseeded", healthy_async(seed=2, **_SMALL)),
                      ("mismatch", fault_config("mismatch", 1.0, seed=2, **_SMALL))):
        out[name] = tmp_path_factory.mktemp(name)
        simulate(cfg, out[name])
    return out


def _check(capsys: pytest.CaptureFixture[str], tmp_path: Path, new: Path, *baseline: str | Path,
           rules: str = _STRICT, extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    rules_path = tmp_path / "rules.toml"
    rules_path.write_text(rules, encoding="utf-8")
    args = ["check", str(new), "--rules", str(rules_path), "-f", "json", "-q", *extra]
    for path in baseline:
        args += ["--baseline", str(path)]
    code = main(args)
    return code, json.loads(capsys.readouterr().out)


def _rule(doc: dict[str, Any], metric: str) -> dict[str, Any]:
    return next(r for r in doc["rules"] if r["metric"] == metric)


def test_a_reseeded_run_passes_within_noise(capsys, tmp_path, runs):
    code, doc = _check(capsys, tmp_path, runs["reseeded"], runs["base"])
    assert code == 0, [r["message"] for r in doc["rules"]]
    for metric in ("kl/abs_diff_mean", "kl/k3"):
        rule = _rule(doc, metric)
        assert rule["status"] == "pass"
        assert rule["change_low"] <= 0.0 <= rule["change_high"]  # the interval reaches the allowed change
        assert rule["change"] == pytest.approx(rule["value"] - rule["baseline"], abs=1e-15)
        assert "interval" in rule["message"]
    # The intervals are diff's: the same change and interval as `grpo-cli diff BASE NEW`.
    result = diff(RolloutDataset([str(runs["base"])]), RolloutDataset([str(runs["reseeded"])]), DiffConfig(top_k=0))
    figure = next(f for f in result.figures if f.key == "kl/abs_diff_mean")
    rule = _rule(doc, "kl/abs_diff_mean")
    assert (rule["change_low"], rule["change_high"]) == pytest.approx((figure.low, figure.high), rel=1e-9)


def test_the_same_bounds_fail_as_fixed_margins_against_a_json_baseline(capsys, tmp_path, runs):
    base_json = tmp_path / "base.json"
    assert main(["analyze", str(runs["base"]), "-f", "json", "-o", str(base_json), "-q"]) == 0
    capsys.readouterr()
    code, doc = _check(capsys, tmp_path, runs["reseeded"], base_json)
    assert code == 1
    assert {_rule(doc, m)["status"] for m in ("kl/abs_diff_mean",)} == {"fail"}
    assert _rule(doc, "kl/abs_diff_mean")["change_low"] is None


def test_an_injected_fault_fails_beyond_noise(capsys, tmp_path, runs):
    rules = '[[rule]]\nmetric = "kl/abs_diff_mean"\nmax_rel_increase = 0.5\n'
    junit = tmp_path / "check.xml"
    code, doc = _check(capsys, tmp_path, runs["mismatch"], runs["base"], rules=rules,
                       extra=("--ignore", "GRP", "--junit-xml", str(junit)))
    assert code == 1
    rule = _rule(doc, "kl/abs_diff_mean")
    assert rule["status"] == "fail"
    assert rule["change_low"] > 0.5 * abs(rule["baseline"])  # the whole interval is past the allowed increase
    assert "kl/abs_diff_mean" in rule["message"] and "interval" in rule["message"]
    failure = ET.parse(junit).getroot().find(".//testcase[@name='kl/abs_diff_mean']/failure")
    assert failure is not None and "interval" in failure.get("message", "")


def test_several_baseline_paths_are_one_run(capsys, tmp_path, runs):
    files = sorted(runs["base"].rglob("*.parquet"))
    code, doc = _check(capsys, tmp_path, runs["reseeded"], *files)
    assert code == 0
    assert doc["summary"]["baseline"] is not None


def test_the_table_shows_the_interval_of_a_failure(capsys, tmp_path, runs):
    rules_path = tmp_path / "rules.toml"
    rules_path.write_text('[[rule]]\nmetric = "kl/abs_diff_mean"\nmax_rel_increase = 0.5\n', encoding="utf-8")
    code = main(["check", str(runs["mismatch"]), "--rules", str(rules_path), "--baseline", str(runs["base"]),
                 "--ignore", "GRP", "-q"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: kl/abs_diff_mean" in out and "interval [" in out
