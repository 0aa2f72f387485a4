"""Hand-derived values for grpo_cli.core.peer_figures (the figures as verl, TRL and AReaL log them).

The peers tier (tests/peers) runs the peers' own code against the same functions; these tests pin the formulas
independently, including the figures whose peer code cannot run outside a trainer (TRL's vLLM sampling figures).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.core.peer_figures import (
    areal_kl_div_stats,
    areal_token_stats,
    areal_version_stats,
    trl_cispo_clip_ratio,
    trl_clip_ratio_metrics,
    trl_logged_kl,
    trl_sampling_metrics,
    verl_data_metrics,
    verl_kl_penalty,
    verl_offpolicy_metrics,
    verl_policy_loss,
    verl_rollout_is,
    verl_rollout_rs,
)

F64 = torch.float64
LN = math.log


def t(x: list, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


# --- verl -----------------------------------------------------------------------------------------------------


def test_verl_vanilla_dual_clip_and_metrics() -> None:
    # r = [2, 0.5, 5], A = [1, -1, -1], ε = 0.2, c = 3.
    # token 0: max(-2, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped), dual min(3, 0.8) = 0.8;
    # token 2: max(5, 1.2) = 5 (L2 < L1: not a PPO clip) → dual min(3, 5) = 3 (dual hit).
    # ppo_kl = mean(-log r) = -(ln2 - ln2 + ln5)/3.
    lp = torch.log(t([[2.0, 0.5, 5.0]])).requires_grad_(True)
    loss, m = verl_policy_loss("vanilla", torch.zeros(1, 3, dtype=F64), lp, t([[1.0, -1.0, -1.0]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 3, rel=1e-12)
    assert m == pytest.approx({"pg_clipfrac": 2 / 3, "ppo_kl": -LN(5.0) / 3, "pg_clipfrac_lower": 1 / 3}, rel=1e-12)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0, 0.0]]  # every token is clipped or dual-clipped


def test_verl_cispo_and_sum_norm() -> None:
    # CISPO: -sg(clip(r, 0.8, 1.2))·A·ℓ; r = [2, 1]; rows [[t0, t1], [·, ·]] with row 1 empty.
    lp = torch.log(t([[2.0, 1.0], [1.0, 1.0]])).requires_grad_(True)
    mask = torch.tensor([[True, True], [False, False]])
    adv = t([[1.0, 2.0], [5.0, 5.0]])
    loss, m = verl_policy_loss("cispo", torch.zeros(2, 2, dtype=F64), lp, adv, mask, "seq-mean-token-sum-norm")
    # S_0 = -1.2·1·ln2 - 1·2·0; B = 1, T = 2 → -0.6·ln 2
    assert loss.item() == pytest.approx(-0.6 * LN(2.0), rel=1e-12)
    assert m["pg_clipfrac"] == 0.5 and m["pg_clipfrac_lower"] == 0.0
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.6, -1.0], rel=1e-12)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        verl_policy_loss("vanilla", lp, lp, adv, mask, clip_ratio_c=1.0)


def test_verl_kl_penalty_names() -> None:
    lp, ref = t([0.0]), t([-1.0])
    assert verl_kl_penalty(lp, ref, "kl").item() == 1.0
    assert verl_kl_penalty(lp, ref, "mse").item() == 0.5
    assert verl_kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(math.exp(-1.0), rel=1e-12)
    with pytest.raises(ValueError):
        verl_kl_penalty(lp, ref, "full")


def test_verl_rollout_is_token_and_sequence() -> None:
    # w = [4, 0.25, 1], C = 2 (lo = 0.5): truncated [2, 0.25, 1].
    old = torch.log(t([[4.0, 0.25, 1.0]]))
    roll, mask = torch.zeros(1, 3, dtype=F64), torch.ones(1, 3)
    w, m = verl_rollout_is(old, roll, mask)
    assert w.tolist() == [[2.0, 0.25, 1.0]]
    mean = 3.25 / 3
    assert m["rollout_is_mean"] == pytest.approx(mean, rel=1e-12)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (2.0, 0.25)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3) and m["rollout_is_ratio_fraction_low"] == (
        pytest.approx(1 / 3)
    )
    sq = (4 + 0.0625 + 1) / 3
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(sq - mean**2), rel=1e-12)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / (sq / (mean + 1e-8) ** 2), rel=1e-9)
    assert m["rollout_is_seq_mean"] == pytest.approx(mean, rel=1e-12) and m["rollout_is_seq_std"] == 0.0
    assert m["rollout_is_seq_fraction_high"] == 0.0  # raw row mean 1.75 < 2
    # raw statistics (truncate=False): mean 1.75, max 4; std/ESS over clamp(w, 0.5, 2) = [2, 0.5, 1]
    _, raw = verl_rollout_is(old, roll, mask, truncate=False)
    assert (raw["rollout_is_mean"], raw["rollout_is_max"], raw["rollout_is_min"]) == (1.75, 4.0, 0.25)
    assert raw["rollout_is_eff_sample_size"] == pytest.approx((3.5 / 3) ** 2 / (5.25 / 3), rel=1e-7)
    # sequence level: row log-sum ln 1 = 0 → every weight 1; an empty row counts in the row statistics
    w, m = verl_rollout_is(
        old.expand(2, 3), torch.zeros(2, 3, dtype=F64), torch.tensor([[1, 1, 1], [0, 0, 0]]), level="sequence"
    )
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert m["rollout_is_seq_mean"] == 0.5 and m["rollout_is_seq_min"] == 0.0  # the empty row's mean is 0
    # IcePop: [lo, C] = [0.5, 2] zeroes 4 and 0.25
    w, m = verl_rollout_is(old, roll, mask, threshold_lower=0.5)
    assert w.tolist() == [[0.0, 0.0, 1.0]] and m["rollout_is_oob_ratio"] == pytest.approx(2 / 3)


def test_verl_offpolicy_metrics_hand() -> None:
    old = t([[-1.0, -3.0], [-2.0, 0.0]])
    roll = t([[-1.0, -2.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = verl_offpolicy_metrics(old, roll, mask)
    # per-row means: old [-2, -2], roll [-1.5, -1]; ℓ = old - roll = [0, -1, -1]
    assert m["training_log_ppl"] == 2.0 and m["training_ppl"] == pytest.approx(math.exp(2.0))
    assert m["rollout_log_ppl"] == 1.25 and m["log_ppl_diff"] == 0.75
    assert (m["log_ppl_diff_max"], m["log_ppl_diff_min"]) == (1.0, 0.5)
    assert m["kl"] == pytest.approx(2 / 3) and m["k3_kl"] == pytest.approx(2 * math.exp(-1.0) / 3, rel=1e-12)
    assert m["chi2_token"] == pytest.approx((1 + 2 * math.exp(-2.0)) / 3 - 1, rel=1e-12)
    assert m["chi2_seq"] == pytest.approx(math.exp(-2.0) - 1, rel=1e-12)  # both rows Σℓ = -1
    assert m["ppl_ratio"] == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2, rel=1e-12)
    with pytest.raises(ValueError):
        verl_offpolicy_metrics(old, roll, torch.zeros(2, 2))


def test_verl_data_metrics_aborted_and_observation_tokens() -> None:
    # Row 0 has an observation span inside the response (attention 1, loss mask 0): it counts in the length.
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    m = verl_data_metrics(t([1.0, 0.0, 9.0]), attention)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/max"] == 1.0  # the aborted row's 9 is left out
    assert m["response_length/mean"] == 2.0 and m["response_length/min"] == 0.0
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["response_length_non_aborted/mean"] == 3.0 and m["response/aborted_ratio"] == pytest.approx(1 / 3)
    all_aborted = verl_data_metrics(t([1.0]), torch.zeros(1, 2))
    assert math.isnan(all_aborted["critic/score/mean"])


# --- TRL ------------------------------------------------------------------------------------------------------


def test_trl_logged_kl_with_and_without_correction() -> None:
    lp, ref = t([[-1.0, -1.0]]), t([[-2.0, -1.0]])
    old = lp - torch.log(t([[2.0, 1.0]]))
    k3 = math.exp(-1.0)
    assert trl_logged_kl(lp, old, ref, torch.ones(1, 2)) == pytest.approx(2 * k3 / 2, rel=1e-12)
    assert trl_logged_kl(lp, old, ref, torch.ones(1, 2), use_bias_correction_kl=False) == pytest.approx(k3 / 2)
    # sequence level: ratio exp(mean(ln2, 0)) = sqrt 2 on both tokens
    seq = trl_logged_kl(lp, old, ref, torch.ones(1, 2), importance_sampling_level="sequence")
    assert seq == pytest.approx(math.sqrt(2.0) * k3 / 2, rel=1e-12)


def test_trl_clip_ratio_metrics_hand() -> None:
    # r = [[1.5, 0.5], [1.0, 0.7]], A = [[1, -1], [1, 1]]; row 2 empty. low: token (0,1); high: token (0,0).
    lp = torch.log(t([[1.5, 0.5], [1.0, 0.7], [3.0, 3.0]]))
    adv = t([[1.0, -1.0], [1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    m = trl_clip_ratio_metrics(lp, torch.zeros(3, 2, dtype=F64), adv, mask, epsilon_low=0.2, epsilon_high=0.28)
    assert m == {"low_mean": 0.25, "high_mean": 0.25, "region_mean": 0.5, "low_min": 0.0, "high_max": 0.5}
    assert trl_cispo_clip_ratio(lp, torch.zeros(3, 2, dtype=F64), adv, mask, epsilon_high=1.2) == 0.25


def test_trl_sampling_metrics_hand() -> None:
    # Δ = old - sampling = [[0.5, -1], [ln 4, NaN]]; row 1's second token NaN (vLLM could not score it).
    old = t([[-1.0, -2.0], [0.0, -1.0]])
    samp = t([[-1.5, -1.0], [-LN(4.0), float("nan")]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    ratio, f = trl_sampling_metrics(old, samp, mask, mode="token_truncate", clip_max=3.0)
    assert ratio.flatten().tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 3.0, 1.0], rel=1e-12)
    assert f["sampling_logp_difference/mean"] == pytest.approx((0.5 + 1 + LN(4.0)) / 3, rel=1e-12)
    assert f["sampling_logp_difference/max"] == pytest.approx(LN(4.0), rel=1e-12)
    assert f["importance_sampling_ratio/max"] == 3.0 and f["importance_sampling_ratio/min"] == pytest.approx(
        math.exp(-1.0)
    )
    ratio, f = trl_sampling_metrics(old, samp, mask, mode="sequence_mask", clip_min=0.5, clip_max=2.0)
    # row sums: -0.5 → e^-0.5 = 0.607 kept; ln 4 → 4 masked to 0
    assert ratio.flatten().tolist() == pytest.approx([math.exp(-0.5), 0.0], rel=1e-12)
    assert f["importance_sampling_ratio/mean"] == pytest.approx(math.exp(-0.5) / 2, rel=1e-12)


# --- AReaL ----------------------------------------------------------------------------------------------------


def test_areal_stats_hand() -> None:
    assert areal_token_stats(t([1.0, -2.0, 7.0]), torch.tensor([1, 1, 0])) == {"avg": -0.5, "min": -2.0, "max": 1.0}
    assert areal_token_stats(t([1.0]), torch.tensor([0])) == {}
    s = areal_kl_div_stats(t([0.0, -1.0]), t([-1.0, -1.0]), torch.tensor([1, 1]))
    # log ρ = [1, 0]: direct [-1, 0], taylor [0.5, 0], dual [e - 2, 0]
    assert s["kl_div_direct/min"] == -1.0 and s["kl_div_taylor/avg"] == 0.25
    assert s["kl_div_dual/max"] == pytest.approx(math.e - 2, rel=1e-7)
    v = areal_version_stats(torch.tensor([3, 5, -1, 0]), 6, torch.tensor([1, 1, 1, 0]))
    # generated, unmasked tokens: versions 3, 5 → theta lags 3, 1; proximal 2, 0
    assert v["sample_staleness_theta_avg"] == 2.0 and v["sample_staleness_proximal_min"] == 0.0
    assert v["n_valid_generated_tokens"] == 2.0 and v["v_proximal"] == 5.0
    assert areal_version_stats(torch.tensor([-1]), 6, torch.tensor([1])) == {}


def test_verl_rollout_rs_hand() -> None:
    # ℓ = old - roll = [ln 4, 0 | 0, ·]; k1 = -ℓ = [-ln 4, 0 | 0]; k3 = e^ℓ - 1 - ℓ = [3 - ln 4, 0 | 0].
    old = torch.log(t([[4.0, 1.0], [1.0, 1.0]]))
    roll = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    kept, m = verl_rollout_rs(old, roll, mask, "seq_sum_k3", 1.0)
    # row sums of k3: [3 - ln 4 = 1.614 > 1 → rejected, 0]
    assert kept.tolist() == [[False, False], [True, False]]
    k3 = 3 - LN(4.0)
    assert m["rollout_rs_seq_sum_k3_mean"] == pytest.approx(2 * k3 / 3, rel=1e-12)  # token-weighted
    assert m["rollout_rs_seq_sum_k3_max"] == pytest.approx(k3) and m["rollout_rs_seq_sum_k3_min"] == 0.0
    assert m["rollout_rs_seq_sum_k3_fraction_high"] == 0.5 and m["rollout_rs_seq_sum_k3_fraction_low"] == 0.0
    assert m["rollout_rs_seq_sum_k3_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_rs_seq_sum_k3_seq_masked_fraction"] == 0.5
    assert "rollout_rs_seq_sum_k3_seq_fraction_low" not in m
    # std over the statistic clamped to [0, 1]: tokens [1, 1, 0] → sqrt(2/3 - 4/9)
    assert m["rollout_rs_seq_sum_k3_std"] == pytest.approx(math.sqrt(2 / 3 - 4 / 9), rel=1e-12)
    # token_k1 with a single bound u = 2 means [1/2, 2]: -ln 4 < ln 0.5 → rejected
    kept, m = verl_rollout_rs(old, roll, mask, "token_k1", 2.0)
    assert kept.tolist() == [[False, True], [True, False]]
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 3)
    assert m["rollout_rs_seq_masked_fraction"] == 0.5
    with pytest.raises(ValueError, match="Invalid rollout_rs option"):
        verl_rollout_rs(old, roll, mask, "seq_max_k1", 2.0)


def test_verl_gspo_caps_the_sequence_log_ratio_at_10_by_hand():
    # One sequence, log-ratios 30 and 30 (no ±20 bound in verl's GSPO): σ = 30, capped at 10, s = e^10 on both
    # tokens. A = −1: L1 = e^10, L2 = −(−1)·clip(s) = 1.2 → max = e^10 per token; token-mean e^10. ppo_kl = −30.
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 2), -30.0, dtype=torch.float64)
    adv = torch.full((1, 2), -1.0, dtype=torch.float64)
    loss, metrics = verl_policy_loss("gspo", old, lp, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12)
    assert metrics == {"pg_clipfrac": 0.0, "ppo_kl": pytest.approx(-30.0), "pg_clipfrac_lower": 0.0}
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]  # above the cap the clamp passes no gradient
    # Below the cap: σ = 2, s = e^2, the straight-through gradient of ℓ − sg(ℓ): ∂/∂ℓ_t (−A·s)/2 = e^2/2 per token.
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    loss, metrics = verl_policy_loss("gspo", torch.full((1, 2), -2.0, dtype=torch.float64), lp, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(math.exp(2.0), rel=1e-12) and metrics["pg_clipfrac"] == 0.0
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([math.exp(2.0) / 2] * 2, rel=1e-12)
