"""``--executor ray`` (grpo_cli.engine.ray_executor): the units as tasks of a local Ray cluster of 2 workers, merged
in unit order, give the *same bytes* as one process; bad input is the same one line; a dump in object storage is
read by the tasks themselves. Skipped without the ``ray`` extra (installed by ``dev``, so CI runs it)."""

from __future__ import annotations

import json
import os

import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.commands.analyze import analyze
from grpo_cli.engine.parallel import plan_units, use_executor
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'grpo-cli[ray]')")

BATCH = 40  # tokens per batch: units of 4 * 40 tokens, many per dump


@pytest.fixture(scope="module")
def ray_cluster(request):
    """One local cluster of 2 CPUs for the module (its start-up is the cost), on the node address 127.0.0.1 (Ray's own
    gRPC servers still bind every interface: Ray has no option to narrow them). Its workers get the object store's
    variables through ``runtime_env``, as a user's cluster gets its credentials (without the weed binary only the
    object-storage test is skipped)."""
    try:
        env = request.getfixturevalue("s3_server").env
    except pytest.skip.Exception:
        env = {}
    # No usage report to Ray's servers: a test talks to this machine only.
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env}, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray")
    seqs = random_sequences(90, seed=7, with_prox=True, max_len=24)
    for i in range(3):
        write_sequences(str(directory / f"part-{i}.parquet"), seqs[30 * i:30 * (i + 1)], row_group_size=4)
    return directory


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("options", [
    ["analyze", "--format", "json"],
    ["analyze", "--format", "json", "--group-by", "step"],
    ["compare-prox", "--format", "json"],
])
@pytest.mark.slow
def test_ray_output_is_bitwise_one_process(ray_cluster, capsys, dump, options):
    command, *rest = options
    assert len(plan_units(RolloutDataset([dump]).shards(), 4 * BATCH)) >= 6  # several tasks per worker
    one = run(capsys, command, dump, *rest, "--batch-tokens", BATCH, "--workers", "1", "-q")
    on_ray = run(capsys, command, dump, *rest, "--batch-tokens", BATCH, "--executor", "ray", "-q")
    assert one[0] == on_ray[0] == 0, on_ray[2]
    assert on_ray[1] == one[1]  # the same bytes
    assert json.loads(one[1])["metrics"]["n_tokens"] > 500


@pytest.mark.slow
def test_library_callers_choose_ray_with_use_executor(ray_cluster, dump):
    config = AnalyzeConfig(batch_tokens=BATCH)
    local = analyze(RolloutDataset([dump]), config)
    with use_executor("ray"):
        remote = analyze(RolloutDataset([dump]), config)
    assert remote.metrics == local.metrics and remote.findings == local.findings
    with pytest.raises(UsageError, match="--executor must be one of local, ray"), use_executor("spark"):
        pass


@pytest.mark.slow
def test_bad_input_in_a_task_is_the_same_one_line(ray_cluster, capsys, tmp_path):
    seqs = random_sequences(40, seed=3, max_len=20)
    seqs[33].new[-1] = 0.5  # a positive log-prob (a response token) in a late row group
    write_sequences(str(tmp_path / "bad.parquet"), seqs, row_group_size=4)
    one = run(capsys, "analyze", tmp_path, "--batch-tokens", BATCH, "--workers", "1", "-q")
    on_ray = run(capsys, "analyze", tmp_path, "--batch-tokens", BATCH, "--executor", "ray", "-q")
    assert on_ray[0] == one[0] == 2
    assert on_ray[2] == one[2] and on_ray[2].count("\n") == 1 and "row 33" in on_ray[2]


@pytest.mark.slow
def test_tasks_read_object_storage_themselves(ray_cluster, s3_server, capsys, monkeypatch, dump):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    uri = s3_server.upload(dump, "ray/run")
    local = json.loads(run(capsys, "analyze", dump, "--format", "json", "--batch-tokens", BATCH, "--workers", "1",
                           "-q")[1])
    code, out, err = run(capsys, "analyze", f"{uri}/", "--format", "json", "--batch-tokens", BATCH, "--executor", "ray",
                         "-q")
    assert code == 0, err
    doc = json.loads(out)
    assert doc.pop("inputs") == [f"{uri}/part-{i}.parquet" for i in range(3)]
    assert doc == {k: v for k, v in local.items() if k != "inputs"}


def test_without_ray_the_option_is_one_line(capsys, monkeypatch, dump):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as if the ray extra were not installed
    code, out, err = run(capsys, "analyze", dump, "--executor", "ray", "-q")
    assert code == 2 and out == ""
    assert err == "grpo-cli: error: --executor ray needs Ray: pip install 'grpo-cli[ray]'\n"
