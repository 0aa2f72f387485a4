"""`grpo-cli analyze` end to end (in-process): figures, formats, batch independence, exit codes."""

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


@pytest.fixture
def dump(tmp_path):
    seqs = random_sequences(64, seed=21)
    path = tmp_path / "rollouts.parquet"
    write_sequences(str(path), seqs, row_group_size=9)
    return path, seqs


def test_json_matches_reference(capsys, dump):
    path, seqs = dump
    code, out, _ = run(capsys, "analyze", path, "--format", "json", "--epsilon-high", "0.28")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["tool"]["name"] == "grpo-cli"
    assert doc["config"]["epsilon_high"] == 0.28
    metrics = doc["metrics"]
    ref = policy_reference(seqs, eps_high=0.28)
    for key, value in ref.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert metrics["n_sequences"] == 64
    assert metrics["n_tokens"] == sum(len(s.new) for s in seqs)
    assert len(metrics["top_kl"]) == 10
    assert metrics["top_kl"][0]["kl"] == pytest.approx(metrics["kl/k3_token_max"])


def test_batch_tokens_do_not_change_figures(capsys, dump):
    path, _ = dump
    docs = []
    for batch_tokens in (1, 13, 100000):
        code, out, _ = run(capsys, "analyze", path, "-f", "json", "--batch-tokens", batch_tokens)
        assert code == 0
        docs.append(json.loads(out)["metrics"])
    for other in docs[1:]:
        assert other.keys() == docs[0].keys()
        for key, value in docs[0].items():
            if isinstance(value, float):
                assert other[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
            else:
                assert other[key] == value, key


def test_prox_is_the_ratio_base_and_old_the_kl_base(capsys, tmp_path):
    seqs = random_sequences(30, seed=4, with_prox=True)
    path = tmp_path / "p.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "analyze", path, "-f", "json")
    assert code == 0
    metrics = json.loads(out)["metrics"]
    ref = policy_reference(seqs)  # the reference uses prox for ratios and old for KL
    assert metrics["clip/ratio"] == pytest.approx(ref["clip/ratio"])
    assert metrics["kl/k3"] == pytest.approx(ref["kl/k3"], rel=1e-6)


def test_missing_inputs_are_omitted_with_reasons(capsys, tmp_path):
    seqs = random_sequences(10, seed=5)
    for s in seqs:
        s.old = None
        s.entropy = None
    path = tmp_path / "n.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "analyze", path, "-f", "json")
    doc = json.loads(out)
    assert code == 0
    assert "kl/k3" not in doc["metrics"] and "clip/ratio" not in doc["metrics"]
    assert "old_logp" in doc["omitted"]["kl/k3"]
    code, out, _ = run(capsys, "analyze", path, "--all")
    assert "Not computed" in out and "needs an 'entropy' column" in out


def test_table_and_csv(capsys, dump, tmp_path):
    path, _ = dump
    code, out, _ = run(capsys, "analyze", path, "--all")
    assert code == 0 and "clip/ratio" in out and "Highest-KL tokens" in out
    code, out, _ = run(capsys, "analyze", path, "-f", "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["metric", "value"]
    values = dict(rows[1:])
    assert int(values["n_sequences"]) == 64
    assert json.loads(values["top_kl"])[0]["position"] >= 0
    target = tmp_path / "report.json"
    code, out, _ = run(capsys, "analyze", path, "-f", "json", "-o", target)
    assert code == 0 and out == "" and json.loads(target.read_text())["metrics"]["n_sequences"] == 64


@pytest.mark.parametrize(
    "args, message",
    [
        (["analyze", "/nonexistent.parquet"], "no such file"),
        (["analyze", "{path}", "--epsilon", "-1"], "--epsilon must be a finite number >= 0"),
        (["analyze", "{path}", "--temperature", "0"], "--temperature must be > 0"),
        (["analyze", "{path}", "--map", "bogus=x"], "unknown column 'bogus'"),
        (["analyze", "{path}", "-o", "/nonexistent-dir/x.json"], "cannot write"),
        (["analyze", "{path}", "--bogus"], "No such option"),
    ],
)
def test_errors_exit_2_with_one_line(capsys, dump, args, message):
    path, _ = dump
    code, _, err = run(capsys, *[a.replace("{path}", str(path)) for a in args])
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and "grpo-cli" in out and "torch" in out and "pyarrow" in out
