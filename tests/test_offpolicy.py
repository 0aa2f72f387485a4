"""The off-policy core (grpo_cli.core.offpolicy / staleness / sequences / m2po / histogram / keyed_state)
against hand-derived values and the independent float64 references in tests/reference.py."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from reference import (
    exact_lower_quantile,
    m2po_reference,
    offpolicy_reference,
    random_sequences,
    rejection_reference,
)

from grpo_cli.core.histogram import (
    INVALID,
    N_BINS,
    OVERFLOW,
    QUANTILE_REL_ERROR,
    UNDERFLOW,
    ZERO,
    bin_edges,
    display_histogram,
    histogram_bins,
    histogram_counts,
    histogram_quantiles,
)
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.m2po import m2po_stream_compute, m2po_stream_state, m2po_stream_update
from grpo_cli.core.offpolicy import (
    behave_compute,
    behave_state,
    behave_update,
    distributions_compute,
    distributions_state,
    distributions_update,
    importance_compute,
    importance_state,
    importance_update,
    kl_families_compute,
    kl_families_state,
    kl_families_update,
)
from grpo_cli.core.rejection import RejectionSamplingConfig, m2po_mask
from grpo_cli.core.sequences import sequence_stats_compute, sequence_stats_state, sequence_stats_update
from grpo_cli.core.staleness import MAX_LAG, staleness_compute, staleness_state, staleness_update
from grpo_cli.core.state import Reduce

# -- helpers ---------------------------------------------------------------------------------------------------------


def pack(seqs, device="cpu"):
    """Valid tokens of ``seqs`` packed as the valid view of a TokenBatch would hold them."""
    def tok(attr):
        if getattr(seqs[0], attr) is None:
            return None
        return torch.tensor([getattr(s, attr)[t] for s in seqs for t in s.valid()], dtype=torch.float32, device=device)

    lengths = [len(s.valid()) for s in seqs]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64, device=device)
    out = {name: tok(attr) for name, attr in (("new", "new"), ("old", "old"), ("prox", "prox"), ("ref", "ref"))}
    out["cu"] = cu
    out["versions"] = torch.tensor([s.versions[t] for s in seqs for t in s.valid()], device=device)
    out["adv"] = torch.tensor([s.advantage for s in seqs for _ in s.valid()], dtype=torch.float32, device=device)
    out["rewards"] = torch.tensor([s.reward for s in seqs], dtype=torch.float32, device=device)
    out["group_id"] = torch.tensor([s.group_id for s in seqs], dtype=torch.int64, device=device)
    out["current"] = torch.tensor([s.current_version for s in seqs], dtype=torch.int64, device=device)
    return out


def chunks(seqs, n_chunks, seed):
    """Split the sequence list at random boundaries (some chunks may be single sequences)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(seqs)), n_chunks - 1))
    return [seqs[a:b] for a, b in zip([0, *cuts], [*cuts, len(seqs)])]


def run_all(seqs, device="cpu", *, kl_clamp=None, threshold=2.0, rejection=None, m2_threshold=0.05):
    """Every core over ``seqs`` split in chunks → one dict of figures (states folded batch by batch)."""
    states = {
        "kl": kl_families_state(device),
        "is": importance_state(device),
        "dist": distributions_state(device),
        "behave": behave_state(device),
        "stale": staleness_state(device),
        "seq": sequence_stats_state(device),
        "m2": m2po_stream_state(device=device),
    }
    for part in seqs:
        p = pack(part, device)
        base = p["prox"] if p["prox"] is not None else p["old"]
        kl_families_update(states["kl"], new_logp=p["new"], old_logp=p["old"], ref_logp=p["ref"], clamp=kl_clamp)
        importance_update(states["is"], new_logp=p["new"], cu_seqlens=p["cu"], old_logp=p["old"], threshold=threshold)
        distributions_update(states["dist"], new_logp=p["new"], old_logp=p["old"], ratio_base_logp=base)
        if p["prox"] is not None:
            behave_update(states["behave"], prox_logp=p["prox"], old_logp=p["old"], cu_seqlens=p["cu"],
                          rejection=rejection)
            m2po_stream_update(states["m2"], old_logp=p["old"], prox_logp=p["prox"])
        staleness_update(states["stale"], new_logp=p["new"], versions=p["versions"], current_version=p["current"],
                         cu_seqlens=p["cu"], old_logp=p["old"], ratio_base_logp=base, advantages=p["adv"],
                         kl_clamp=kl_clamp)
        sequence_stats_update(states["seq"], cu_seqlens=p["cu"], advantages=p["adv"], rewards=p["rewards"],
                              group_id=p["group_id"])
    out = {}
    out.update(kl_families_compute(states["kl"]))
    out.update(importance_compute(states["is"]))
    out.update(distributions_compute(states["dist"]))
    out.update(behave_compute(states["behave"]))
    out.update(staleness_compute(states["stale"]))
    out.update(sequence_stats_compute(states["seq"]))
    if seqs[0][0].prox is not None:
        out.update(m2po_stream_compute(states["m2"], m2_threshold))
    return out


def assert_matches(got, ref, keys, rel=1e-5, abs_=1e-9):
    for key in keys:
        assert key in got, key
        if isinstance(ref[key], list):
            assert len(got[key]) == len(ref[key]), key
            for g, r in zip(got[key], ref[key]):
                assert g.keys() == r.keys(), key
                for field, value in r.items():
                    assert g[field] == pytest.approx(value, rel=rel, abs=abs_), (key, field)
        else:
            assert got[key] == pytest.approx(ref[key], rel=rel, abs=abs_), key


SCALAR_KEYS = [
    "kl/k1", "kl/k2", "kl/k3", "kl/abs_diff_mean", "kl/abs_diff_max", "kl_ref/k1", "kl_ref/k2", "kl_ref/k3",
    "is/mean", "is/min", "is/max", "is/std", "is/ess", "is/frac_high", "is/frac_low", "is/chi2_token", "is/chi2_seq",
    "ppl/new", "ppl/old", "ppl/log_diff_mean", "ppl/log_diff_abs_mean", "ppl/ratio", "prob/pearson",
    "spikes/n_ratio_gt_1e3", "ratio/mean", "ratio/min", "ratio/std", "abs_diff/mean", "abs_diff/min", "abs_diff/max",
    "abs_diff/std", "staleness/n_tokens", "staleness/theta_mean", "staleness/theta_min", "staleness/theta_max",
    "staleness/proximal_mean", "staleness/proximal_min", "staleness/proximal_max", "staleness/hist", "by_staleness",
    "sanity/n_on_policy_tokens", "sanity/on_policy_ratio_dev", "seq/len_mean", "seq/len_min", "seq/len_max",
    "adv/mean", "adv/std", "adv/pos_frac", "adv/neg_frac", "adv/zero_frac", "reward/mean", "reward/std", "groups/n",
    "groups/zero_std_frac",
]  # fmt: skip
BEHAVE_KEYS = ["behave/imp_weight_mean", "behave/imp_weight_min", "behave/imp_weight_max", "behave/approx_kl"]


# -- every figure against the float64 reference ---------------------------------------------------------------------


@pytest.mark.parametrize("with_prox", [False, True])
def test_all_figures_match_the_reference(device, with_prox):
    seqs = random_sequences(50, seed=11, with_prox=with_prox, spread=0.6)
    got = run_all(chunks(seqs, 5, seed=1), device)
    ref = offpolicy_reference(seqs)
    assert_matches(got, ref, SCALAR_KEYS + (BEHAVE_KEYS if with_prox else []))


def test_kl_clamp_and_is_threshold(device):
    seqs = random_sequences(40, seed=3, spread=0.8)
    got = run_all([seqs], device, kl_clamp=0.05, threshold=1.25)
    ref = offpolicy_reference(seqs, kl_clamp=0.05, ref_kl_clamp=0.05, is_threshold=1.25)
    assert_matches(got, ref, ["kl/k1", "kl/k2", "kl/k3", "kl_ref/k1", "kl_ref/k2", "kl_ref/k3", "is/std", "is/ess",
                              "is/frac_high", "is/frac_low", "by_staleness"])
    unclamped = offpolicy_reference(seqs)
    assert got["kl/k3"] < unclamped["kl/k3"]  # the clamp bites on this data
    assert got["kl/abs_diff_max"] == pytest.approx(unclamped["kl/abs_diff_max"])  # |x| is never clamped


def test_hand_derived_importance_figures():
    # One sequence, x = new − old = [ln 2, 0, ln ½] → w = [2, 1, ½]:
    #   is/mean = 3.5/3; chi2_token = (4 + 1 + ¼)/3 − 1 = 0.75; Σ log w = 0 → chi2_seq = e^0 − 1 = 0.
    #   C = 1.5: frac_high = [2 > 1.5] = 1/3, frac_low = [½ < 2/3] = 1/3; w̃ = [1.5, 1, 2/3] →
    #   mean w̃ = 19/18, mean w̃² = (2.25 + 1 + 4/9)/3 = 133/108, ESS = (19/18)² / (133/108) = 361/399.
    #   ppl/new with new = [0, ln ½, ln ¼]: mean = −ln 2 → ppl = 2.
    new = torch.tensor([0.0, math.log(0.5), math.log(0.25)], dtype=torch.float64)
    old = new - torch.tensor([math.log(2), 0.0, math.log(0.5)], dtype=torch.float64)
    state = importance_state()
    importance_update(state, new_logp=new, old_logp=old, cu_seqlens=torch.tensor([0, 3]), threshold=1.5)
    got = importance_compute(state)
    assert got["is/mean"] == pytest.approx(3.5 / 3, rel=1e-12)
    assert got["is/chi2_token"] == pytest.approx(0.75, rel=1e-12)
    assert got["is/chi2_seq"] == pytest.approx(0.0, abs=1e-12)
    assert got["is/frac_high"] == got["is/frac_low"] == pytest.approx(1 / 3)
    assert got["is/ess"] == pytest.approx(361 / 399, rel=1e-12)
    assert got["ppl/new"] == pytest.approx(2.0, rel=1e-12)
    assert got["is/max"] == pytest.approx(2.0) and got["is/min"] == pytest.approx(0.5)


def test_hand_derived_staleness():
    # Current version 5 for both sequences; versions [−1, 5, 3] and [4, 4]: lags 0, 2, 1, 1 (the prompt is skipped).
    versions = torch.tensor([-1, 5, 3, 4, 4])
    new = torch.zeros(5, dtype=torch.float64)
    state = staleness_state()
    staleness_update(state, new_logp=new, versions=versions, current_version=5, cu_seqlens=torch.tensor([0, 3, 5]),
                     old_logp=new - torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0], dtype=torch.float64))
    got = staleness_compute(state)
    assert got["staleness/theta_mean"] == 1.0 and got["staleness/theta_max"] == 2 and got["staleness/theta_min"] == 0
    assert got["staleness/proximal_min"] == -1
    assert got["staleness/hist"] == [{"lag": 0, "n_tokens": 1}, {"lag": 1, "n_tokens": 2}, {"lag": 2, "n_tokens": 1}]
    assert got["sanity/n_on_policy_tokens"] == 1
    assert got["sanity/on_policy_ratio_dev"] == pytest.approx(math.expm1(0.1), rel=1e-12)  # lag 0 has x = 0.1


def test_staleness_overflow_and_negative_lag_bins():
    versions = torch.tensor([0, 100, 3])  # current 70: lags 70 (overflow), −30 (negative), 67 (overflow)
    state = staleness_state()
    staleness_update(state, new_logp=torch.zeros(3), versions=versions, current_version=70,
                     cu_seqlens=torch.tensor([0, 3]))
    got = staleness_compute(state)
    assert got["staleness/hist"] == [
        {"lag": MAX_LAG, "overflow": True, "lag_max": 70, "n_tokens": 2}, {"lag": -1, "underflow": True, "n_tokens": 1},
    ]
    assert got["staleness/theta_min"] == -30 and got["staleness/theta_max"] == 70  # exact, not binned
    assert "sanity/n_on_policy_tokens" not in got  # no old_logp


@pytest.mark.parametrize(
    "rs",
    [
        dict(level="token", action="mask", metric="ratio", upper=1.3),
        dict(level="token", action="mask", metric="ratio", upper=1.3, lower=0.8),
        dict(level="token", action="clamp", metric="ratio", upper=1.2, lower=0.9),
        dict(level="token", action="mask", metric="kl_k3", upper=0.02),
        dict(level="sequence", action="mask", metric="ratio", agg="mean", upper=1.05),
        dict(level="sequence", action="mask", metric="ratio", agg="max", upper=1.4),
        dict(level="sequence", action="clamp", metric="ratio", agg="sum", upper=1.1),
        dict(level="sequence", action="mask", metric="kl_k2", agg="sum", upper=0.1),
    ],
)
def test_rejection_sampling_behave_figures(device, rs):
    seqs = random_sequences(40, seed=8, with_prox=True, spread=0.3)
    got = run_all(chunks(seqs, 4, seed=2), device, rejection=RejectionSamplingConfig(**rs))
    ref = rejection_reference(seqs, **rs)
    assert 0 < ref["rs/filtered_fraction"] < 1  # the bounds bite on this data
    assert got["rs/filtered_fraction"] == pytest.approx(ref["rs/filtered_fraction"], abs=1e-12)
    assert_matches(got, ref, BEHAVE_KEYS)


def test_figures_do_not_depend_on_batching(device):
    seqs = random_sequences(60, seed=5, with_prox=True, spread=0.5)
    runs = [run_all(chunks(seqs, k, seed=k), device) for k in (1, 7, 60)]
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for key, value in runs[0].items():
            if isinstance(value, float):
                assert other[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
            else:
                assert other[key] == value, key


def test_states_merge_like_one_pass():
    seqs = random_sequences(30, seed=9, with_prox=True)
    whole, a, b = (importance_state() for _ in range(3))
    for state, part in ((whole, seqs), (a, seqs[:11]), (b, seqs[11:])):
        p = pack(part)
        importance_update(state, new_logp=p["new"], cu_seqlens=p["cu"], old_logp=p["old"])
    merged = b.merge(a)
    assert importance_compute(merged) == pytest.approx(importance_compute(whole), rel=1e-12)


def test_no_old_logp_leaves_only_what_exists():
    seqs = random_sequences(10, seed=1)
    p = pack(seqs)
    state = importance_state()
    importance_update(state, new_logp=p["new"], cu_seqlens=p["cu"])
    assert set(importance_compute(state)) == {"ppl/new"}
    state = kl_families_state()
    kl_families_update(state, new_logp=p["new"], ref_logp=p["ref"])
    assert set(kl_families_compute(state)) == {"kl_ref/k1", "kl_ref/k2", "kl_ref/k3"}


def test_kl_families_old_kinds_folds_only_those():
    # analyze's KLFamiliesGroup leaves k3 out (PolicyGroup reports kl/k3); the others are unchanged by that.
    p = pack(random_sequences(10, seed=2))
    full, partial = kl_families_state(), kl_families_state(old_kinds=("k1", "k2"))
    for state in (full, partial):
        kl_families_update(state, new_logp=p["new"], old_logp=p["old"], ref_logp=p["ref"])
    everything, some = kl_families_compute(full), kl_families_compute(partial)
    assert "kl/k3" in everything and "kl/k3" not in some and "old_k3" not in partial
    assert some == {key: value for key, value in everything.items() if key != "kl/k3"}
    with pytest.raises(ValueError, match="old_kinds"):
        kl_families_state(old_kinds=("k4",))


def test_masked_garbage_never_reaches_a_figure():
    # The cores see valid tokens only; empty sequences (all masked) must not produce NaN in per-sequence figures.
    new = torch.tensor([-1.0, -2.0])
    state = importance_state()
    importance_update(state, new_logp=new, old_logp=new - 0.1, cu_seqlens=torch.tensor([0, 0, 2, 2]))
    got = importance_compute(state)
    assert all(math.isfinite(v) for v in got.values())
    assert got["is/chi2_seq"] == pytest.approx(math.expm1(2 * 0.2), rel=1e-6)


# -- histograms -----------------------------------------------------------------------------------------------------


def test_histogram_bins_by_hand():
    # 1.0 = 2^0·(1 + 0/128): the first sub-bin of binade 0, [1, 1 + 1/128); 1.5 = 2^0·(1 + 64/128).
    one, one_half = histogram_bins(torch.tensor([1.0, 1.5])).tolist()
    assert bin_edges(one) == (1.0, 1.0078125) and bin_edges(one_half) == (1.5, 1.5078125)
    assert one_half - one == 64
    specials = torch.tensor([0.0, -0.0, 1e-30, 2.0**-64, 2.0**64, float("inf"), float("nan"), -1.0])
    b = histogram_bins(specials).tolist()
    assert b[:3] == [ZERO, ZERO, UNDERFLOW]
    assert bin_edges(b[3])[0] == 2.0**-64  # the first main bin
    assert b[4:] == [OVERFLOW, OVERFLOW, INVALID, INVALID]
    assert histogram_counts(specials).sum() == 8 and histogram_counts(specials).shape == (N_BINS,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantiles_within_the_stated_bound(device, dtype):
    rng = np.random.default_rng(0)
    values = np.concatenate([
        np.exp(rng.normal(0, 0.3, 5000)),      # ratio-like
        np.exp(rng.normal(0, 8, 2000)),        # wide spread
        np.abs(rng.normal(0, 1e-4, 1000)),     # tiny differences
        np.zeros(50),
    ])  # fmt: skip
    t = torch.tensor(values, dtype=dtype, device=device)
    counts = histogram_counts(t)
    as_stored = t.cpu().tolist()  # the values as the core saw them (float32-rounded for float32 input)
    qs = [0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0]
    got = histogram_quantiles(counts, qs, vmin=min(as_stored), vmax=max(as_stored))
    for q, estimate in zip(qs, got):
        exact = exact_lower_quantile(as_stored, q)
        assert abs(estimate - exact) <= QUANTILE_REL_ERROR * abs(exact), (q, estimate, exact)
    # A coarser bound would fail: the estimates are not all exact.
    assert any(estimate != exact_lower_quantile(as_stored, q) for q, estimate in zip(qs, got))


def test_histogram_counts_merge_by_sum():
    t = torch.exp(torch.randn(1000, dtype=torch.float64))
    parts = sum(histogram_counts(p) for p in t.split(37))
    assert torch.equal(parts, histogram_counts(t))


def test_display_histogram_counts_every_value():
    t = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 4.0, 100.0])
    view = display_histogram(histogram_counts(t), lo=0.5, hi=4.0, n_bins=3)
    assert view["counts"] == [1, 2, 2] and view["zero"] == 1 and view["below"] == 1 and view["above"] == 1
    assert view["edges"][0] == 0.5 and view["edges"][-1] == 4.0


def test_distribution_quantiles_against_reference():
    seqs = random_sequences(80, seed=12, with_prox=True, spread=0.4)
    got = run_all([seqs])
    ref = offpolicy_reference(seqs)
    for name in ("ratio", "abs_diff"):
        values = ref[f"_{name}"]
        for suffix, q in (("p001", 0.001), ("p01", 0.01), ("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
            exact = exact_lower_quantile(values, q)
            # the bound plus float32 elementwise math (exp/subtraction rounding) in the core
            assert abs(got[f"{name}/{suffix}"] - exact) <= (QUANTILE_REL_ERROR + 1e-6) * exact, (name, suffix)
        assert sum(got[f"{name}/hist"]["counts"]) + got[f"{name}/hist"]["below"] + got[f"{name}/hist"]["above"] == len(
            values
        )


# -- M2PO, streamed -------------------------------------------------------------------------------------------------


def _m2_inputs(n, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g) * 3
    prox = old + torch.randn(n, generator=g) * scale * (1 + 5 * (torch.rand(n, generator=g) > 0.97))
    return old, prox


@pytest.mark.parametrize("threshold", [0.0, 0.01, 0.03, 0.05, 0.2, 10.0])
def test_m2po_stream_is_exact(device, threshold):
    old, prox = _m2_inputs(3000, seed=1)
    m2 = ((old.double() - prox.double()) ** 2).tolist()
    expected = m2po_reference(m2, threshold)
    whole = m2po_mask(old, prox, torch.ones(3000, dtype=torch.bool), threshold)
    assert int((~whole).sum()) == expected  # the loss-core rule, applied to the whole dump at once
    for n_parts in (1, 9):
        state = m2po_stream_state(device=device)
        for o, p in zip(old.to(device).tensor_split(n_parts), prox.to(device).tensor_split(n_parts)):
            m2po_stream_update(state, old_logp=o, prox_logp=p)
        got = m2po_stream_compute(state, threshold)
        assert got["m2po/exact"] is True
        assert got["m2po/masked_fraction"] == expected / 3000
        assert got["m2po/m2_mean"] == pytest.approx(sum(m2) / 3000, rel=1e-12)


def test_m2po_beyond_the_exact_table_is_an_estimate():
    old, prox = _m2_inputs(20000, seed=2, scale=0.3)
    m2 = ((old.double() - prox.double()) ** 2).tolist()
    threshold = 0.05  # masks a few hundred tokens: more than the 16 kept exactly below
    expected = m2po_reference(m2, threshold)
    assert expected > 100
    state = m2po_stream_state(top_k=16)
    for o, p in zip(old.split(999), prox.split(999)):
        m2po_stream_update(state, old_logp=o, prox_logp=p)
    got = m2po_stream_compute(state, threshold)
    assert got["m2po/exact"] is False
    assert got["m2po/masked_fraction"] * 20000 == pytest.approx(expected, rel=0.02)


def test_m2po_nonfinite_values_are_masked_first():
    old = torch.tensor([0.0, float("nan"), 0.0, float("-inf")])
    prox = torch.tensor([0.1, 0.0, 0.0, 0.0])
    state = m2po_stream_state()
    m2po_stream_update(state, old_logp=old, prox_logp=prox)
    expected = int((~m2po_mask(old, prox, torch.ones(4, dtype=torch.bool), 1.0)).sum())
    assert expected == 2
    assert m2po_stream_compute(state, 1.0)["m2po/masked_fraction"] == 2 / 4


# -- keyed state ----------------------------------------------------------------------------------------------------


def test_keyed_state_merges_in_any_order():
    rng = random.Random(4)
    rows = [[float(rng.randrange(20)), 1.0, r, r] for r in (rng.choice([0.0, 0.5, 1.0]) for _ in range(200))]
    expected: dict[float, list] = {}
    for key, _, r, _ in rows:
        e = expected.setdefault(key, [0, math.inf, -math.inf])
        e[0], e[1], e[2] = e[0] + 1, min(e[1], r), max(e[2], r)
    ops = (Reduce.SUM, Reduce.MIN, Reduce.MAX)
    parts = [rows[i : i + 23] for i in range(0, 200, 23)]
    states = []
    for part in parts:
        s = KeyedState({}, {"g": ops})
        s.update(g=torch.tensor(part, dtype=torch.float64))
        states.append(s)
    forward, backward = states[0].clone(), states[-1].clone()
    for s in states[1:]:
        forward.merge_(s)
    for s in reversed(states[:-1]):
        backward.merge_(s)
    assert isinstance(forward, KeyedState) and isinstance(forward.to("cpu"), KeyedState)
    assert torch.equal(forward["g"], backward["g"])
    assert forward["g"].tolist() == [[k, *v] for k, v in sorted(expected.items())]


def test_group_figures_by_hand():
    # Groups 7: rewards {1, 1} (zero std), 3: {0, 1}, 9: {0.5} (a singleton: zero std) → 3 groups, 2/3 zero std.
    state = sequence_stats_state()
    sequence_stats_update(state, cu_seqlens=torch.tensor([0, 2, 2, 5]), rewards=torch.tensor([1.0, 0.0, 0.5]),
                          group_id=torch.tensor([7, 3, 9]))
    sequence_stats_update(state, cu_seqlens=torch.tensor([0, 1, 2]), rewards=torch.tensor([1.0, 1.0]),
                          group_id=torch.tensor([3, 7]))
    got = sequence_stats_compute(state)
    assert got["groups/n"] == 3 and got["groups/zero_std_frac"] == pytest.approx(2 / 3)
    assert got["seq/len_min"] == 0 and got["seq/len_max"] == 3 and got["seq/len_mean"] == pytest.approx(7 / 5)
    assert got["reward/mean"] == pytest.approx(3.5 / 5)
