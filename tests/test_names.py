"""`--names areal|verl|trl|twinkle` against the tables in docs/metrics.md, and the AReaL actor statistics.

The name tables are parsed from the Markdown (not imported twice from the code), so the documentation and
`grpo_cli.metrics.names` cannot drift apart. Figures of the new AReaL statistics are derived by hand in the comments.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import random_sequences, write_sequences

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.cli import main
from grpo_cli.metrics.names import FRAMEWORKS, NAMES, rename_metrics
from grpo_cli.metrics.registry import KEYS

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
TRANSFORM_CELLS = {"=": "", "−x": "neg", "x²": "square"}
PROX_METHODS = ("loglinear", "linear", "rollout")


# `<m>` each AReaL proximal approximation; `<o>` each verl rollout_rs option, `<k1>` its k1 options.
PLACEHOLDERS = {"<m>": PROX_METHODS, "<o>": VERL_RS_OPTIONS,
                "<k1>": tuple(o for o in VERL_RS_OPTIONS if o.endswith("k1"))}


def expand_placeholders(*names: str) -> list[tuple[str, ...]]:
    """``names`` with a placeholder replaced by each of its values (the same value in every name)."""
    for mark, values in PLACEHOLDERS.items():
        if mark in names[0]:
            return [tuple(n.replace(mark, v) for n in names) for v in values]
    return [names]


def docs_tables() -> dict[str, set[tuple[str, str, str]]]:
    """``{framework: {(grpo-cli key, framework key, transform)}}`` from the 'Names per framework' section."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("\n## Names per framework\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, set[tuple[str, str, str]]] = {}
    framework = None
    for line in section.splitlines():
        heading = re.match(r"^### .*\(`--names (\w+)`\)", line)
        if heading:
            framework = heading.group(1)
            tables[framework] = set()
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if framework is None or len(cells) < 3 or not cells[0].startswith("`"):
            continue
        ours, theirs, value = cells[0].strip("`"), cells[1].strip("`"), cells[2]
        assert value in TRANSFORM_CELLS, line
        for key_ours, key_theirs in expand_placeholders(ours, theirs):
            tables[framework].add((key_ours, key_theirs, TRANSFORM_CELLS[value]))
    return tables


def test_docs_tables_match_the_code():
    tables = docs_tables()
    assert sorted(tables) == sorted(FRAMEWORKS)
    for framework in FRAMEWORKS:
        code = {(ours, fk.key, fk.transform) for ours, fk in NAMES[framework].items()}
        assert tables[framework] == code, framework


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tables_are_one_to_one_and_name_real_keys(framework):
    table = NAMES[framework]
    theirs = [fk.key for fk in table.values()]
    assert len(theirs) == len(set(theirs)), "two figures under one framework key"
    unknown = [key for key in table if key not in KEYS]
    assert not unknown, f"mapped keys grpo-cli does not report: {unknown}"
    assert not set(theirs) & set(KEYS), "a framework key that is also a grpo-cli key would be ambiguous"


def test_rename_metrics_conversions():
    metrics = {"logp/diff_mean": 0.25, "ratio/log_mean": -0.5, "n_sequences": 3, "top_kl": [{"kl": 1.0}],
               "m2po/exact": True, "prox/linear/rmse": 0.5, "areal/compute_logp/kl_div_direct/avg": None}
    areal = rename_metrics(metrics, "areal")
    # ratio/log_mean is no longer AReaL's approx_kl/avg: that is the peer-exact areal/approx_kl/avg
    assert areal == {"ppo_actor/update/logp_diff/avg": -0.25, "ratio/log_mean": -0.5,
                     "ppo_actor/n_seqs": 3, "top_kl": [{"kl": 1.0}], "m2po/exact": True,
                     "ppo_actor/update/compute_logp/linear/squared_error/avg": 0.25,
                     "ppo_actor/update/compute_logp/kl_div_direct/avg": None}
    assert list(areal)[:3] == ["ppo_actor/update/logp_diff/avg", "ratio/log_mean",
                               "ppo_actor/n_seqs"]  # order kept
    assert rename_metrics(metrics, "verl")["actor/ppo_kl"] == 0.5  # verl: mean(old − new)
    assert rename_metrics(metrics, "grpo-cli") == metrics and rename_metrics(metrics, None) == metrics
    with pytest.raises(ValueError, match="unknown framework"):
        rename_metrics(metrics, "openrlhf")


# ==============================================================================================================
# end to end
# ==============================================================================================================


def run_json(capsys, *args):
    code = main([str(a) for a in args] + ["--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "d.parquet"
    seqs = random_sequences(40, seed=8)
    write_sequences(str(path), seqs, row_group_size=11)
    return path, seqs


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_analyze_names_relabels_every_mapped_figure(capsys, dump, framework):
    path, _ = dump
    plain = run_json(capsys, "analyze", path, "--max-new-tokens", "20")
    named = run_json(capsys, "analyze", path, "--max-new-tokens", "20", "--names", framework)
    table = NAMES[framework]
    expected = {}
    for key, value in plain["metrics"].items():
        target = table.get(key)
        expected[target.key if target else key] = target.convert(value) if target else value
    # besides these, the peer-exact figures (grpo_cli/metrics/peers.py, tests/test_peer_names.py)
    peer_exact = {table[k].key for k in table if k.startswith(framework + "/")}
    assert {k: v for k, v in named["metrics"].items() if k not in peer_exact} == expected
    assert named["config"]["names"] == framework and plain["config"]["names"] == "grpo-cli"
    mapped = [key for key in plain["metrics"] if key in table]
    assert len(mapped) >= 6  # the dump exercises a good part of every table (TRL: 6 of its grpo-cli keys)
    for key in plain["omitted"]:
        assert (table[key].key if key in table else key) in named["omitted"]


def test_sign_conventions_against_a_reference(capsys, dump):
    path, seqs = dump
    # mean(new − old) over valid tokens with plain loops: AReaL's logp_diff and verl's ppo_kl are −this
    # (no prox_logp in this dump, so the ratio base is old_logp).
    diffs = [s.new[t] - s.old[t] for s in seqs for t in s.valid()]
    mean_diff = sum(diffs) / len(diffs)
    areal = run_json(capsys, "analyze", path, "--names", "areal")["metrics"]
    assert areal["ppo_actor/update/logp_diff/avg"] == pytest.approx(-mean_diff, rel=1e-6)
    assert areal["ppo_actor/update/approx_kl/avg"] == pytest.approx(mean_diff, rel=1e-6)
    assert areal["ppo_actor/update/logp_abs_diff/avg"] == pytest.approx(
        sum(abs(d) for d in diffs) / len(diffs), rel=1e-6)
    verl = run_json(capsys, "analyze", path, "--names", "verl")["metrics"]
    assert verl["actor/ppo_kl"] == pytest.approx(-mean_diff, rel=1e-6)
    # no prox_logp: verl's bypass mode, current (new) against rollout (old): mean(rollout − current)
    assert verl["actor/rollout_corr/kl"] == pytest.approx(-mean_diff, rel=1e-6)
    twinkle = run_json(capsys, "analyze", path, "--names", "twinkle")["metrics"]
    assert twinkle["train/logp_diff_mean"] == pytest.approx(mean_diff, rel=1e-6)


def test_names_table_group_by_and_csv(capsys, dump):
    path, _ = dump
    code = main(["analyze", str(path), "--names", "areal", "--group-by", "step", "--all"])
    out, _ = capsys.readouterr()
    assert code == 0
    # label + grpo-cli key (the peer-exact figure of grpo_cli/metrics/peers.py)
    assert "ppo_actor/update/importance_weight/max" in out and "areal/importance_weight/max:" in out
    header = out.split("Per step")[1].splitlines()[2]
    assert header.count("ppo_actor/update/") == 2  # the default per-group columns that have an AReaL name
    doc = run_json(capsys, "analyze", path, "--names", "trl", "--group-by", "step")
    assert all("clip_ratio/region_mean" in g["metrics"] for g in doc["groups"])
    code = main(["analyze", str(path), "--names", "twinkle", "--format", "csv"])
    out, _ = capsys.readouterr()
    assert code == 0 and "\ntrain/approx_kl," in out
    code = main(["analyze", str(path), "--names", "areal", "--group-by", "step", "--metrics",
                 "ppo_actor/update/clip_ratio/avg"])
    assert code == 0
    capsys.readouterr()


def test_compare_prox_names(capsys, tmp_path):
    path = tmp_path / "p.parquet"
    write_sequences(str(path), random_sequences(30, seed=2, with_prox=True))
    plain = run_json(capsys, "compare-prox", path)["metrics"]
    named = run_json(capsys, "compare-prox", path, "--names", "areal")["metrics"]
    for m in PROX_METHODS:
        base = f"ppo_actor/update/compute_logp/{m}/"
        assert named[base + "abs_error/avg"] == plain[f"prox/{m}/abs_error_mean"]
        assert named[base + "squared_error/avg"] == pytest.approx(plain[f"prox/{m}/rmse"] ** 2, rel=1e-12)
    code = main(["compare-prox", str(path), "--names", "areal"])
    out, _ = capsys.readouterr()
    assert code == 0 and "compute_logp/loglinear/abs_error/avg" in out


# ==============================================================================================================
# the AReaL actor statistics (hand-derived)
# ==============================================================================================================


def actor_dump(path, *, eos=True):
    # A: prompt 1, valid r = [e^0, e^−0.3, e^0.5], A = +1 → only the last (1.65 > 1.2) is clipped.
    # B: prompt 2, valid r = [e^0.7, e^−1], A = −1 → only the last (0.37 < 0.8) is clipped (2.01 > 1.2 with A < 0
    #    is not a PPO clip). C: no loss-mask token at all.
    rows = [
        ([-1.0, -1.0, -0.5, -2.0], [-1.0, -1.0, -0.2, -2.5], [0, 1, 1, 1], 1.0, 1.0, True),
        ([-1.0, -1.0, -0.3, -3.0], [-1.0, -1.0, -1.0, -2.0], [0, 0, 1, 1], -1.0, 0.0, True),
        ([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [0, 0, 0], 0.0, 0.0, False),
    ]
    f32 = pa.list_(pa.float32())
    cols = {"new_logp": pa.array([r[0] for r in rows], f32), "old_logp": pa.array([r[1] for r in rows], f32),
            "loss_mask": pa.array([r[2] for r in rows], pa.list_(pa.int8())),
            "advantages": pa.array([r[3] for r in rows], pa.float32()),
            "rewards": pa.array([r[4] for r in rows], pa.float32())}
    if eos:
        cols["eos"] = pa.array([r[5] for r in rows], pa.bool_())
    pq.write_table(pa.table(cols), path, row_group_size=2)


def test_actor_statistics_hand_derived(capsys, tmp_path):
    path = tmp_path / "a.parquet"
    actor_dump(path)
    m = run_json(capsys, "analyze", path)["metrics"]
    # Clipped tokens: A's last (new −2, old −2.5) and B's last (new −3, old −2).
    assert m["logp/clipped_new_mean"] == pytest.approx(-2.5)
    assert m["logp/clipped_old_mean"] == pytest.approx(-2.25)
    # log r over the 5 valid tokens: 0, −0.3, 0.5, 0.7, −1 → −0.1/5.
    assert m["ratio/log_mean"] == pytest.approx(-0.02, abs=1e-7)
    # Prompts 1, 2, 3 (C has no loss-mask token: all prompt); lengths 4, 4, 3.
    assert (m["seq/prompt_len_mean"], m["seq/prompt_len_min"], m["seq/prompt_len_max"]) == (2.0, 1, 3)
    assert m["seq/total_len_mean"] == pytest.approx(11 / 3)
    assert (m["seq/total_len_min"], m["seq/total_len_max"]) == (3, 4)
    # Rewards 1, 0, 0: one correct (length 4), two incorrect (lengths 4 and 3).
    assert (m["seq/n_correct"], m["seq/n_incorrect"]) == (1, 2)
    assert (m["seq/correct_total_len_mean"], m["seq/incorrect_total_len_mean"]) == (4.0, 3.5)
    assert (m["seq/incorrect_total_len_min"], m["seq/incorrect_total_len_max"]) == (3, 4)
    assert (m["reward/min"], m["reward/max"]) == (0.0, 1.0)
    assert m["seq/no_eos_frac"] == pytest.approx(1 / 3)  # the eos column: C was cut off
    areal = run_json(capsys, "analyze", path, "--names", "areal")["metrics"]
    assert areal["ppo_actor/update/clipped_new_logp/avg"] == pytest.approx(-2.5)
    assert areal["ppo_actor/seq_len/avg"] == pytest.approx(11 / 3)
    assert areal["ppo_actor/no_eos_ratios/avg"] == pytest.approx(1 / 3)
    assert (areal["ppo_actor/correct_n_seqs"], areal["ppo_actor/incorrect_n_seqs"]) == (1, 2)


def test_no_eos_from_max_new_tokens_and_omissions(capsys, tmp_path):
    path = tmp_path / "n.parquet"
    actor_dump(path, eos=False)
    doc = run_json(capsys, "analyze", path)
    assert "seq/no_eos_frac" not in doc["metrics"]
    assert doc["omitted"]["seq/no_eos_frac"] == "needs an 'eos' column or --max-new-tokens"
    # Response lengths 3, 2, 0: with --max-new-tokens 2, A and B reached the limit.
    doc = run_json(capsys, "analyze", path, "--max-new-tokens", "2")
    assert doc["metrics"]["seq/no_eos_frac"] == pytest.approx(2 / 3)
    # Without any clipped token the clipped means are absent (AReaL drops an empty stat too).
    doc = run_json(capsys, "analyze", path, "--epsilon", "5")
    assert "logp/clipped_new_mean" not in doc["metrics"] and not math.isnan(doc["metrics"]["ratio/log_mean"])
