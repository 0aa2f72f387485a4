"""``analyze --select``: only the named groups (or the groups of key patterns) are computed; their figures equal the
full run's."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_cli.cli import main

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"


def _metrics(capsys, *args):
    assert main(["analyze", str(SAMPLE), "-f", "json", "-q", "--no-findings", *args]) == 0
    return json.loads(capsys.readouterr().out)["metrics"]


def test_select_computes_only_the_named_groups_with_the_same_values(capsys):
    full = _metrics(capsys)
    some = _metrics(capsys, "--select", "is/*", "--select", "staleness")
    assert {k for k in some if k.startswith("is/")} == {k for k in full if k.startswith("is/")}
    assert "staleness/theta_mean" in some and "loss/ppo" not in some and "abs_diff/p50" not in some
    assert all(some[k] == full[k] for k in some)


def test_an_unknown_selection_is_a_usage_error(capsys):
    assert main(["analyze", str(SAMPLE), "--select", "nope"]) == 2
    assert "--select: nope names no group" in capsys.readouterr().err
