"""`analyze --group-by`: per-group figures equal the figures of each group's sequences alone."""

from __future__ import annotations

import csv
import io
import json

import pytest
from reference import policy_reference, random_sequences, write_sequences

from grpo_cli.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_groups_match_reference_per_step(capsys, tmp_path):
    seqs = random_sequences(60, seed=8)  # step = index // 10 → steps 0..5
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=7)
    code, out, _ = run(capsys, "analyze", path, "-f", "json", "--group-by", "step", "--batch-tokens", 50)
    assert code == 0
    doc = json.loads(out)
    assert doc["config"]["group_by"] == "step"
    assert [g["key"] for g in doc["groups"]] == [0, 1, 2, 3, 4, 5]
    for group in doc["groups"]:
        subset = [s for s in seqs if s.step == group["key"]]
        ref = policy_reference(subset)
        for key, value in ref.items():
            assert group["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (group["key"], key)
        assert group["metrics"]["n_sequences"] == len(subset)
    # The overall figures are unchanged by grouping.
    code, plain, _ = run(capsys, "analyze", path, "-f", "json", "--batch-tokens", 50)
    assert json.loads(plain)["metrics"] == doc["metrics"]


def test_group_csv_and_table(capsys, tmp_path):
    seqs = random_sequences(20, seed=9)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "analyze", path, "-f", "csv", "--group-by", "step")
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["group", "metric", "value"]
    assert ["all", "n_sequences", "20"] in rows and ["1", "n_sequences", "10"] in rows
    code, out, _ = run(capsys, "analyze", path, "--group-by", "step", "--metrics", "kl/k3,clip/ratio")
    assert code == 0 and "Per step" in out
    code, _, err = run(capsys, "analyze", path, "--group-by", "step", "--metrics", "nope")
    assert code == 2 and "nope" in err


def test_group_by_missing_column(capsys, tmp_path):
    seqs = random_sequences(5, seed=1)
    for s in seqs:
        s.current_version = None
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    code, _, err = run(capsys, "analyze", path, "--group-by", "current_version")
    assert code == 2 and "no 'current_version' column" in err
