"""Column mistakes are never silent: unread look-alike columns warn, a missing required column says what the file
has and which preset matches, a schema difference is printed as the difference, rows are 0-based everywhere."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from reference import Seq, write_sequences

from grpo_cli.cli import main


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _table(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def _lists(n=3):
    return pa.array([[-0.1, -0.2]] * n, pa.list_(pa.float32()))


def test_misspelt_optional_column_warns_with_the_map(capsys, tmp_path):
    path = _table(tmp_path / "d.parquet", {"new_logp": _lists(), "old_logprobs": _lists()})
    code, _, err = run(capsys, "analyze", path)
    assert code == 0
    assert "warning: column 'old_logprobs' looks like old_logp but is not read; --map old_logp=old_logprobs" in err
    code, _, err = run(capsys, "analyze", path, "--map", "old_logp=old_logprobs")
    assert code == 0 and "warning" not in err


def test_framework_column_names_the_preset(capsys, tmp_path):
    path = _table(tmp_path / "d.parquet", {"new_logp": _lists(), "rollout_log_probs": _lists(),
                                           "logprobs": _lists()})
    code, _, err = run(capsys, "analyze", path)
    assert code == 0
    assert "column 'rollout_log_probs' looks like old_logp" in err and "--preset verl" in err
    assert "--map old_logp=rollout_log_probs" in err
    assert "column 'logprobs' looks like old_logp" in err and "--preset areal" in err
    code, _, err = run(capsys, "analyze", path, "--preset", "verl")
    assert code == 0 and "rollout_log_probs" not in err  # read now


def test_missing_required_column_lists_columns_and_suggests_preset(capsys, tmp_path):
    path = _table(tmp_path / "d.parquet", {"log_probs": _lists(), "old_log_probs": _lists(),
                                           "rollout_log_probs": _lists(), "response_mask": _lists()})
    code, _, err = run(capsys, "analyze", path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "column 'new_logp': required column is missing (the file has: log_probs, old_log_probs" in err
    assert "--preset verl" in err


def test_schema_difference_is_printed_as_the_difference(capsys, tmp_path):
    write_sequences(str(tmp_path / "a.parquet"), [Seq(new=[-0.1, -0.2], old=[-0.1, -0.3])])
    write_sequences(str(tmp_path / "b.parquet"), [Seq(new=[-0.1, -0.2], old=[-0.1, -0.3], entropy=[0.5, 0.5])])
    code, _, err = run(capsys, "analyze", tmp_path)
    assert code == 2
    assert "schema differs from" in err and "this file also has entropy" in err and "[" not in err


def test_jsonl_rows_are_zero_based_like_parquet_rows(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"new_logp": [-0.1]}) + "\n{not json}\n")
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "o", "--from", "jsonl")
    assert code == 2 and "row 1: line 2: not JSON" in err
