"""``torchrun``: two gloo ranks on CPU give the report of one process (grpo_cli.engine.parallel).

One launch (``python -m torch.distributed.run``, 2 processes, rendezvous on a free port of 127.0.0.1) runs three
commands through ``tests/distributed_job.py``: ``analyze --group-by step`` (keys unioned across ranks),
``compare-prox``, and ``analyze`` of a dump whose only invalid value lies in rank 1's share (both ranks must fail
with rank 0 printing the one-process error). Counts, extrema, histograms and top-k tables must match exactly and
float sums to 1e-12 relative (the ranks' partial sums are added in a different tree).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main

HERE = Path(__file__).resolve().parent
REL = 1e-12


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Ints, strings, None and key sets exactly; floats to ``REL`` relative."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, sorted(set(a) ^ set(b)))
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=REL, abs=1e-14), path
    else:
        assert a == b and type(a) is type(b), (path, a, b)


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path, capsys):
    good = tmp_path / "good.parquet"
    write_sequences(str(good), random_sequences(80, seed=31, with_prox=True, max_len=24), row_group_size=6)
    seqs = random_sequences(60, seed=32, max_len=20)
    seqs[52].new[seqs[52].valid()[0]] = 0.5  # in the last rows: rank 1's share
    bad = tmp_path / "bad.parquet"
    write_sequences(str(bad), seqs, row_group_size=4)
    commands = [
        ["analyze", str(good), "-f", "json", "--batch-tokens", "40", "--group-by", "step"],
        ["compare-prox", str(good), "-f", "json", "--batch-tokens", "40"],
        ["analyze", str(bad), "-f", "json", "--batch-tokens", "30"],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(HERE / "distributed_job.py"), str(tmp_path), json.dumps(commands),
    ]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())

    # Rank 1 computes but writes nothing, whatever happens.
    assert all(r["out"] == "" and r["err"] == "" for r in rank1)
    assert [r["code"] for r in rank1] == [0, 0, 2]

    for command, result in zip(commands, rank0):
        code = main(command)
        out, err = capsys.readouterr()
        assert result["code"] == code, (command, result["err"])
        if code == 0:
            assert_same(json.loads(out), json.loads(result["out"]))
        else:
            assert result["out"] == out == ""
            assert result["err"] == err and "row 52" in err
    doc = json.loads(rank0[0]["out"])
    assert len(doc["groups"]) == 8  # every step, though each rank saw only some of them
