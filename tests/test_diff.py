"""`grpo-cli diff BASE NEW`: jackknife intervals from one pass per run; a known difference is flagged, a re-run with
another seed is not."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch
from reference import random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.commands.diff import change_interval, findings_only_in, t_critical
from grpo_cli.core.state import MetricState, count, total
from grpo_cli.engine.blocks import jackknife_variances, leave_one_out

N_SEQ = 80  # 8 steps of 10 sequences (20 prompt groups): small, so each diff takes about a second


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def dump(tmp_path, name: str, seed: int, *, spread: float = 0.3, steps: bool = True):
    seqs = random_sequences(N_SEQ, seed, spread=spread)
    if not steps:
        for s in seqs:
            s.step = None
    path = tmp_path / f"{name}.parquet"
    write_sequences(str(path), seqs)
    return path


def diff_json(capsys, base, new, *extra):
    code, out, err = run(capsys, "diff", base, new, "-f", "json", "--workers", 1, "-q", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("steps", [True, False], ids=["step-blocks", "hash-blocks"])
def test_known_difference_is_flagged(capsys, tmp_path, steps):
    # The new run's rollout log-probs are twice as noisy around the trainer's: |Δlogp| grows, as with an inference
    # engine that drifts from the trainer.
    base = dump(tmp_path, "base", 1, steps=steps)
    new = dump(tmp_path, "new", 2, spread=0.6, steps=steps)
    doc = diff_json(capsys, base, new, "--blocks", 10)
    assert doc["tool"]["command"] == "diff"
    assert doc["runs"]["base"]["blocking"] == ("step" if steps else "hash")
    figures = {f["key"]: f for f in doc["figures"]}
    kl = figures["kl/abs_diff_mean"]
    assert kl["significant"] is True
    assert kl["change"] == pytest.approx(kl["new"] - kl["base"])
    assert 0 < kl["low"] < kl["change"] < kl["high"]
    # Ranked: significant first, by how far beyond noise.
    flags = [f["significant"] for f in doc["figures"]]
    assert flags == sorted(flags, reverse=True)
    scores = [f["z_score"] / f["critical"] for f in doc["figures"] if f["significant"]]
    assert scores == sorted(scores, reverse=True)
    assert "kl/abs_diff_mean" in [f["key"] for f in doc["figures"][:10]]
    # Both split by step: the per-step series side by side.
    series = {s["key"]: s for s in doc["series"]}
    if steps:
        assert series["kl/abs_diff_mean"]["steps"] == list(range(8))
        assert len(series["kl/abs_diff_mean"]["base"]) == 8
    else:
        assert series == {}


@pytest.mark.parametrize("steps", [True, False], ids=["step-blocks", "hash-blocks"])
def test_seed_only_difference_flags_nothing(capsys, tmp_path, steps):
    base = dump(tmp_path, "base", 3, steps=steps)
    new = dump(tmp_path, "new", 4, steps=steps)
    doc = diff_json(capsys, base, new, "--blocks", 10)
    flagged = [f["key"] for f in doc["figures"] if f["significant"]]
    assert flagged == []
    assert len(doc["figures"]) > 50
    assert all(f["low"] is not None for f in doc["figures"] if f["key"] == "kl/abs_diff_mean")


def test_table_csv_labels_and_exit_code(capsys, tmp_path):
    base = dump(tmp_path, "base", 1)
    new = dump(tmp_path, "new", 2, spread=0.6)
    code, out, _ = run(capsys, "diff", base, new, "--label", "sglang", "--label", "vllm", "--workers", 1,
                       "--fail-on-change")
    assert code == 1
    assert "vllm vs sglang" in out and "beyond noise" in out and "kl/abs_diff_mean" in out
    assert "Per step" in out  # sparklines
    code, out, _ = run(capsys, "diff", base, new, "-f", "csv", "--workers", 1)
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["key", "base", "new", "change", "low", "high", "significant", "z_score", "rel_change",
                             "note"]
    kl = next(r for r in rows if r["key"] == "kl/abs_diff_mean")
    assert kl["significant"] == "True" and float(kl["low"]) > 0
    # Extremes and quantiles get no interval (the jackknife is not valid for them) and are never flagged.
    p99 = next(r for r in rows if r["key"].endswith("/p99"))
    assert p99["low"] == "" and p99["significant"] == "False" and "quantile" in p99["note"]


def test_usage_errors(capsys, tmp_path):
    base = dump(tmp_path, "base", 1)
    code, _, err = run(capsys, "diff", base)
    assert code == 2 and "BASE and NEW" in err
    code, _, err = run(capsys, "diff", base, base, "--label", "x", "--label", "x")
    assert code == 2 and "different labels" in err
    code, _, err = run(capsys, "diff", base, base, "--z", "0")
    assert code == 2 and "--z" in err


def test_more_paths_per_run(capsys, tmp_path):
    a, b = dump(tmp_path, "a", 1), dump(tmp_path, "b", 2)
    doc = diff_json(capsys, a, a, "--new", b)
    assert doc["inputs"] == [str(a), str(a), str(b)]
    n = {f["key"]: f for f in doc["figures"]}["n_sequences"]
    assert (n["base"], n["new"]) == (N_SEQ, 2 * N_SEQ)


def test_findings_only_in_one_run():
    kl = {"code": "KL_HIGH", "category": "mismatch", "severity": "warning", "title": "|Δlogp| 0.036"}
    kl_other_number = {**kl, "title": "|Δlogp| 0.011", "severity": "info"}
    clip = {"code": "CLIP", "category": "clipping", "severity": "error", "title": "clip/ratio 0.4"}
    stale = {"code": "STALE", "category": "staleness", "severity": "warning", "title": "lag 3"}
    out = findings_only_in([kl_other_number, stale], [kl, clip])
    assert [(f["code"], f["only_in"]) for f in out] == [("STALE", "base"), ("CLIP", "new")]
    assert out[1]["title"] == "clip/ratio 0.4"
    assert findings_only_in([], []) == [] and findings_only_in([kl], [kl]) == []


def test_change_interval():
    c = change_interval(1.0, 1.5, 0.01, 0.0, z=3.0)
    assert (c.change, c.low, c.high, c.significant, c.critical) == (0.5, 0.2, 0.8, True, 3.0)
    assert c.z_score == pytest.approx(5.0)
    c = change_interval(1.0, 1.1, 0.01, 0.0, z=3.0)
    assert c.low < 0 < c.high and not c.significant and c.z_score == pytest.approx(1.0)
    assert change_interval(1.0, 2.0, None, 0.1)[1:] == (None, None, False, None, None)
    assert change_interval(1.0, 2.0, 0.0, 0.0)[1:] == (None, None, False, None, None)  # no spread: no verdict
    # Few blocks: the interval widens (Student's t), so a 3.5 s.e. change is noise with 5 + 5 blocks only.
    assert change_interval(0.0, 0.35, 0.005, 0.005, z=3.0).significant
    few = change_interval(0.0, 0.35, 0.005, 0.005, z=3.0, dof_base=4, dof_new=4)
    assert not few.significant and few.critical > 4


def test_t_critical_matches_tables():
    # Student's t quantiles at Φ(3) (solved with mpmath's regularised incomplete beta function).
    for dof, exact in ((4, 6.6202), (5, 5.5071), (7, 4.53), (10, 3.9569), (20, 3.4222), (60, 3.1299)):
        assert t_critical(3.0, dof) == pytest.approx(exact, rel=0.01), dof
    assert t_critical(3.0, math.inf) == 3.0


class _Mean:
    """A minimal metric group: the mean of the values folded into it."""

    figures = ()

    def compute(self, state, config):
        return {"mean": float(state["s"] / state["n"])}


def test_jackknife_of_a_mean_is_the_classic_formula():
    # With one value per block, the jackknife variance of the mean is s²/n (Efron 1982, §3.2).
    values = [0.3, 1.2, -0.5, 2.0, 0.9, 1.1, -0.2]
    blocks = []
    for v in values:
        state = MetricState({"s": total(), "n": count()})
        state.update(s=torch.tensor(v, dtype=torch.float64), n=torch.tensor(1))
        blocks.append([state])
    loo = leave_one_out(blocks)
    assert [float(states[0]["n"]) for states in loo] == [6.0] * 7
    assert float(loo[2][0]["s"]) == pytest.approx(sum(values) - values[2])
    n = len(values)
    mean = sum(values) / n
    s2 = sum((v - mean) ** 2 for v in values) / (n - 1)
    var = jackknife_variances([_Mean()], None, blocks, ["mean"])["mean"]
    assert math.isclose(var, s2 / n, rel_tol=1e-12)


def test_blocks_do_not_depend_on_batching(tmp_path):
    # A sequence's block is a hash of where it is in the dump (its prompt group), never of the batch it came in
    # or of the process that read it.
    from grpo_cli.commands.diff import DiffConfig
    from grpo_cli.engine.parallel import accumulate
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.metrics import default_groups

    seqs = random_sequences(N_SEQ, 1)
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=8)  # several units, so two workers share the dump
    counts = []
    for batch_tokens, workers in ((200, 1), (1 << 20, 2)):
        config = DiffConfig(batch_tokens=batch_tokens, hash_blocks=8)
        groups = default_groups()
        acc = accumulate(RolloutDataset([str(path)]), config, groups, workers=workers)
        index = next(i for i, g in enumerate(groups) if "n_sequences" in g.expected_keys(config))
        counts.append({key: int(groups[index].compute(states[index], config)["n_sequences"])
                       for key, states in acc.by_key.items()})
    assert counts[0] == counts[1]
    assert len(counts[0]) == 8 and sum(counts[0].values()) == N_SEQ
    assert all(n % 4 == 0 for n in counts[0].values())  # group_id = index // 4: a prompt group stays in one block


def test_report_compare_draws_the_base_run_on_every_trend_chart(capsys, tmp_path):
    import html as html_lib
    import re

    base = dump(tmp_path, "base", 1)
    new = dump(tmp_path, "new", 2, spread=0.6)
    page_path = tmp_path / "r.html"
    code, _, err = run(capsys, "report", new, "--compare", base, "-o", page_path, "-q")
    assert code == 0, err
    page = page_path.read_text()
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    data = json.loads(html_lib.unescape(match.group(1)))
    compare = data["compare"]
    assert compare["label"] == "base" and compare["analyze"]["inputs"] == [str(base)]
    assert compare["per_step"]["keys"] == list(range(8))
    # The base's figures are analyze's, with the report's options.
    doc = json.loads(run(capsys, "analyze", base, "-f", "json", "--top-k", "0")[1])
    assert compare["analyze"]["metrics"]["kl/abs_diff_mean"] == doc["metrics"]["kl/abs_diff_mean"]
    assert "kl/k3 (base)" in page  # a dashed base line in the legend of the KL chart


def test_check_baseline_records_the_change_as_diff_computes_it(capsys, tmp_path):
    base = dump(tmp_path, "base", 1)
    new = dump(tmp_path, "new", 2, spread=0.6)
    code, out, _ = run(capsys, "analyze", base, "-f", "json")
    baseline = tmp_path / "base.json"
    baseline.write_text(out)
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmetric = "kl/abs_diff_mean"\nmax_rel_increase = 0.5\n')
    code, out, _ = run(capsys, "check", new, "--rules", rules, "--baseline", baseline, "-f", "json")
    rule = next(r for r in json.loads(out)["rules"] if r["metric"] == "kl/abs_diff_mean")
    assert code == 1 and rule["status"] == "fail"
    assert rule["change"] == pytest.approx(rule["value"] - rule["baseline"])
    assert rule["rel_change"] == pytest.approx(rule["change"] / abs(rule["baseline"]))
