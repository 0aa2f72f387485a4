"""`--names verl|trl|areal`: the peer-exact figures (grpo_cli/metrics/peers.py) through the CLI JSON.

Each figure under a peer's key must equal that peer's definition, which `grpo_cli.core.peer_figures` reproduces
(tested against the peers' released code in tests/peers): here the whole dump is one batch of the peer function,
and the streamed figures must not depend on `--batch-tokens`. grpo-cli's own keys keep their values.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from reference import (
    random_sequences,
    trl_reference,
    verl_rollout_corr_reference,
    verl_rollout_rs_reference,
    write_sequences,
)

from grpo_cli.cli import main
from grpo_cli.core.peer_figures import (
    areal_actor_stats,
    trl_cispo_clip_ratio,
    trl_clip_ratio_metrics,
    trl_logged_kl,
    trl_sampling_metrics,
    verl_offpolicy_metrics,
    verl_rollout_is,
    verl_rollout_rs,
)
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.names import NAMES

APPROX = {"rel": 2e-5, "abs": 1e-6}  # the peer functions work in float32 per element, the groups in float64
EXACT = {"rel": 1e-9, "abs": 1e-12}  # the groups against the float64 references of tests/reference.py


def run_json(capsys, *args):
    code = main([str(a) for a in args] + ["--format", "json", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    seqs = [dataclasses.replace(s, current_version=7) for s in random_sequences(30, seed=5, with_prox=True)]
    # one sequence without a valid token: verl counts it in its per-sequence means, critic/score leaves it out
    seqs[3] = dataclasses.replace(seqs[3], mask=[0] * len(seqs[3].new))
    path = tmp_path_factory.mktemp("peer_names") / "d.parquet"
    write_sequences(str(path), seqs, row_group_size=7)
    return path, seqs


def padded(seqs, attr):
    width = max(len(s.new) for s in seqs)
    rows = []
    for s in seqs:
        values = [s.advantage] * len(s.new) if attr == "advantage" else getattr(s, attr)
        rows.append(list(values) + [0] * (width - len(values)))
    dtype = torch.int64 if attr in ("mask", "versions") else torch.float32
    return torch.tensor(rows, dtype=dtype)


def check(metrics, expected, prefix=""):
    assert expected
    for key, value in expected.items():
        assert metrics[prefix + key] == pytest.approx(value, **APPROX), prefix + key


# ------------------------------------------------------------------------------------------------------------
# verl
# ------------------------------------------------------------------------------------------------------------


def test_verl_rollout_corr_is_verls_recompute_against_the_rollout(capsys, dump):
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "verl")["metrics"]
    new, old, prox, mask = (padded(seqs, a) for a in ("new", "old", "prox", "mask"))
    _, is_figures = verl_rollout_is(prox, old, mask, threshold=2.0)
    check(metrics, is_figures, "rollout_corr/")
    check(metrics, verl_offpolicy_metrics(prox, old, mask), "rollout_corr/")
    # bypass mode: the actor logs the current policy against the rollout
    check(metrics, verl_rollout_is(new, old, mask, threshold=2.0)[1], "actor/rollout_corr/")
    check(metrics, verl_offpolicy_metrics(new, old, mask), "actor/rollout_corr/")
    m = mask.bool()
    expected = np.corrcoef(torch.exp(prox[m]).double().numpy(), torch.exp(old[m]).double().numpy())[0, 1]
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(expected, rel=1e-9)
    scored = [s.reward for s in seqs if any(s.mask)]
    assert metrics["critic/score/mean"] == pytest.approx(sum(scored) / len(scored))
    assert (metrics["critic/score/min"], metrics["critic/score/max"]) == (min(scored), max(scored))


def test_verl_truncated_weight_statistics_by_hand(capsys, tmp_path):
    # w = exp(prox − old) = [4, 0.25, 1], C = 2: verl ≥ 0.8 takes statistics of min(w, C) = [2, 0.25, 1]:
    # mean 3.25/3 = 1.0833, max 2, ESS = mean² / mean(w̃²) = 1.0833² / (5.0625/3) = 0.6955.
    old = [-2.0, -0.5, -1.0]
    prox = [o + math.log(w) for o, w in zip(old, (4.0, 0.25, 1.0))]
    seq = random_sequences(1, seed=0)[0]
    seq = dataclasses.replace(seq, new=[-1.0] * 3, old=old, prox=prox, ref=[-1.0] * 3, entropy=[0.5] * 3, mask=[1] * 3,
                              versions=[1] * 3)
    path = tmp_path / "w.parquet"
    write_sequences(str(path), [seq])
    named = run_json(capsys, "analyze", path, "--names", "verl", "--is-threshold", "2")["metrics"]
    assert named["rollout_corr/rollout_is_mean"] == pytest.approx(3.25 / 3, rel=1e-6)
    assert named["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert named["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx((3.25 / 3) ** 2 / (5.0625 / 3), rel=1e-6)
    assert named["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    plain = run_json(capsys, "analyze", path)["metrics"]
    assert "rollout_corr/rollout_is_mean" not in plain and "verl/rollout_corr/rollout_is_mean" not in plain
    # verl ≤ 0.7, an explicit option: statistics of the raw weights, mean 5.25/3 = 1.75, max 4; std and ESS of
    # clamp(w, 1/C, C) = [2, 0.5, 1]: ESS = (3.5/3)² / (5.25/3) = 0.7778
    old_doc = run_json(capsys, "analyze", path, "--names", "verl", "--convention", "verl<=0.7")
    older = old_doc["metrics"]
    assert older["rollout_corr/rollout_is_mean"] == pytest.approx(1.75, rel=1e-6)
    assert older["rollout_corr/rollout_is_max"] == pytest.approx(4.0, rel=1e-6)
    assert older["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx((3.5 / 3) ** 2 / (5.25 / 3), rel=1e-6)
    assert old_doc["config"]["convention"] == "verl<=0.7"


@pytest.mark.parametrize("args", [[], ["--rollout-is", "sequence", "--rollout-is-threshold", "0.5_5"],
                                  ["--rollout-is-threshold", "0.5_2.0"], ["--convention", "verl<=0.7"],
                                  ["--convention", "verl<=0.7", "--rollout-is", "sequence"]])
def test_verl_rollout_corr_against_the_float64_reference(capsys, dump, args):
    # The group and the batch functions share their per-token and per-sequence terms: check both prefixes against
    # verl's definitions recomputed in plain float64 (tests/reference.py), not against each other.
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "verl", "--batch-tokens", "50", *args)["metrics"]
    opts = dict(zip(args[::2], args[1::2]))
    upper, lower = (5.0, 0.5) if opts.get("--rollout-is-threshold") == "0.5_5" else (
        (2.0, 0.5) if "--rollout-is-threshold" in opts else (2.0, None))
    for train, prefix in (("prox", "rollout_corr/"), ("new", "actor/rollout_corr/")):
        expected = verl_rollout_corr_reference(seqs, train, threshold=upper, lower=lower,
                                               level=opts.get("--rollout-is", "token"),
                                               truncate="--convention" not in opts)
        for key, value in expected.items():
            assert metrics[prefix + key] == pytest.approx(value, **EXACT), prefix + key


def test_verl_rollout_rs_against_the_float64_reference(capsys, dump):
    path, seqs = dump
    options = "token_k1,token_k3,seq_sum_k3,seq_mean_k1,seq_mean_k2,seq_max_k2,seq_sum_k1"
    threshold = "0.5_2.0,0.3,2.0,0.9_1.1,0.05,0.5,0.1_3"
    metrics = run_json(capsys, "analyze", path, "--names", "verl", "--batch-tokens", "50", "--rollout-rs", options,
                       "--rollout-rs-threshold", threshold)["metrics"]
    bounds = {}
    for option, part in zip(options.split(","), threshold.split(",")):
        lo, hi = part.split("_") if "_" in part else (None, part)
        bounds[option] = (None if lo is None else float(lo), float(hi))
    for train, prefix in (("prox", "rollout_corr/"), ("new", "actor/rollout_corr/")):
        expected = verl_rollout_rs_reference(seqs, train, bounds)
        assert len(expected) > 90
        for key, value in expected.items():
            assert metrics[prefix + key] == pytest.approx(value, **EXACT), prefix + key


def test_verl_older_release_against_the_peer_function(capsys, dump):
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "verl", "--convention", "verl<=0.7")["metrics"]
    old, prox, mask = (padded(seqs, a) for a in ("old", "prox", "mask"))
    check(metrics, verl_rollout_is(prox, old, mask, threshold=2.0, truncate=False)[1], "rollout_corr/")


@pytest.mark.parametrize(("level", "is_threshold"), [("sequence", "2.0"), ("token", "0.5_2.0"), ("sequence", "0.5_5")])
def test_verl_rollout_is_settings(capsys, dump, level, is_threshold):
    path, seqs = dump
    doc = run_json(capsys, "analyze", path, "--names", "verl", "--rollout-is", level, "--rollout-is-threshold",
                   is_threshold)
    new, old, prox, mask = (padded(seqs, a) for a in ("new", "old", "prox", "mask"))
    upper, lower = (float(x) for x in is_threshold.split("_")[::-1]) if "_" in is_threshold else (
        float(is_threshold), None)
    for train, prefix in ((prox, "rollout_corr/"), (new, "actor/rollout_corr/")):
        _, expected = verl_rollout_is(train, old, mask, level=level, threshold=upper, threshold_lower=lower)
        check(doc["metrics"], expected, prefix)
        assert ("rollout_is_oob_ratio" in expected) == (lower is not None)
    assert doc["config"]["rollout_is"] == level and doc["config"]["rollout_is_threshold"] == is_threshold
    small = run_json(capsys, "analyze", path, "--names", "verl", "--rollout-is", level, "--rollout-is-threshold",
                     is_threshold, "--batch-tokens", "7")["metrics"]
    for key in expected:
        assert small["rollout_corr/" + key] == pytest.approx(doc["metrics"]["rollout_corr/" + key], rel=1e-9,
                                                             abs=1e-12), key


@pytest.mark.parametrize(("options", "threshold"), [("token_k1", "0.5_2.0"), ("seq_sum_k3,seq_max_k2", "2.0,0.5"),
                                                    ("seq_mean_k1,token_k3", "0.9_1.1,0.3")])
def test_verl_rollout_rs(capsys, dump, options, threshold):
    path, seqs = dump
    args = ["analyze", path, "--names", "verl", "--rollout-rs", options, "--rollout-rs-threshold", threshold]
    doc = run_json(capsys, *args)
    new, old, prox, mask = (padded(seqs, a) for a in ("new", "old", "prox", "mask"))
    for train, prefix in ((prox, "rollout_corr/"), (new, "actor/rollout_corr/")):
        _, expected = verl_rollout_rs(train, old, mask, options, threshold)
        check(doc["metrics"], expected, prefix)
        shown = {k for k in doc["metrics"] if k.startswith(prefix + "rollout_rs_")}
        assert shown == {prefix + k for k in expected}  # only the chosen options' keys
    assert doc["config"]["rollout_rs"] == options and "rollout_rs" not in run_json(capsys, "analyze", path)["config"]
    small = run_json(capsys, *args, "--batch-tokens", "7")["metrics"]
    for key in expected:
        assert small["rollout_corr/" + key] == pytest.approx(doc["metrics"]["rollout_corr/" + key], rel=1e-9,
                                                             abs=1e-12), key


def test_verl_rollout_rs_needs_verl_names(capsys, dump):
    path, _ = dump
    metrics = run_json(capsys, "analyze", path, "--rollout-rs", "token_k1", "--rollout-rs-threshold", "2")["metrics"]
    assert not [k for k in metrics if "rollout_rs" in k]


@pytest.mark.parametrize("args", [["--rollout-rs", "token_k1"], ["--rollout-rs", "token_k4", "--rollout-rs-threshold",
                                                                  "2"],
                                  ["--rollout-rs", "token_k2", "--rollout-rs-threshold", "0.5_2"],
                                  ["--rollout-is-threshold", "3_2"], ["--rollout-is", "row"]])
def test_verl_rollout_settings_refused(capsys, dump, args):
    path, _ = dump
    assert main(["analyze", str(path), "-q", "--names", "verl", *args]) == 2
    assert "--rollout-" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--convention", "verl<=0.7"], ["--names", "trl", "--convention", "verl<=0.7"],
                                  ["--names", "verl", "--convention", "verl<=0.1"]])
def test_convention_needs_a_matching_peer(capsys, dump, args):
    path, _ = dump
    assert main(["analyze", str(path), "-q", *args]) != 0
    assert "--convention" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_figures(capsys, dump, level):
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "trl", "--epsilon-high", "0.28",
                       "--importance-level", level)["metrics"]
    new, old, prox, ref, adv, mask = (padded(seqs, a) for a in ("new", "old", "prox", "ref", "advantage", "mask"))
    adv = adv[:, 0]  # the dump holds one advantage per sequence: TRL's (B,) advantages
    check(metrics, trl_clip_ratio_metrics(new, prox, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                                          importance_sampling_level=level), "clip_ratio/")
    # TRL's CISPO cap is the absolute epsilon_high: 1 + grpo-cli's --epsilon-high
    assert metrics["cispo_clip_ratio"] == pytest.approx(
        trl_cispo_clip_ratio(new, prox, adv, mask, epsilon_high=1.28, importance_sampling_level=level), **APPROX)
    assert metrics["kl"] == pytest.approx(
        trl_logged_kl(new, prox, ref, mask, importance_sampling_level=level), **APPROX)
    check(metrics, trl_sampling_metrics(prox, old, mask)[1], "sampling/")


@pytest.mark.parametrize(("level", "args"), [("token", []), ("sequence", []),
                                           ("token", ["--vllm-is-mode", "token_truncate", "--vllm-is-clip-min", "0.9"]),
                                           ("sequence", ["--vllm-is-mode", "sequence_truncate",
                                                         "--vllm-is-clip-max", "1.2"]),
                                           ("token", ["--vllm-is-mode", "token_mask", "--vllm-is-clip-max", "1.1"])])
def test_trl_figures_against_the_float64_reference(capsys, dump, level, args):
    # The group and the batch functions share their per-token and per-sequence terms: check the group against
    # TRL's definitions recomputed in plain float64 (tests/reference.py), not against the batch functions.
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "trl", "--epsilon", "0.05", "--epsilon-high", "0.08",
                       "--importance-level", level, "--batch-tokens", "50", *args)["metrics"]
    opts = dict(zip(args[::2], args[1::2]))
    expected = trl_reference(seqs, level=level, eps=0.05, eps_high=0.08,
                             mode=opts.get("--vllm-is-mode", "sequence_mask"),
                             clip_min=float(opts["--vllm-is-clip-min"]) if "--vllm-is-clip-min" in opts else None,
                             clip_max=float(opts.get("--vllm-is-clip-max", 3.0)))
    assert 0 < expected["clip_ratio/low_mean"] < 1 and 0 < expected["clip_ratio/high_mean"] < 1
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, **EXACT), key


def test_trl_sequence_level_clip_ratios_with_per_token_advantages(capsys, tmp_path):
    # A per-token advantages column is TRL's (B, T) advantages: at sequence level TRL compares the sequence ratio
    # with each token's advantage and takes token means (not one indicator per sequence at its first token).
    rng = np.random.default_rng(11)
    seqs = random_sequences(40, seed=9, with_prox=True, spread=0.6)
    seqs = [dataclasses.replace(s, advantage=0.0) for s in seqs]
    path = tmp_path / "d.parquet"
    write_sequences(str(path), seqs)
    per_token = [rng.normal(size=len(s.new)).astype(np.float32) for s in seqs]
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("advantages"), "advantages",
                             pa.array([a.tolist() for a in per_token], type=pa.list_(pa.float32())))
    pq.write_table(table, path)
    metrics = run_json(capsys, "analyze", path, "--names", "trl", "--importance-level", "sequence",
                       "--epsilon", "0.05")["metrics"]
    new, prox, mask = (padded(seqs, a) for a in ("new", "prox", "mask"))
    width = new.shape[1]
    adv = torch.tensor([list(a) + [0.0] * (width - len(a)) for a in per_token])
    expected = trl_clip_ratio_metrics(new, prox, adv, mask, epsilon_low=0.05, importance_sampling_level="sequence")
    check(metrics, expected, "clip_ratio/")
    reference = trl_reference(seqs, level="sequence", eps=0.05, advantages=per_token)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "cispo_clip_ratio", "kl"):
        assert metrics[key] == pytest.approx(reference[key], **EXACT), key
    # the token means differ from the per-sequence reading (advantage at each sequence's first token)
    first = trl_clip_ratio_metrics(new, prox, adv[:, 0], mask, epsilon_low=0.05, importance_sampling_level="sequence")
    assert abs(first["low_mean"] - expected["low_mean"]) > 1e-3


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip", [("3.0", None), ("1.05", "0.95")])
def test_trl_vllm_importance_sampling_modes(capsys, dump, mode, clip):
    path, seqs = dump
    clip_max, clip_min = clip
    args = ["--vllm-is-mode", mode, "--vllm-is-clip-max", clip_max]
    args += ["--vllm-is-clip-min", clip_min] if clip_min else []
    doc = run_json(capsys, "analyze", path, "--names", "trl", *args)
    old, prox, mask = (padded(seqs, a) for a in ("old", "prox", "mask"))
    _, expected = trl_sampling_metrics(prox, old, mask, mode=mode, clip_max=float(clip_max),
                                       clip_min=None if clip_min is None else float(clip_min))
    check(doc["metrics"], expected, "sampling/")
    assert doc["config"]["vllm_is_mode"] == mode and doc["config"]["vllm_is_clip_max"] == float(clip_max)
    small = run_json(capsys, "analyze", path, "--names", "trl", *args, "--batch-tokens", "7")["metrics"]
    for key in expected:
        assert small["sampling/" + key] == pytest.approx(doc["metrics"]["sampling/" + key], rel=1e-9, abs=1e-12)


def test_trl_vllm_importance_sampling_by_hand(capsys, tmp_path):
    # prox − old = [ln 2, ln 2] and [ln 0.5]: token ratios [2, 2, 0.5], sequence ratios [4, 0.5].
    # C_max = 3, C_min = 0.6: token_truncate [2, 2, 0.6], token_mask [2, 2, 0], sequence_truncate [3, 0.6],
    # sequence_mask [0, 0].
    seqs = []
    for i, diffs in enumerate(([math.log(2.0)] * 2, [math.log(0.5)])):
        seq = random_sequences(1, seed=i)[0]
        old = [-1.0] * len(diffs)
        seqs.append(dataclasses.replace(seq, new=old, old=old, prox=[o + d for o, d in zip(old, diffs)],
                                        ref=old, entropy=[0.5] * len(diffs), mask=[1] * len(diffs),
                                        versions=[1] * len(diffs)))
    path = tmp_path / "is.parquet"
    write_sequences(str(path), seqs)
    expected = {"token_truncate": (0.6, 4.6 / 3, 2.0), "token_mask": (0.0, 4.0 / 3, 2.0),
                "sequence_truncate": (0.6, 1.8, 3.0), "sequence_mask": (0.0, 0.0, 0.0)}
    for mode, (lo, mean, hi) in expected.items():
        metrics = run_json(capsys, "analyze", path, "--names", "trl", "--vllm-is-mode", mode,
                           "--vllm-is-clip-min", "0.6")["metrics"]
        got = [metrics[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max")]
        assert got == pytest.approx([lo, mean, hi], rel=1e-6), mode


@pytest.mark.parametrize("args", [["--vllm-is-mode", "bogus"], ["--vllm-is-clip-max", "0"],
                                  ["--vllm-is-clip-min", "3", "--vllm-is-clip-max", "3"]])
def test_trl_vllm_importance_sampling_bad_options(capsys, dump, args):
    path, _ = dump
    assert main(["analyze", str(path), "-q", "--names", "trl", *args]) == 2
    assert "--vllm-is" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# AReaL
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [[], ["--rs-upper", "1.5"], ["--importance-level", "sequence"],
                                     ["--c-clip", "3", "--rs-upper", "2", "--rs-action", "clamp"]])
def test_areal_actor_statistics(capsys, dump, options):
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "areal", *options)["metrics"]
    config = AnalyzeConfig()
    pairs = dict(zip(options[::2], options[1::2]))
    config.rs_upper = float(pairs["--rs-upper"]) if "--rs-upper" in pairs else None
    config.rs_action = pairs.get("--rs-action")
    new, old, prox, adv, mask, entropy, versions = (
        padded(seqs, a) for a in ("new", "old", "prox", "advantage", "mask", "entropy", "versions"))
    expected = areal_actor_stats(
        new, prox, old, adv, mask, eps_clip=0.2, c_clip=float(pairs["--c-clip"]) if "--c-clip" in pairs else None,
        rejection_sampling=config.rejection_sampling(),
        importance_sampling_level=pairs.get("--importance-level", "token"), entropy=entropy, versions=versions,
        current_version=7)
    compared = 0
    for key, value in expected.items():
        if key.startswith("version_stats/v_") or key in ("clipped_tokens", "dual_clipped_tokens", "n_valid_tokens",
                                                         "unclipped_behave_tokens", "compute_logp/n_valid_tokens"):
            continue  # denominators / constants AReaL logs beside the figures (not reported)
        if key.startswith("compute_logp/prox_logp_gt") or key.startswith("clipped_"):
            continue  # reported by grpo-cli's own figures
        if key.split("/")[0] in ("clip_ratio", "dual_clip_ratio") and not key.endswith("/avg"):
            continue  # only the avg of a 0/1 indicator is reported
        assert metrics[f"ppo_actor/update/{key}"] == pytest.approx(value, **APPROX), key
        compared += 1
    assert compared >= 30
    if "--rs-upper" in pairs and "--rs-action" not in pairs:  # mask: the filtered tokens leave the behave mask
        assert metrics["ppo_actor/update/behave_filtered_ratio/avg"] == pytest.approx(
            expected["rs_filtered_fraction"], **APPROX)
    n_valid = sum(sum(s.mask) for s in seqs)
    assert metrics["ppo_actor/update/n_valid_tokens_in_loss"] == n_valid
    assert metrics["ppo_actor/update/masked_token_ratio"] == pytest.approx(1 - n_valid / sum(len(s.new) for s in seqs))


def test_areal_version_stats_against_the_float64_reference(capsys, dump):
    # AReaL's _log_version_staleness_stats without rejection sampling: over valid generated tokens (version ≥ 0),
    # theta = current − version and proximal = current − 1 − version (the group and areal_version_stats share them)
    path, seqs = dump
    metrics = run_json(capsys, "analyze", path, "--names", "areal", "--batch-tokens", "50")["metrics"]
    lags = [s.current_version - s.versions[t] for s in seqs for t in s.valid() if s.versions[t] >= 0]
    assert len(lags) > 100
    for name, values in (("theta", lags), ("proximal", [x - 1 for x in lags])):
        key = f"ppo_actor/update/version_stats/sample_staleness_{name}_"
        assert metrics[key + "avg"] == pytest.approx(sum(values) / len(values), **EXACT)
        assert (metrics[key + "min"], metrics[key + "max"]) == (min(values), max(values))
    assert metrics["ppo_actor/update/version_stats/n_valid_generated_tokens"] == len(lags)


# ------------------------------------------------------------------------------------------------------------
# streaming and the grpo-cli keys
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["verl", "trl", "areal"])
def test_peer_figures_do_not_depend_on_batch_size(capsys, dump, framework):
    path, _ = dump
    args = ["analyze", path, "--names", framework, "--rs-upper", "2", "--beta", "0.04"]
    whole = run_json(capsys, *args)["metrics"]
    small = run_json(capsys, *args, "--batch-tokens", "7")["metrics"]
    peer_keys = {NAMES[framework][k].key for k in NAMES[framework] if k.startswith(framework + "/")}
    shown = peer_keys & set(whole)
    assert len(shown) >= 12
    for key in shown:
        assert small[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("framework", ["verl", "trl", "areal"])
def test_grpo_cli_keys_keep_their_values(capsys, dump, framework):
    path, _ = dump
    plain = run_json(capsys, "analyze", path)
    named = run_json(capsys, "analyze", path, "--names", framework)
    assert plain["config"]["names"] == "grpo-cli" and named["config"]["names"] == framework
    table = NAMES[framework]
    for key, value in plain["metrics"].items():
        target = table.get(key)
        if target is None:
            assert named["metrics"][key] == value, key
        else:
            assert named["metrics"][target.key] == target.convert(value), key


def test_trl_kl_without_old_log_probs_is_the_plain_k3(capsys, tmp_path):
    # TRL's on-policy shortcut (no old_per_token_logps): coef_1 = 1, so its logged kl is k3 = grpo-cli's kl_ref/k3
    seqs = [dataclasses.replace(s, old=None) for s in random_sequences(12, seed=9)]
    path = tmp_path / "onpolicy.parquet"
    write_sequences(str(path), seqs)
    named = run_json(capsys, "analyze", path, "--names", "trl")["metrics"]
    new, ref, mask = (padded(seqs, a) for a in ("new", "ref", "mask"))
    assert named["kl"] == pytest.approx(trl_logged_kl(new, None, ref, mask), **APPROX)
    assert named["kl"] == pytest.approx(named["kl_ref/k3"], **APPROX)  # grpo-cli works in float32 there
