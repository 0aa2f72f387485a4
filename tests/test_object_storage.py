"""Object storage against a real S3-compatible server (SeaweedFS, tests/seaweed.py): every command reads ``s3://``
prefixes and globs with the same figures as the local files, ``RolloutWriter`` and ``convert`` write there, a killed
writer leaves no visible part, and each failure is one line with exit code 2 (grpo_cli.io.storage)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import seaweed
import torch
from dump_columns import read_columns
from reference import random_sequences, write_sequences
from seaweed import BUCKET, S3Server

from grpo_cli.cli import main
from grpo_cli.errors import InputError
from grpo_cli.io import RolloutDataset, RolloutWriter, storage
from grpo_cli.io.parquet_file import ParquetFileOut
from grpo_cli.io.storage import RemotePath, read_table, retrying
from grpo_cli.io.storage_listing import expand_remote

ROOT = Path(__file__).resolve().parent.parent
s3_env = seaweed.s3_env  # the fixture (s3_server comes from conftest.py)


@pytest.fixture(scope="module")
def local_dump(tmp_path_factory) -> Path:
    """Three files of several row groups each (a directory as a trainer's ranks leave it)."""
    directory = tmp_path_factory.mktemp("dump")
    seqs = random_sequences(72, seed=11, with_prox=True, max_len=20)
    for i in range(3):
        write_sequences(str(directory / f"part-{i}.parquet"), seqs[24 * i:24 * (i + 1)], row_group_size=5)
    return directory


@pytest.fixture(scope="module")
def remote_dump(s3_server: S3Server, local_dump: Path) -> str:
    return s3_server.upload(local_dump, "runs/a")


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def analyze_doc(capsys, *paths: str | Path) -> dict:
    code, out, err = run(capsys, "analyze", *paths, "--format", "json", "--workers", "1", "-q")
    assert code == 0, err
    return json.loads(out)


# -- reading -----------------------------------------------------------------------------------------------------------
def test_prefix_and_globs_give_the_local_figures(s3_env, capsys, local_dump, remote_dump):
    local = analyze_doc(capsys, local_dump)
    assert local["metrics"]["n_tokens"] > 0
    remote_files = [f"{remote_dump}/part-{i}.parquet" for i in range(3)]
    # (A prefix without its trailing "/" is read in test_rolloutwriter_writes_parts_that_read_back_equal.)
    for uri in (f"{remote_dump}/", f"{remote_dump}/part-*.parquet", "s3://rollouts/runs/**/*.parquet"):
        doc = analyze_doc(capsys, uri)
        assert doc.pop("inputs") == remote_files, uri
        assert doc == {k: v for k, v in local.items() if k != "inputs"}, uri
    # A glob with a character class picks a subset, as glob.glob does on the local files.
    subset = analyze_doc(capsys, f"{remote_dump}/part-[02].parquet")
    local_subset = analyze_doc(capsys, local_dump / "part-0.parquet", local_dump / "part-2.parquet")
    assert subset["metrics"] == local_subset["metrics"]
    assert subset["metrics"]["n_tokens"] < local["metrics"]["n_tokens"]


@pytest.mark.parametrize("command", [
    ["check", "--rules-preset", "sanity", "--format", "json"],
    ["compare-prox", "--format", "json", "--workers", "1"],
    ["advantages", "--estimator", "grpo", "--format", "json", "--workers", "1"],
    ["analyze", "--group-by", "step", "--format", "csv", "--workers", "1"],
    ["analyze", "--format", "json", "--workers", "1", "--on-invalid", "skip"],  # readable_files on the store
    # spawned workers read the store too (each imports torch: several seconds)
    pytest.param(["analyze", "--format", "json", "--workers", "2", "--batch-tokens", "40"], marks=pytest.mark.slow),
])
def test_every_command_reads_object_storage(s3_env, capsys, local_dump, remote_dump, command):
    name, *options = command
    local = run(capsys, name, local_dump, *options, "-q")
    remote = run(capsys, name, f"{remote_dump}/", *options, "-q")
    assert remote[0] == local[0], remote[2]
    assert remote[2].replace(remote_dump, str(local_dump)) == local[2]  # the same verdict or warnings, if any
    # The same bytes once the location is the same: only the input names differ.
    assert remote[1].replace(remote_dump, str(local_dump)) == local[1]
    assert len(local[1]) > 200


def test_diff_reads_object_storage(s3_env, capsys, local_dump, remote_dump):
    # The remote dump against its local copy: every figure the same, every change zero, per step too.
    code, out, err = run(capsys, "diff", f"{remote_dump}/", local_dump, "--format", "json", "--workers", "1", "-q")
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["figures"]) > 50
    assert all(f["base"] == f["new"] and f["change"] == 0 for f in doc["figures"] if f["base"] is not None)
    assert all(s["base"] == s["new"] for s in doc["series"]) and doc["series"]


# -- writing -----------------------------------------------------------------------------------------------------------
def _add_steps(writer: RolloutWriter, seqs) -> None:
    for step in (0, 1):
        chunk = [s for s in seqs if s.step == step]
        writer.add(step=step, new_logp=[torch.tensor(s.new) for s in chunk],
                   old_logp=[torch.tensor(s.old) for s in chunk], loss_mask=[torch.tensor(s.mask) for s in chunk],
                   versions=[torch.tensor(s.versions) for s in chunk],
                   advantages=torch.tensor([s.advantage for s in chunk]))


def test_rolloutwriter_writes_parts_that_read_back_equal(s3_env, capsys, tmp_path):
    seqs = random_sequences(20, seed=4, max_len=15)
    with RolloutWriter(tmp_path / "local", metadata={"framework": "test"}, row_group_tokens=50) as local:
        _add_steps(local, seqs)
    with RolloutWriter("s3://rollouts/written", metadata={"framework": "test"}, row_group_tokens=50) as remote:
        _add_steps(remote, seqs)
    names = ["part-step000000-rank000.parquet", "part-step000001-rank000.parquet"]
    assert [str(p) for p in remote.files] == [f"s3://rollouts/written/{n}" for n in names]
    assert s3_env.keys("written") == [f"written/{n}" for n in names]  # no temporary key left behind
    fs = s3_env.fs()
    for name in names:  # the same bytes as the local writer's (row groups, settings, metadata)
        with fs.open_input_file(f"{BUCKET}/written/{name}") as f:
            assert f.read() == (tmp_path / "local" / name).read_bytes()
    assert read_columns("s3://rollouts/written") == read_columns(tmp_path / "local")
    assert analyze_doc(capsys, "s3://rollouts/written")["metrics"] == analyze_doc(capsys, tmp_path / "local")["metrics"]


def test_convert_optimize_from_and_to_object_storage(s3_env, capsys, tmp_path, local_dump, remote_dump):
    code, _, err = run(capsys, "convert", f"{remote_dump}/", "-o", "s3://rollouts/optimized", "--optimize", "-q")
    assert code == 0, err
    names = [f"part-{i}.parquet" for i in range(3)]
    assert s3_env.keys("optimized") == [f"optimized/{n}" for n in names]
    code, _, err = run(capsys, "convert", local_dump, "-o", tmp_path / "optimized", "--optimize", "-q")
    assert code == 0, err
    fs = s3_env.fs()
    for name in names:  # the same bytes as the local conversion's
        with fs.open_input_file(f"{BUCKET}/optimized/{name}") as f:
            assert f.read() == (tmp_path / "optimized" / name).read_bytes()
    code, _, err = run(capsys, "convert", f"{remote_dump}/", "-o", "s3://rollouts/optimized", "--optimize", "-q")
    assert code == 2 and "already holds .parquet objects" in err and err.count("\n") == 1


def test_advantages_write_to_object_storage(s3_env, capsys, tmp_path, local_dump, remote_dump):
    options = ["--estimator", "grpo", "--workers", "1", "-q"]
    code, _, err = run(capsys, "advantages", local_dump, *options, "--write", tmp_path / "fixed.parquet")
    assert code in (0, 1), err
    remote = run(capsys, "advantages", f"{remote_dump}/", *options, "--write", "s3://rollouts/fixed/fixed.parquet")
    assert remote[0] == code, remote[2]
    assert s3_env.keys("fixed") == ["fixed/fixed.parquet"]
    with s3_env.fs().open_input_file(f"{BUCKET}/fixed/fixed.parquet") as f:
        assert f.read() == (tmp_path / "fixed.parquet").read_bytes()


def test_convert_from_sources_in_object_storage(s3_env, capsys, tmp_path):
    # JSON lines and torch.save'd dicts read from the store convert to the same bytes as from a local directory.
    seqs = random_sequences(12, seed=2, max_len=9)
    source = tmp_path / "src"
    source.mkdir()
    rows = [{"step": s.step, "new_logp": s.new, "old_logp": s.old, "loss_mask": s.mask, "advantages": s.advantage}
            for s in seqs]
    (source / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.save({"new_logp": torch.tensor([seqs[0].new]), "old_logp": torch.tensor([seqs[0].old])}, source / "d.pt")
    uri = s3_env.upload(source, "sources")
    for fmt, name in (("jsonl", "d.jsonl"), ("torch-dict", "d.pt")):
        local_out, remote_out = tmp_path / f"{fmt}-out", f"s3://rollouts/converted-{fmt}"
        code, _, err = run(capsys, "convert", source / name, "-o", local_out, "--from", fmt, "-q")
        assert code == 0, err
        code, _, err = run(capsys, "convert", f"{uri}/", "-o", remote_out, "--from", fmt, "-q")
        assert code == 0, err
        parts = sorted(p.name for p in local_out.iterdir())
        assert s3_env.keys(f"converted-{fmt}") == [f"converted-{fmt}/{p}" for p in parts] and parts
        for part in parts:
            with s3_env.fs().open_input_file(f"{BUCKET}/converted-{fmt}/{part}") as f:
                assert f.read() == (local_out / part).read_bytes()
    code, _, err = run(capsys, "convert", f"{uri}/", "-o", tmp_path / "slime", "--from", "slime-train", "-q")
    assert code == 2 and err.count("\n") == 1 and "--from slime-train reads local files" in err, err


_KILLED_WRITER = """
import json, sys, time
import numpy as np, pyarrow as pa
from grpo_cli.io.part_writer import PartWriter  # RolloutWriter's torch-free half: the child starts in a blink

def columns(values, step):
    return {"new_logp": pa.array([values], pa.list_(pa.field("element", pa.float32(), False))),
            "step": pa.array([step], pa.int64())}

conventions = (json.dumps({"new_logp": "token"}), "full")
writer = PartWriter(sys.argv[1], row_group_tokens=1 << 16)
writer.add_arrays(0, columns(np.full(500, -0.5, np.float32), 0), 500, conventions)
writer.flush()
rng = np.random.default_rng(0)
for _ in range(48):  # step 1: ~12 MB of incompressible row groups, past S3's 5 MB part size: an upload in flight
    writer.add_arrays(1, columns(-rng.random(1 << 16, dtype=np.float32), 1), 1 << 16, conventions)
print("streaming", flush=True)
time.sleep(120)
"""


def test_a_killed_writer_leaves_no_visible_part_and_a_new_one_recovers(s3_env, capsys):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, "s3://rollouts/killed"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline().strip() == "streaming", child.stderr.read() if not ready else ""
        time.sleep(0.5)  # let the background upload of the first parts start
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    parquet = [k for k in s3_env.keys("killed") if k.endswith(".parquet")]
    assert parquet == ["killed/part-step000000-rank000.parquet"]  # step 1 never became visible
    doc = analyze_doc(capsys, "s3://rollouts/killed/")
    assert doc["inputs"] == ["s3://rollouts/killed/part-step000000-rank000.parquet"]
    assert doc["metrics"]["n_tokens"] == 500
    # Recovery: the step is written again, completely, and both parts read back.
    with RolloutWriter("s3://rollouts/killed", row_group_tokens=1 << 16) as writer:
        writer.add(step=1, new_logp=[torch.full((300,), -1.0)])
    assert analyze_doc(capsys, "s3://rollouts/killed/")["metrics"]["n_tokens"] == 800


def test_a_failed_write_removes_its_temporary_object(s3_env):
    table = pa.table({"x": pa.array(np.arange(1 << 18, dtype=np.float64))})
    target = "s3://rollouts/aborted/x.parquet"
    with pytest.raises(RuntimeError, match="the trainer failed"), ParquetFileOut(target) as out:
        out.write(table, row_group_size=1 << 16)
        assert isinstance(out.tmp, RemotePath) and out.tmp.name == f".x.parquet.{os.getpid()}.tmp"
        raise RuntimeError("the trainer failed")
    assert s3_env.keys("aborted") == []  # neither the part nor its temporary key
    with ParquetFileOut("s3://rollouts/aborted/x.parquet") as out:
        out.write(table, row_group_size=1 << 16)
    assert s3_env.keys("aborted") == ["aborted/x.parquet"]
    assert read_table("s3://rollouts/aborted/x.parquet", ["x"]).equals(table)


# -- errors ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("uri", "fragment"), [
    ("s3://no-such-bucket/run/", "no such bucket 'no-such-bucket'"),
    ("s3://rollouts/runs/a/nope.parquet", "no such object or prefix"),
    ("s3://rollouts/nothing-here/", "no such object or prefix"),
    ("s3://rollouts/runs/a/*.nope", "no object matches this pattern"),
    ("s3://no-such-bucket/run/*.parquet", "no such bucket 'no-such-bucket'"),
    ("ftp://host/x.parquet", "unsupported scheme 'ftp://'"),
    ("s3://roll*/runs/", "a pattern cannot match the bucket"),
])
def test_missing_inputs_exit_2_with_one_line(s3_env, capsys, remote_dump, uri, fragment):
    code, out, err = run(capsys, "analyze", uri, "-q")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"grpo-cli: error: {uri}: ") and fragment in err, err


def test_refused_credentials_exit_2_with_one_line(s3_env, capsys, monkeypatch, remote_dump):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, _, err = run(capsys, "analyze", f"{remote_dump}/", "-q")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"grpo-cli: error: {remote_dump}/: ") and "credentials were refused" in err, err
    assert "AWS_ACCESS_KEY_ID" in err


def test_unreachable_endpoint_exits_2_quickly(s3_env, capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    code, _, err = run(capsys, "analyze", "s3://rollouts/runs/a/", "-q")
    assert code == 2 and err.count("\n") == 1
    assert f"cannot reach http://127.0.0.1:{port}" in err and "AWS_ENDPOINT_URL" in err, err
    assert time.monotonic() - start < 20  # bounded retries


def test_writer_to_a_missing_bucket_fails_at_once(s3_env, capsys, local_dump):
    with pytest.raises(InputError, match="no such bucket 'no-such-bucket'"):
        RolloutWriter("s3://no-such-bucket/run")
    code, _, err = run(capsys, "convert", local_dump, "-o", "s3://no-such-bucket/out", "--optimize", "-q")
    assert code == 2 and err.count("\n") == 1 and "s3://no-such-bucket/out" in err


def test_aws_endpoint_url_s3_wins_over_aws_endpoint_url(s3_env, monkeypatch, remote_dump):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # would fail: the S3-specific one is used
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env.endpoint)
    assert [p.name for p in expand_remote(f"{remote_dump}/")] == [f"part-{i}.parquet" for i in range(3)]


# -- retries -----------------------------------------------------------------------------------------------------------
def test_transient_errors_are_retried_with_bounded_backoff():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.")
        return "ok"

    assert retrying(flaky, attempts=4, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.25, 0.5]

    def always():
        calls.append(1)
        raise OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7")

    calls.clear(), sleeps.clear()
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        retrying(always, attempts=6, sleep=sleeps.append)
    assert len(calls) == 6 and sleeps == [0.25, 0.5, 1.0, 2.0, 2.0]  # capped at MAX_BACKOFF_S
    assert storage.MAX_BACKOFF_S == 2.0

    def denied():
        calls.append(1)
        raise OSError("AWS Error ACCESS_DENIED during HeadObject operation")

    calls.clear(), sleeps.clear()
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        retrying(denied, attempts=4, sleep=sleeps.append)
    assert len(calls) == 1 and sleeps == []  # not transient: raised at once


def test_s3_requests_are_retried_by_the_sdk_alone(monkeypatch):
    import pyarrow.fs as pafs

    monkeypatch.setenv("GRPO_CLI_RETRIES", "3")
    calls: list[int] = []

    def always():
        calls.append(1)
        raise OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7")

    gcs = RemotePath("gs://b/k.parquet", "b/k.parquet", pafs.LocalFileSystem())
    with pytest.raises(OSError):
        retrying(always, gcs, sleep=lambda s: None)
    assert len(calls) == 3  # GRPO_CLI_RETRIES attempts by grpo-cli's loop
    calls.clear()
    s3 = RemotePath("s3://b/k.parquet", "b/k.parquet", pafs.LocalFileSystem())
    with pytest.raises(OSError):
        retrying(always, s3, sleep=lambda s: None)
    assert len(calls) == 1  # the AWS SDK already retried each request: no retries around its retries
    options = storage._s3_options()
    assert options["retry_strategy"].max_attempts == 3 and options["connect_timeout"] == 5.0


def test_remote_paths_pickle_and_stream_in_any_batch_size(s3_env, remote_dump, local_dump):
    import pickle

    dataset = pickle.loads(pickle.dumps(RolloutDataset([f"{remote_dump}/"])))
    assert [p.uri for p in dataset.files] == [f"{remote_dump}/part-{i}.parquet" for i in range(3)]
    assert len(dataset.shards()) == 15  # 3 files of 5 row groups, planned from the footers alone
    expected = read_columns(local_dump, batch_tokens=7)
    for batch_tokens in (7, 1 << 16):
        assert read_columns(dataset, batch_tokens=batch_tokens) == expected


def test_remote_reads_show_the_progress_bar_sooner(s3_env, monkeypatch, local_dump, remote_dump):
    import contextlib

    from grpo_cli.cli import _options

    shown: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def bar(total, quiet, threshold):
        shown.append((total, threshold))
        yield None

    monkeypatch.setattr(_options, "progress_bar", bar)
    for paths in ([f"{remote_dump}/"], [str(local_dump)]):
        with _options.streaming(RolloutDataset(paths), quiet=False) as progress:
            assert progress is None
    n_tokens = RolloutDataset([local_dump]).n_tokens
    assert shown == [(n_tokens, _options.REMOTE_PROGRESS_TOKENS), (n_tokens, _options.LOCAL_PROGRESS_TOKENS)]
    assert _options.REMOTE_PROGRESS_TOKENS < _options.LOCAL_PROGRESS_TOKENS


@pytest.mark.parametrize(("uri", "message", "expected"), [
    ("gs://b/run/", "google::cloud::Status(UNAVAILABLE: Retry policy exhausted, with a last message of Could not "
     "create a OAuth2 access token to authenticate the request.", "no credentials found: set GOOGLE_APPLICATION_"),
    ("abfs://c@acct.dfs.core.windows.net/run/", "Check for Hierarchical Namespace support failed: "
     "AuthenticationException: Failed to get token from DefaultAzureCredential.",
     "no credentials found: set AZURE_STORAGE_ACCOUNT_KEY"),
    ("s3://b/run/", "When listing objects under key 'run' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
     "ListObjectsV2 operation: The specified bucket does not exist (Request ID: 18EE164AB4CBE832)",
     "no such bucket 'b'"),
    ("s3://b/run/", "AWS Error ACCESS_DENIED during HeadObject operation: No response body. (Request ID: 403AB)",
     "access denied: the credentials were refused; check AWS_ACCESS_KEY_ID"),
    ("hdfs://nn:8020/run/", "HDFS connection failed: Connection refused; Could not connect to nn:8020",
     "cannot reach the hdfs:// endpoint"),
])
def test_each_store_failure_says_what_to_do(uri, message, expected):
    import pyarrow.fs as pafs

    path = RemotePath(uri, uri.split("://", 1)[1], pafs.LocalFileSystem())
    text = storage.describe(OSError(message), path)
    assert text.startswith(expected), text
    assert "Request ID" not in text and "\n" not in text
