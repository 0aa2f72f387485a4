"""``--workers``: (file, row-group) units in worker processes, merged exactly (grpo_cli.engine.parallel).

The figures of ``--workers N`` must be the *same bytes* as ``--workers 1``: units are planned from the metadata and
merged in unit order whoever computed them. Every dump here has many small row groups and runs with a tiny
``--batch-tokens`` so that it splits into several units.
"""

from __future__ import annotations

import json
import os
import pickle
import time

import pyarrow.parquet as pq
import pytest
import torch
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.commands.analyze import analyze
from grpo_cli.core.state import Reduce, StateSpec
from grpo_cli.engine.group import Accumulator
from grpo_cli.engine.parallel import (
    MAX_COMPUTE_THREADS,
    UNIT_BATCHES,
    accumulate,
    available_cores,
    compute_threads,
    plan_units,
    split_by_bytes,
)
from grpo_cli.engine.run import finalize
from grpo_cli.engine.runner import accumulate_states
from grpo_cli.errors import GrpoCliError, InputError
from grpo_cli.io.reader import RolloutDataset, Shard
from grpo_cli.metrics import AnalyzeConfig, default_groups
from grpo_cli.metrics.policy import CountsGroup

BATCH = 40  # tokens per batch → units of UNIT_BATCHES * 40 tokens: several per dump


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    seqs = random_sequences(80, seed=21, with_prox=True, max_len=24)
    path = tmp_path_factory.mktemp("workers") / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=6)
    return path


def test_plan_units_cuts_contiguous_runs_of_enough_tokens():
    # Token counts 3, 4, 9, 2, 2, 1 with at least 6 per unit: 3+4 → cut; 9 → cut; 2+2+1 = 5 is the short tail.
    shards = [Shard(0, (g,), 0, 1, n, n) for g, n in enumerate([3, 4, 9, 2, 2, 1])]
    units = plan_units(shards, 6)
    assert [[s.row_groups[0] for s in unit] for unit in units] == [[0, 1], [2], [3, 4, 5]]
    assert plan_units([], 6) == []
    with pytest.raises(ValueError):
        plan_units(shards, 0)


def test_split_by_bytes_balances_contiguous_ranges():
    # Total 12, two parts: the share 6 is met exactly after 1+2+3.
    assert split_by_bytes([1, 2, 3, 6], 2) == [range(0, 3), range(3, 4)]
    # Three parts of [5, 5, 5, 5, 5, 5] (shares 10 and 20): two items each.
    assert split_by_bytes([5] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    # One huge item still leaves every range one item when there are enough items.
    assert split_by_bytes([100, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 4)]
    # Fewer items than parts: every item lands in exactly one range.
    ranges = split_by_bytes([7], 3)
    assert sorted(i for r in ranges for i in r) == [0] and len(ranges) == 3
    assert split_by_bytes([], 2) == [range(0, 0), range(0, 0)]


def test_the_dump_splits_into_several_units(dump):
    dataset = RolloutDataset([dump])
    units = plan_units(dataset.shards(), UNIT_BATCHES * BATCH)
    assert len(units) >= 4
    # Every row group is in exactly one unit, in order.
    order = [(s.file_index, s.row_groups) for unit in units for s in unit]
    assert order == [(s.file_index, s.row_groups) for s in dataset.shards()]


@pytest.mark.parametrize("extra", [[], ["--group-by", "step"], ["--on-invalid", "skip"]])
def test_analyze_workers_gives_the_same_bytes(capsys, dump, extra):
    base = ["analyze", dump, "-f", "json", "--batch-tokens", BATCH, *extra]
    code, one, err = run(capsys, *base, "--workers", 1)
    assert code == 0, err
    code, three, err = run(capsys, *base, "--workers", 3)
    assert code == 0, err
    assert three == one
    if "--group-by" in extra:
        assert len(json.loads(one)["groups"]) == 8  # steps 0..7 (sequence index // 10)


def test_compare_prox_workers_gives_the_same_bytes(capsys, dump):
    base = ["compare-prox", dump, "-f", "json", "--batch-tokens", BATCH]
    code, one, err = run(capsys, *base, "--workers", 1)
    assert code == 0, err
    code, two, err = run(capsys, *base, "--workers", 2)
    assert code == 0, err
    assert two == one


def test_check_and_report_workers_give_the_same_bytes(capsys, dump, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmetric = "kl/k3"\nmax = 0.01\nper = "step"\n'
                     '[[rule]]\nmetric = "clip/ratio"\nmax = 1\n'
                     '[[rule]]\nmetric = "prox/loglinear/abs_error_mean"\nmax = 1\n')
    outputs = []
    for workers in (1, 3):
        code, out, err = run(capsys, "check", dump, "--rules", rules, "-f", "json", "--batch-tokens", BATCH,
                             "--workers", workers)
        assert code == 1, err  # the per-step KL bound fails at some step: the per-value pass ran
        report = tmp_path / f"report{workers}.html"
        assert run(capsys, "report", dump, "-o", report, "-q", "--batch-tokens", BATCH, "--workers", workers)[0] == 0
        outputs.append((out, report.read_text()))
    assert outputs[1] == outputs[0]
    assert json.loads(outputs[0][0])["rules"][-3]["per"] == "step"


@pytest.mark.all_cores
def test_several_files_and_default_workers(capsys, tmp_path):
    for i in range(3):
        write_sequences(str(tmp_path / f"part-{i}.parquet"), random_sequences(20, seed=30 + i), row_group_size=5)
    code, default, err = run(capsys, "analyze", tmp_path, "-f", "json", "--batch-tokens", BATCH)
    assert code == 0, err
    code, one, _ = run(capsys, "analyze", tmp_path, "-f", "json", "--batch-tokens", BATCH, "--workers", 1)
    assert default == one
    assert available_cores() >= 1


def test_progress_counts_every_token_once(dump):
    seen: list[int] = []
    result = analyze(RolloutDataset([dump]), AnalyzeConfig(batch_tokens=BATCH), progress=seen.append, workers=2)
    tokens = sum(len(v) for v in pq.read_table(dump, columns=["new_logp"]).column(0).to_pylist())
    assert sum(seen) == result.metrics["n_tokens"] == tokens


def test_a_workers_validation_error_is_the_same_line(capsys, tmp_path):
    seqs = random_sequences(60, seed=5, max_len=20)
    # Two offenders in different units; the first in file order must be reported, whichever worker finishes first.
    for index in (27, 50):
        seq = seqs[index]
        t = seq.valid()[0]
        seq.new[t] = 0.75
    path = tmp_path / "bad.parquet"
    write_sequences(str(path), seqs, row_group_size=4)
    base = ["analyze", path, "-f", "json", "--batch-tokens", 30]
    code1, out1, err1 = run(capsys, *base, "--workers", 1)
    code2, out2, err2 = run(capsys, *base, "--workers", 2)
    assert code1 == code2 == 2
    assert out1 == out2 == ""
    assert err2 == err1
    assert "row 27" in err1 and "new_logp" in err1 and err1.count("\n") == 1


def test_a_validation_error_while_metric_threads_run_is_the_same_line(capsys, tmp_path):
    # One row group: --workers 3 runs one process whose metric threads are busy with earlier batches when the
    # validator meets the offender; the error line and exit code must be those of one thread.
    seqs = random_sequences(60, seed=6, max_len=20)
    seq = seqs[41]
    seq.new[seq.valid()[0]] = 0.5
    path = tmp_path / "bad.parquet"
    write_sequences(str(path), seqs)
    base = ["analyze", path, "-f", "json", "--batch-tokens", 30]
    code1, out1, err1 = run(capsys, *base, "--workers", 1)
    code3, out3, err3 = run(capsys, *base, "--workers", 3)
    assert code1 == code3 == 2
    assert out1 == out3 == ""
    assert err3 == err1 and "row 41" in err1 and err1.count("\n") == 1


def test_an_accumulator_travels_between_processes_bit_for_bit(dump):
    config = AnalyzeConfig(batch_tokens=BATCH, group_by="step")
    acc = accumulate_states(RolloutDataset([dump]), config, default_groups())
    odd = StateSpec((2,), torch.bfloat16, Reduce.SUM)  # a dtype numpy lacks: pickled as torch pickles it
    acc.overall[0].specs["odd"], acc.overall[0].values["odd"] = odd, torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    back = Accumulator.loads(acc.dumps())
    assert back.by_key.keys() == acc.by_key.keys() and len(acc.by_key) == 8
    pairs = [*zip(acc.overall, back.overall)]
    pairs += [pair for key in acc.by_key for pair in zip(acc.by_key[key], back.by_key[key])]
    for mine, theirs in pairs:
        assert type(theirs) is type(mine) and theirs.specs == mine.specs
        assert mine.values.keys() == theirs.values.keys()
        for name, value in mine.values.items():
            # the same dtype, shape and values (NaN where NaN: the padding of top-k tables), to the last bit
            torch.testing.assert_close(theirs.values[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
    # Keys new to an accumulator are copied by default and taken (the same objects) with take=True.
    first = Accumulator([s.clone() for s in acc.overall], {})
    first.merge_(back)
    assert all(a is not b for a, b in zip(first.by_key[0], back.by_key[0]))
    again = Accumulator([s.clone() for s in acc.overall], {}).merge_(back, take=True)
    assert all(a is b for a, b in zip(again.by_key[0], back.by_key[0]))


def test_input_error_keeps_its_location_through_pickle():
    error = InputError("bad value", file="a.parquet", column="new_logp", row=7, token=2)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is InputError and str(back) == str(error)
    assert (back.file, back.column, back.row, back.token, back.reason) == ("a.parquet", "new_logp", 7, 2, "bad value")


@pytest.mark.parametrize("extra", [{}, {"group_by": "step"}, {"on_invalid": "skip"}])
def test_metric_threads_give_the_same_bytes(dump, extra):
    # One stream of ~25 batches: the groups run in threads with two batches in flight, and must see every batch in
    # order, so the figures are the same bits as one thread's.
    dataset = RolloutDataset([dump])
    config = AnalyzeConfig(batch_tokens=BATCH, **extra)

    def figures(threads: int) -> str:
        groups = default_groups()
        acc = accumulate_states(dataset, config, groups, threads=threads)
        result = finalize(dataset, config, groups, acc)
        return json.dumps([result.metrics, result.groups], sort_keys=True, default=str)

    one = figures(1)
    assert figures(3) == one
    assert figures(2) == one


def test_workers_count_cores_split_into_processes_and_threads(capsys, tmp_path):
    import torch

    assert compute_threads(4, 1, torch.device("cpu")) == 4
    assert compute_threads(4, 2, torch.device("cpu")) == 2
    assert compute_threads(3, 2, torch.device("cpu")) == 1
    assert compute_threads(64, 1, torch.device("cpu")) == MAX_COMPUTE_THREADS
    assert compute_threads(8, 1, torch.device("meta")) == 1  # not a CPU: one thread drives the device
    # A dump of two units with --workers 4: two processes of two metric threads each.
    path = tmp_path / "two_units.parquet"
    write_sequences(str(path), random_sequences(40, seed=8, max_len=24), row_group_size=20)
    base = ["analyze", path, "-f", "json", "--batch-tokens", 50]
    assert len(plan_units(RolloutDataset([path]).shards(), UNIT_BATCHES * 50)) == 2
    code, one, err = run(capsys, *base, "--workers", 1)
    assert code == 0, err
    code, four, err = run(capsys, *base, "--workers", 4)
    assert code == 0, err
    assert four == one


class _Sleeps(CountsGroup):
    """A metric group whose update takes ``seconds`` (sleeping releases the GIL, as torch's kernels do)."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name, self.seconds = name, seconds

    def update(self, state, batch, valid, config):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        super().update(state, batch, valid, config)


@pytest.mark.parametrize(("groups", "threaded"), [
    ([_Sleeps(f"g{i}", 0.02) for i in range(3)], True),
    ([_Sleeps("g0", 0.04), _Sleeps("g1", 0.001), _Sleeps("g2", 0.001)], False),  # one group dominates
])
def test_metric_threads_are_kept_only_when_the_work_can_be_spread(dump, groups, threaded):
    from grpo_cli.engine.runner import _GroupRunner

    config = AnalyzeConfig(batch_tokens=BATCH)
    states = [g.init_state(config, "cpu") for g in groups]
    batches = list(RolloutDataset([dump]).iter_batches(batch_tokens=BATCH))[:4]
    with _GroupRunner(3, len(groups)) as runner:
        for batch in batches:  # two probe batches in this thread, then one timed in the threads, then one more
            valid = batch.valid()
            runner.update([(g, [(s, batch, valid)]) for g, s in zip(groups, states)], config, batch.n_tokens)
        assert (runner.pool is not None) is threaded
        runner.finish()
    assert [int(s["n_sequences"]) for s in states] == [sum(b.n_sequences for b in batches)] * 3


def test_metric_threads_are_dropped_when_the_timed_batch_was_not_faster():
    # Work bound by the interpreter lock (many small ops: --group-by with many keys) is spread over the groups, yet
    # threads hand it over to each other more slowly than one thread runs it: the timed threaded batch decides.
    from grpo_cli.engine.runner import MIN_MEASURED_SPEEDUP, threads_paid_off

    assert MIN_MEASURED_SPEEDUP == 1.1
    assert threads_paid_off([0.9e-6, 0.8e-6], 0.5e-6)
    assert not threads_paid_off([0.9e-6, 0.8e-6], 0.75e-6)  # 0.8 / 0.75 < 1.1: the fastest probe batch counts
    assert not threads_paid_off([7.1e-6, 6.3e-6], 9.9e-6)  # slower in threads


class _FailsOnBatch(CountsGroup):
    """A metric group that raises on a given batch (a bug in a group, as seen from the runner)."""

    def __init__(self, name: str, on_batch: int) -> None:
        self.name, self.on_batch, self.seen = name, on_batch, 0

    def update(self, state, batch, valid, config):  # type: ignore[no-untyped-def]
        self.seen += 1
        if self.seen == self.on_batch:
            raise RuntimeError(f"{self.name} failed on batch {self.seen}")
        super().update(state, batch, valid, config)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_failing_group_raises_the_first_failure_in_order(dump, threads):
    groups = [CountsGroup(), _FailsOnBatch("late", 5), _FailsOnBatch("early", 3)]
    with pytest.raises(RuntimeError, match="early failed on batch 3"):
        accumulate_states(RolloutDataset([dump]), AnalyzeConfig(batch_tokens=BATCH), groups, threads=threads)


def test_bad_workers_is_a_usage_error(capsys, dump):
    code, _, err = run(capsys, "analyze", dump, "--workers", 0)
    assert code == 2 and "--workers" in err


class _DiesInAWorker(CountsGroup):
    """A metric group that kills the worker process running it (as the OOM killer would)."""

    parent = os.getpid()

    def update(self, state, batch, valid, config):  # type: ignore[no-untyped-def]
        if os.getpid() != self.parent:
            os._exit(1)
        super().update(state, batch, valid, config)


def test_a_dead_worker_is_a_one_line_error(dump):
    with pytest.raises(GrpoCliError, match="--workers process died"):
        accumulate(RolloutDataset([dump]), AnalyzeConfig(batch_tokens=BATCH), [_DiesInAWorker()], workers=2)
    # In process it is a plain group.
    acc = accumulate(RolloutDataset([dump]), AnalyzeConfig(batch_tokens=BATCH), [_DiesInAWorker()], workers=1)
    assert int(acc.overall[0]["n_sequences"]) == 80
