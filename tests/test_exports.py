"""Exports for other tools: ``--format csv --wide`` (one row per group key, one column per figure) and
``--tensorboard DIR`` (per-step scalars; a clear exit 2 without the extra)."""

from __future__ import annotations

import csv
import io
import json
import sys
import types
from typing import ClassVar

from reference import random_sequences, write_sequences

from grpo_cli.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _dump(tmp_path):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), random_sequences(20, seed=9))
    return path


def test_wide_csv_one_row_per_group(capsys, tmp_path):
    path = _dump(tmp_path)
    code, out, _ = run(capsys, "analyze", path, "-f", "csv", "--wide", "--group-by", "step")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    code, doc, _ = run(capsys, "analyze", path, "-f", "json", "--group-by", "step")
    doc = json.loads(doc)
    assert [r["step"] for r in rows] == ["all", *(str(g["key"]) for g in doc["groups"])]
    assert float(rows[0]["kl/k3"]) == doc["metrics"]["kl/k3"]
    assert int(rows[1]["n_sequences"]) == doc["groups"][0]["metrics"]["n_sequences"]
    assert "top_kl" not in rows[0]
    code, out, _ = run(capsys, "analyze", path, "-f", "csv", "--wide")
    assert code == 0 and len(list(csv.DictReader(io.StringIO(out)))) == 1


class _FakeWriter:
    calls: ClassVar[list] = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def add_scalar(self, tag, value, global_step):
        _FakeWriter.calls.append(("scalar", tag, value, global_step))

    def add_text(self, tag, text, step):
        _FakeWriter.calls.append(("text", tag, text, step))

    def close(self):
        _FakeWriter.calls.append(("close",))


def test_tensorboard_scalars_per_step(capsys, tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _FakeWriter.calls = []
    path = _dump(tmp_path)
    code, out, err = run(capsys, "analyze", path, "--tensorboard", tmp_path / "tb", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert "groups" not in doc  # the step split was for TensorBoard only
    scalars = {(tag, step): value for kind, tag, value, step in (c for c in _FakeWriter.calls if c[0] == "scalar")}
    assert {step for _, step in scalars} == {0, 1}
    code, grouped, _ = run(capsys, "analyze", path, "-f", "json", "--group-by", "step")
    for group in json.loads(grouped)["groups"]:
        assert scalars[("grpo_cli/kl/k3", group["key"])] == group["metrics"]["kl/k3"]
    assert _FakeWriter.calls[-1] == ("close",)


def test_tensorboard_without_the_extra_is_a_usage_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    code, _, err = run(capsys, "analyze", _dump(tmp_path), "--tensorboard", tmp_path / "tb")
    assert code == 2 and "'tensorboard' extra" in err and len(err.strip().splitlines()) == 1


def test_tensorboard_without_the_extra_fails_before_reading_the_dump(capsys, tmp_path, monkeypatch):
    import grpo_cli.commands.analyze

    def must_not_run(*args, **kwargs):
        raise AssertionError("the dump was analysed before --tensorboard was checked")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(grpo_cli.commands.analyze, "analyze", must_not_run)
    code, out, err = run(capsys, "analyze", _dump(tmp_path), "--tensorboard", tmp_path / "tb")
    assert code == 2 and "'tensorboard' extra" in err and not out
