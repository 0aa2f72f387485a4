"""``grpo-cli advantages`` on a mismatch: which common variant of the estimator reproduces the dump.

Every dump here is built by hand from one variant's formula (plain Python below), then checked with a different
configured estimator: the JSON must name that variant in ``matching_variant`` and count the others' mismatches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_advantages_check import run, seqs_with, write_dump

# Two groups, no one-sequence group; the rewards are small so that σ is small and a change of ε shows beyond atol:
# group 0: rewards 0.01, 0, 0 → μ = 0.01/3, Σ(r − μ)² = 2/3·1e-4 (σ unbiased = √(1/3·1e-4) ≈ 0.00577);
# group 1: rewards 0.02, 0 → μ = 0.01, Σ(r − μ)² = 2e-4 (σ unbiased = √2e-4 ≈ 0.01414).
# With these, ε = 1e-6 against 1e-4 moves the advantages by ≥ 0.005, and 1e-6 against 1e-8 by ≥ 1.4e-5 > atol.
REWARDS = [0.01, 0.0, 0.0, 0.02, 0.0]
GROUPS = [0, 0, 0, 1, 1]


def _members(i):
    return [r for r, g in zip(REWARDS, GROUPS) if g == GROUPS[i]]


def grpo(eps, biased=False):
    out = []
    for i, r in enumerate(REWARDS):
        members = _members(i)
        n = len(members)
        mu = sum(members) / n
        sd = math.sqrt(sum((x - mu) ** 2 for x in members) / (n if biased else n - 1))
        out.append((r - mu) / (sd + eps))
    return out


def drgrpo():
    return [r - sum(_members(i)) / len(_members(i)) for i, r in enumerate(REWARDS)]


def rloo():
    return [r - (sum(_members(i)) - r) / (len(_members(i)) - 1) for i, r in enumerate(REWARDS)]


def check(capsys, path, *options):
    code, out, err = run(capsys, "advantages", path, *options, "--format", "json")
    assert "error:" not in err
    return code, json.loads(out)


@pytest.mark.parametrize(
    ("configured", "dump", "expected"),
    [
        (["--estimator", "grpo"], grpo(1e-4), "--estimator grpo --std-eps 1e-4"),
        (["--estimator", "grpo"], grpo(1e-5), "--estimator grpo --std-eps 1e-5"),
        (["--estimator", "grpo"], grpo(1e-8), "--estimator grpo --std-eps 1e-8"),
        (["--estimator", "grpo"], grpo(1e-6, biased=True), "--estimator grpo --std-eps 1e-6 --std-biased"),
        (["--estimator", "grpo"], drgrpo(), "--estimator drgrpo"),
        (["--estimator", "grpo"], rloo(), "--estimator rloo"),  # leave-one-out baseline
        (["--estimator", "rloo"], grpo(1e-6), "--estimator grpo --std-eps 1e-6"),
        (["--estimator", "drgrpo"], grpo(1e-4, biased=True), "--estimator grpo --std-eps 1e-4 --std-biased"),
    ],
)
def test_each_variant_is_found(capsys, tmp_path, configured, dump, expected):
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(REWARDS, GROUPS, dump))
    code, doc = check(capsys, path, *configured)
    assert code == 0  # a mismatch is the result, not a failure, without --fail-on-mismatch
    assert doc["metrics"]["adv_check/n_sequences_mismatch"] == 5  # every sequence is off by more than atol
    assert doc["matching_variant"]["options"] == expected
    counts = {v["options"]: v["n_sequences_mismatch"] for v in doc["variants"]}
    assert counts[expected] == 0
    configured_options = {"grpo": "--estimator grpo --std-eps 1e-6"}.get(configured[1], " ".join(configured))
    assert configured_options not in counts  # the configured estimator is not tried again
    # The variants that are not the dump's formula disagree on every sequence here; with no one-sequence group,
    # RLOO keeps or zeroes nothing, so both of its variants match an RLOO dump (the first listed is reported).
    assert sorted(set(counts.values())) == [0, 5]
    assert list(counts.values()).count(0) == (2 if expected == "--estimator rloo" else 1)
    # The suggestion is right: rerunning with it passes.
    code, doc = check(capsys, path, *expected.split(), "--fail-on-mismatch")
    assert code == 0 and doc["metrics"]["adv_check/n_sequences_mismatch"] == 0
    assert "variants" not in doc and "matching_variant" not in doc  # a match needs no search


def test_per_token_group_statistics(capsys, tmp_path):
    """AReaL's GRPO recipe normalises per token: a sequence weighs as many times as it has valid tokens."""
    lengths = [3, 5, 2, 4, 1]  # valid tokens per sequence (after a 2-token prompt)
    advs = []
    for i, r in enumerate(REWARDS):
        members = [j for j in range(5) if GROUPS[j] == GROUPS[i]]
        n = sum(lengths[j] for j in members)
        mu = sum(lengths[j] * REWARDS[j] for j in members) / n
        sd = math.sqrt(sum(lengths[j] * (REWARDS[j] - mu) ** 2 for j in members) / (n - 1))
        advs.append((r - mu) / (sd + 1e-5))  # AReaL Normalization's eps
    seqs = [{"new": [-0.5] * (2 + k), "mask": [0, 0] + [1] * k, "reward": r, "group": g, "adv": a}
            for k, r, g, a in zip(lengths, REWARDS, GROUPS, advs)]
    path = tmp_path / "d.parquet"
    write_dump(path, seqs)
    code, doc = check(capsys, path, "--estimator", "grpo")
    assert code == 0 and doc["metrics"]["adv_check/n_sequences_mismatch"] == 5
    assert doc["matching_variant"] == {"options": "--estimator gae --adv-norm group", "estimator": "gae",
                                       "adv_norm": "group"}
    code, doc = check(capsys, path, "--estimator", "gae", "--adv-norm", "group", "--fail-on-mismatch")
    assert code == 0 and doc["metrics"]["adv_check/max_abs_diff"] < 1e-6


def test_settings_of_the_matching_variant(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(REWARDS, GROUPS, grpo(1e-4, biased=True)))
    _, doc = check(capsys, path, "--estimator", "grpo")
    assert doc["matching_variant"] == {
        "options": "--estimator grpo --std-eps 1e-4 --std-biased",
        "estimator": "grpo",
        "std_eps": 1e-4,
        "std_unbiased": False,
    }


def test_no_variant_matches(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(REWARDS, GROUPS, [1.0, 2.0, 3.0, 4.0, 5.0]))
    code, out, err = run(capsys, "advantages", path, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1
    assert "error:" not in err and "no common variant matches either" in err
    assert "MISMATCH: 5 of 5 sequences" in out
    _, doc = check(capsys, path, "--estimator", "grpo")
    assert doc["matching_variant"] is None
    assert all(v["n_sequences_mismatch"] == 5 for v in doc["variants"])


SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "rollouts.parquet"


@pytest.mark.skipif(not SAMPLE.exists(), reason="no sample data")
def test_sample_suggests_trls_epsilon(capsys):
    """The bundled sample normalises groups with ε = 1e-4 (TRL): verl's 1e-6 leaves 6,288 of 8,192 sequences off."""
    code, doc = check(capsys, SAMPLE, "--estimator", "grpo")
    assert code == 0
    assert doc["metrics"]["adv_check/n_sequences_mismatch"] == 6288
    assert doc["metrics"]["adv_check/n_sequences_compared"] == 8192
    assert doc["matching_variant"]["options"] == "--estimator grpo --std-eps 1e-4"
    code, out, err = run(capsys, "advantages", SAMPLE, "--estimator", "grpo", "--fail-on-mismatch")
    assert code == 1 and "error:" not in err
    assert "6,288 of 8,192 sequences differ" in err and "they match grpo with --std-eps 1e-4" in err
    assert "matches grpo with --std-eps 1e-4 (rerun with --estimator grpo --std-eps 1e-4)" in out


def test_per_token_estimators_search_no_variants(capsys, tmp_path):
    path = tmp_path / "d.parquet"
    write_dump(path, seqs_with(REWARDS, GROUPS, [1.0] * 5))
    _, doc = check(capsys, path, "--estimator", "reinforce_pp")
    assert doc["metrics"]["adv_check/n_sequences_mismatch"] > 0
    assert "variants" not in doc
