"""Every metric key grpo-cli can report is documented in docs/metrics.md (the contract users script against)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.cli import main
from grpo_cli.core.prox import PROX_APPROX_METHODS
from grpo_cli.metrics.registry import KEYS

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


# `<m>` stands for each AReaL proximal approximation, `<o>` for each verl rollout_rs option, `<k1>` its k1 options.
PLACEHOLDERS = {"<m>": PROX_APPROX_METHODS, "<o>": VERL_RS_OPTIONS,
                "<k1>": tuple(o for o in VERL_RS_OPTIONS if o.endswith("k1"))}


def _documented() -> set[str]:
    names: set[str] = set()
    for token in re.findall(r"`([^`\s]+)`", DOC.read_text(encoding="utf-8")):
        names.add(token)
        for mark, values in PLACEHOLDERS.items():
            if mark in token:
                names.update(token.replace(mark, value) for value in values)
    return names


def test_every_key_is_documented():
    documented = _documented()
    # `invalid/<reason>` documents one key per validation rule (the rules are listed in docs/errors.md).
    missing = [key for key in KEYS if key not in documented and not key.startswith("invalid/")]
    assert missing == []


def test_invalid_reasons_are_listed_in_errors_doc():
    text = (DOC.parent / "errors.md").read_text(encoding="utf-8")
    # `<logp>_not_finite` there stands for each log-prob column.
    logp_columns = ("new_logp", "old_logp", "prox_logp", "ref_logp", "teacher_logp")
    listed = {t.replace("<logp>", c) for t in re.findall(r"`([^`\s]+)`", text) for c in logp_columns}
    reasons = [key.split("/", 1)[1] for key in KEYS if key.startswith("invalid/") and not key.startswith("invalid/n_")]
    assert reasons and [r for r in reasons if r not in listed] == []


def test_every_reported_key_is_declared(capsys):
    sample = DOC.parents[1] / "sample_data" / "rollouts.parquet"
    args = ["analyze", str(sample), "-f", "json", "-q", "--c-clip", "3", "--rs-upper", "2", "--m2-threshold", "0.01",
            "--max-new-tokens", "7"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    undeclared = [key for key in [*doc["metrics"], *doc["omitted"]] if key not in KEYS]
    assert undeclared == []
    assert len(doc["metrics"]) > 100
