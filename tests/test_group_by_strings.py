"""``--group-by`` and ``check``'s ``per`` on any per-sequence column, strings included (task, data source)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main

TASKS = ["math", "code", "chat"]


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _with_task(tmp_path, name="d.parquet", token_layout=False, n=30, dictionary=False):
    seqs = random_sequences(n, seed=5, max_len=10)
    path = tmp_path / name
    write_sequences(str(path), seqs, row_group_size=4, token_layout=token_layout)
    table = pq.read_table(path)
    if token_layout:
        seq_ids = table.column("seq_id").to_pylist()
        task = [TASKS[s % 3] for s in seq_ids]
    else:
        task = [TASKS[i % 3] for i in range(table.num_rows)]
    array = pa.array(task)
    if dictionary:
        array = array.dictionary_encode()
    pq.write_table(table.append_column("task", array), path, row_group_size=4 * (1 if not token_layout else 10))
    return path, seqs


def _groups(doc):
    return {g["key"]: g["metrics"] for g in doc["groups"]}


def test_group_by_string_column_reports_the_strings(capsys, tmp_path):
    path, seqs = _with_task(tmp_path)
    code, out, err = run(capsys, "analyze", path, "-f", "json", "--group-by", "task")
    assert code == 0, err
    groups = _groups(json.loads(out))
    assert list(groups) == sorted(TASKS)
    assert groups["math"]["n_sequences"] == sum(1 for i in range(len(seqs)) if i % 3 == 0)
    # Each group's figures are the figures of its sequences alone.
    for index, task in enumerate(TASKS):
        part = tmp_path / f"{task}.parquet"
        write_sequences(str(part), [s for i, s in enumerate(seqs) if i % 3 == index])
        code, out, _ = run(capsys, "analyze", part, "-f", "json")
        alone = json.loads(out)["metrics"]
        assert groups[task]["kl/k3"] == alone["kl/k3"] and groups[task]["n_valid_tokens"] == alone["n_valid_tokens"]


def test_group_by_string_is_independent_of_batches_and_workers(capsys, tmp_path):
    path, _ = _with_task(tmp_path, dictionary=True)
    outs = []
    for args in (["--batch-tokens", "7"], ["--batch-tokens", "100000"], ["--batch-tokens", "7", "--workers", "2"]):
        code, out, err = run(capsys, "analyze", path, "-f", "json", "--group-by", "task", *args)
        assert code == 0, err
        outs.append(json.loads(out)["groups"])
    assert outs[0] == outs[2]  # the same bytes whatever the worker count (units merge in order)
    # Batch size only reorders float sums (as for --group-by step): same keys, same counts, equal to rounding.
    assert [g["key"] for g in outs[0]] == [g["key"] for g in outs[1]]
    for small, large in zip(outs[0], outs[1]):
        for key, value in small["metrics"].items():
            if isinstance(value, float):
                assert value == pytest.approx(large["metrics"][key], rel=1e-9, abs=1e-12), key
            elif isinstance(value, int):
                assert value == large["metrics"][key], key


def test_group_by_string_token_per_row(capsys, tmp_path):
    path, seqs = _with_task(tmp_path, token_layout=True)
    code, out, err = run(capsys, "analyze", path, "-f", "json", "--group-by", "task", "--batch-tokens", "9")
    assert code == 0, err
    groups = _groups(json.loads(out))
    assert sum(g["n_sequences"] for g in groups.values()) == len(seqs)


def test_group_by_cap_and_bad_columns(capsys, tmp_path):
    path, _ = _with_task(tmp_path)
    code, _, err = run(capsys, "analyze", path, "--group-by", "nope")
    assert code == 2 and "no 'nope' column" in err
    code, _, err = run(capsys, "analyze", path, "--group-by", "old_logp")
    assert code == 2 and "a group key must be one scalar per sequence" in err


def test_check_per_string_column(capsys, tmp_path):
    path, _ = _with_task(tmp_path)
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nmetric = "n_sequences"\nmin = 11\nper = "task"\n')
    code, out, _ = run(capsys, "check", path, "--rules", rules)
    assert code == 1 and "task" in out
