"""Off-policy figures through `grpo-cli analyze` (in-process): options, omissions, batch independence, sample data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import exact_lower_quantile, offpolicy_reference, random_sequences, write_sequences

from grpo_cli.cli import main
from grpo_cli.core.histogram import QUANTILE_REL_ERROR

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def analyze_json(capsys, *args):
    code, out, err = run(capsys, "analyze", *args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    seqs = random_sequences(48, seed=31, with_prox=True, spread=0.5)
    path = tmp_path_factory.mktemp("offpolicy") / "rollouts.parquet"
    write_sequences(str(path), seqs, row_group_size=7)
    return path, seqs


OFFPOLICY_PREFIXES = ("kl/", "kl_ref/", "behave/", "rs/", "m2po/", "is/", "ppl/", "prob/", "ratio/", "abs_diff/",
                      "staleness/", "by_staleness", "sanity/n_on", "sanity/on_", "spikes/", "adv/", "seq/", "reward/",
                      "groups/")


def test_figures_match_the_reference(capsys, dump):
    path, seqs = dump
    doc = analyze_json(capsys, path, "--epsilon-high", "0.28", "--is-threshold", "1.5")
    metrics = doc["metrics"]
    ref = offpolicy_reference(seqs, eps_high=0.28, is_threshold=1.5)
    for key, value in ref.items():
        if key.startswith("_"):
            continue
        if isinstance(value, list):
            assert len(metrics[key]) == len(value), key
            for got, want in zip(metrics[key], value):
                assert got == pytest.approx(want, rel=1e-5, abs=1e-9), key
        else:
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    for name in ("ratio", "abs_diff"):
        for suffix, q in (("p001", 0.001), ("p50", 0.5), ("p999", 0.999)):
            exact = exact_lower_quantile(ref[f"_{name}"], q)
            assert abs(metrics[f"{name}/{suffix}"] - exact) <= (QUANTILE_REL_ERROR + 1e-6) * exact
    assert doc["config"]["quantile_rel_error"] == QUANTILE_REL_ERROR
    assert doc["config"]["is_threshold"] == 1.5 and doc["config"]["staleness_max_lag"] == 64


def test_batch_tokens_do_not_change_any_figure(capsys, dump):
    path, _ = dump
    options = ("--m2-threshold", "0.05", "--rs-level", "sequence", "--rs-upper", "1.1", "--kl-clamp", "0.5")
    docs = [analyze_json(capsys, path, *options, "--batch-tokens", n)["metrics"] for n in (1, 13, 100000)]
    assert docs[0]["rs/filtered_fraction"] > 0 and docs[0]["m2po/masked_fraction"] > 0
    for other in docs[1:]:
        assert other.keys() == docs[0].keys()
        for key, value in docs[0].items():
            if not key.startswith(OFFPOLICY_PREFIXES):
                continue  # other issues' figures have their own tests
            if isinstance(value, float):
                assert other[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
            elif isinstance(value, list) and key == "by_staleness":
                for got, want in zip(other[key], value):
                    assert got == pytest.approx(want, rel=1e-12, abs=1e-15), key
            else:
                assert other[key] == value, key


def test_options_change_the_figures(capsys, dump):
    path, seqs = dump
    base = analyze_json(capsys, path)["metrics"]
    clamped = analyze_json(capsys, path, "--kl-clamp", "0.01")["metrics"]
    ref = offpolicy_reference(seqs, ref_kl_clamp=0.01)
    for key in ("kl/k1", "kl/k2", "kl/k3", "kl_ref/k1", "kl_ref/k2", "kl_ref/k3"):
        assert clamped[key] == pytest.approx(ref[key], rel=1e-5), key
    # The clamp is the KL loss's (kl_ref/*, verl actor/kl_loss); train/rollout figures never change with it.
    assert clamped["kl_ref/k3"] < base["kl_ref/k3"]
    for key in ("kl/k1", "kl/k2", "kl/k3", "by_staleness", "top_kl"):
        assert clamped[key] == base[key], key
    strict = analyze_json(capsys, path, "--is-threshold", "1.05")["metrics"]
    assert strict["is/frac_high"] > base["is/frac_high"]
    assert "rs/filtered_fraction" not in base and "m2po/masked_fraction" not in base


def test_current_version_option_is_the_fallback(capsys, tmp_path):
    seqs = random_sequences(20, seed=6)
    for s in seqs:
        s.current_version = None  # the dump has no current_version column
    path = tmp_path / "nocv.parquet"
    write_sequences(str(path), seqs)
    doc = analyze_json(capsys, path)
    assert "staleness/theta_mean" not in doc["metrics"]
    assert "--current-version" in doc["omitted"]["staleness/theta_mean"]
    metrics = analyze_json(capsys, path, "--current-version", "9")["metrics"]
    ref = offpolicy_reference(seqs, current_version=9)
    assert metrics["staleness/theta_mean"] == pytest.approx(ref["staleness/theta_mean"])
    assert metrics["by_staleness"][0]["lag"] == ref["by_staleness"][0]["lag"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--kl-clamp", "0"), "--kl-clamp"),
        (("--is-threshold", "0.5"), "--is-threshold"),
        (("--m2-threshold", "nan"), "--m2-threshold"),
        (("--rs-metric", "kl_k3", "--rs-action", "clamp"), "rejection sampling"),
    ],
)
def test_bad_options_exit_2(capsys, dump, args, message):
    code, _, err = run(capsys, "analyze", dump[0], *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_absent_inputs_are_omitted_with_reasons(capsys, tmp_path):
    seqs = random_sequences(12, seed=2)
    for s in seqs:
        s.old = s.ref = s.versions = None
        s.reward = None
    path = tmp_path / "bare.parquet"
    write_sequences(str(path), seqs)
    doc = analyze_json(capsys, path)
    metrics, omitted = doc["metrics"], doc["omitted"]
    for key in ("kl/k1", "is/mean", "prob/pearson", "abs_diff/p50", "ratio/p50", "spikes/n_ratio_gt_1e3"):
        assert key not in metrics and ("old_logp" in omitted[key] or "prox_logp" in omitted[key]), key
    assert "ref_logp" in omitted["kl_ref/k3"]
    assert "versions" in omitted["by_staleness"] and "versions" in omitted["sanity/on_policy_ratio_dev"]
    assert "rewards" in omitted["groups/zero_std_frac"] and "prox_logp" in omitted["behave/approx_kl"]
    assert "ppl/new" in metrics and "adv/mean" in metrics and "seq/len_mean" in metrics


def test_sample_data_is_non_trivial_in_every_section(capsys):
    if not SAMPLE.exists():
        pytest.skip("sample_data/rollouts.parquet is not there")
    doc = analyze_json(capsys, SAMPLE, "--m2-threshold", "0.03", "--rs-upper", "2")
    m = doc["metrics"]
    # KL families: a real bf16/fp32 mismatch plus staleness, and drift from the initial weights
    assert m["kl/k3"] > 0 and m["kl/k2"] > 0 and m["kl/abs_diff_max"] > 1 and m["kl_ref/k3"] > 0.1
    # decoupled PPO
    assert m["behave/imp_weight_min"] < 1 < m["behave/imp_weight_max"] <= 2
    assert 0 < m["rs/filtered_fraction"] < 0.1 and 0 < m["m2po/masked_fraction"] < 0.5 and m["m2po/exact"]
    # importance-weight health
    assert m["is/std"] > 0 and 0 < m["is/ess"] < 1 and m["is/frac_high"] > 0 and m["is/frac_low"] > 0
    assert m["is/chi2_seq"] > m["is/chi2_token"] > 0 and m["ppl/old"] != m["ppl/new"] and 0.5 < m["prob/pearson"] < 1
    # distributions
    assert m["ratio/p001"] < m["ratio/p50"] < m["ratio/p999"] and m["abs_diff/p01"] < m["abs_diff/p99"]
    assert sum(m["ratio/hist"]["counts"]) > 0.99 * m["n_valid_tokens"]
    # staleness 0–4 and the cross-tab: stale tokens drift further from the behaviour policy
    assert m["staleness/theta_min"] == 0 and m["staleness/theta_max"] == 4
    lags = m["by_staleness"]
    assert [row["lag"] for row in lags] == [0, 1, 2, 3, 4]
    assert lags[0]["kl/k3"] < lags[4]["kl/k3"] and all(row["clip/ratio"] > 0 for row in lags)
    # sequences and groups
    assert 0 < m["groups/zero_std_frac"] < 1 and m["groups/n"] > 1 and 0 < m["adv/zero_frac"] < 1
    assert m["seq/len_min"] < m["seq/len_max"] and m["reward/std"] > 0
    # lag-0 tokens differ by bf16 rounding only; no ratio spikes above 1e3 in this healthy run
    assert 0 < m["sanity/on_policy_ratio_dev"] < 1 and m["sanity/n_on_policy_tokens"] > 0
    assert m["spikes/n_ratio_gt_1e3"] == 0


def test_spikes_are_counted_and_lead_top_kl(capsys, tmp_path):
    seqs = random_sequences(16, seed=3)
    seqs[5].old[seqs[5].valid()[0]] = seqs[5].new[seqs[5].valid()[0]] - 8.0  # w = e^8 ≈ 2981 > 1e3
    path = tmp_path / "spike.parquet"
    write_sequences(str(path), seqs)
    metrics = analyze_json(capsys, path)["metrics"]
    assert metrics["spikes/n_ratio_gt_1e3"] == 1
    assert metrics["top_kl"][0]["row"] == 5 and metrics["top_kl"][0]["ratio"] > 1e3


def test_table_shows_histograms_and_the_cross_tab(capsys, dump):
    code, out, _ = run(capsys, "analyze", dump[0], "--all")
    assert code == 0
    assert "Distributions" in out and "ratio/hist" in out and "abs_diff/hist" in out and "staleness/hist" in out
    assert "By staleness" in out and "is/ess" in out and "kl_ref/k3" in out
