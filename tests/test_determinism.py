"""Determinism and exactness over every figure ``analyze`` reports.

What is guaranteed (``docs/errors.md``):

- bitwise-identical JSON for the same input across runs, and whatever the order files are given in (inputs are
  sorted, so the same batches are read in the same order);
- across ``--batch-tokens`` values and row-group layouts: counts, minima, maxima, histograms/quantiles and the
  top-k tables are bitwise identical; float64 sums are within 1e-12 relative (a float sum split differently rounds
  differently, so bitwise equality is impossible in general);
- CPU and CUDA agree to 1e-6 relative;
- counts are int64 and sums float64 whatever the input dtype.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.core.state import MetricState, Reduce, count
from grpo_cli.engine.runner import accumulate_states
from grpo_cli.io import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups

REL, ABS = 1e-12, 1e-14


def analyze_json(capsys, *args) -> str:
    code = main(["analyze", *[str(a) for a in args], "-f", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def assert_same(a: Any, b: Any, *, rel: float = REL, path: str = "", ignore: tuple[str, ...] = ()) -> None:
    """Recursive comparison: ints, strings and None exactly; floats to ``rel``; keys must match."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, sorted(set(a) ^ set(b)))
        for key in a:
            if key not in ignore:
                assert_same(a[key], b[key], rel=rel, path=f"{path}/{key}", ignore=ignore)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, rel=rel, path=f"{path}[{i}]", ignore=ignore)
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=rel, abs=ABS * (rel > 0)), path
    else:
        assert a == b and type(a) is type(b), (path, a, b)


def exact_parts(metrics: dict[str, Any]) -> dict[str, Any]:
    """The figures that must be bitwise identical however the data is split: every int, and the top-k table."""
    return {k: v for k, v in metrics.items() if isinstance(v, int) or k == "top_kl"}


@pytest.fixture(scope="module")
def seqs():
    return random_sequences(90, seed=11, with_prox=True, max_len=30)


def test_same_input_gives_the_same_bytes(capsys, tmp_path, seqs):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=8)
    first = analyze_json(capsys, path)
    assert analyze_json(capsys, path) == first
    assert analyze_json(capsys, path, "--on-invalid", "skip") == analyze_json(capsys, path, "--on-invalid", "skip")


def test_file_order_does_not_matter(capsys, tmp_path, seqs):
    (tmp_path / "dump").mkdir()
    names = ["a.parquet", "b.parquet", "c.parquet"]
    for i, name in enumerate(names):
        write_sequences(str(tmp_path / "dump" / name), seqs[30 * i : 30 * (i + 1)], row_group_size=7)
    paths = [tmp_path / "dump" / n for n in names]
    reference = analyze_json(capsys, *paths)
    assert json.loads(reference)["inputs"] == [str(p) for p in paths]
    assert analyze_json(capsys, paths[2], paths[0], paths[1]) == reference
    assert analyze_json(capsys, tmp_path / "dump") == reference
    # A glob plus a file it also matches: duplicates are read once.
    assert analyze_json(capsys, paths[1], str(tmp_path / "dump" / "*.parquet")) == reference


def test_batch_tokens_do_not_change_any_figure(capsys, tmp_path, seqs):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=1000)
    docs = [json.loads(analyze_json(capsys, path, "--batch-tokens", n))["metrics"] for n in (1 << 20, 1, 13, 200)]
    for other in docs[1:]:
        assert_same(docs[0], other)
        assert_same(exact_parts(docs[0]), exact_parts(other), rel=0.0)


def _token_layout(table: pa.Table) -> pa.Table:
    """The same rows as a token-per-row table: list columns flattened, per-sequence columns repeated."""
    parents = pc.list_parent_indices(table["new_logp"])
    columns = {}
    for name in table.column_names:
        column = table[name]
        columns[name] = pc.list_flatten(column) if pa.types.is_list(column.type) else column.take(parents)
    return pa.table(columns)


def test_row_group_layouts_do_not_change_any_figure(capsys, tmp_path, seqs):
    docs = []
    for size in (1000, 1, 6):
        path = tmp_path / f"rg{size}.parquet"
        write_sequences(str(path), seqs, row_group_size=size)
        docs.append(json.loads(analyze_json(capsys, path))["metrics"])
    for other in docs[1:]:
        assert_same(docs[0], other)
        assert_same(exact_parts(docs[0]), exact_parts(other), rel=0.0)
    # The token-per-row layout of the same data: the same figures; top_kl rows name the token's first file row.
    token_path = tmp_path / "tokens.parquet"
    pq.write_table(_token_layout(pq.read_table(tmp_path / "rg1000.parquet")), token_path, row_group_size=50)
    tokens = json.loads(analyze_json(capsys, token_path))["metrics"]
    assert_same(docs[0], tokens, ignore=("row",))
    first_row = [0]
    for s in seqs:
        first_row.append(first_row[-1] + len(s.new))
    assert [first_row[r["row"]] for r in docs[0]["top_kl"]] == [r["row"] for r in tokens["top_kl"]]


def test_states_count_in_int64_and_sum_in_float64(tmp_path, seqs):
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    dataset = RolloutDataset([path])
    assert next(dataset.iter_batches()).new_logp.dtype == torch.float32  # the input really is float32
    config = AnalyzeConfig(on_invalid="skip")
    groups = default_groups()
    states = accumulate_states(dataset, config, groups).overall
    for group, state in zip(groups, states):
        for name, spec in state.specs.items():
            where = f"{group.name}.{name}"
            if spec.reduce is Reduce.SUM:
                assert spec.dtype in (torch.int64, torch.float64), where
            else:
                assert spec.dtype in (torch.int64, torch.float64), where
            assert state[name].dtype == spec.dtype, where
    # int64 counts stay exact past 2**53, where a float64 count would round.
    state = MetricState({"n": count()})
    state.update(n=torch.tensor(2**53))
    state.update(n=torch.tensor(1))
    assert int(state["n"]) == 2**53 + 1


@pytest.mark.cuda
def test_cpu_and_cuda_agree(capsys, tmp_path, seqs, device):
    if device == "cpu":
        pytest.skip("compares CUDA with CPU")
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    cpu = json.loads(analyze_json(capsys, path))["metrics"]
    cuda = json.loads(analyze_json(capsys, path, "--device", "cuda"))["metrics"]
    assert_same(cpu, cuda, rel=1e-6)
    assert all(math.isfinite(v) for v in cuda.values() if isinstance(v, float))
