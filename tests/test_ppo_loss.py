"""Tests for AReaL's actor losses: ppo_actor_loss, rejection sampling, M2PO, SAPO and CISPO.

Expected numbers are derived by hand in the comments (AReaL
``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn``, ``apply_rejection_sampling``, ``sapo_loss_fn``,
``cispo_loss_fn``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_cli.core import (
    RejectionSamplingConfig,
    apply_rejection_sampling,
    cispo_loss,
    cispo_loss_terms,
    m2po_mask,
    padded_to_packed,
    ppo_actor_loss,
    ppo_actor_loss_terms,
    sapo_loss,
    sapo_loss_terms,
)

LN = math.log
F64 = torch.float64


def t64(x, device="cpu", grad=False):
    return torch.tensor(x, dtype=F64, device=device, requires_grad=grad)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# --- ppo_actor_loss: token level -------------------------------------------------------------------------


def test_ppo_token_level_asymmetric_clip(device):
    lp = t64([[LN(1.5), LN(1.1), LN(0.7)], [LN(1.3), LN(0.5), LN(9.0)]], device, grad=True)
    zero = torch.zeros(2, 3, dtype=F64, device=device)
    adv = t64([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], device)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool, device=device)
    loss, st = ppo_actor_loss(lp, zero, zero, adv, 0.2, mask, eps_clip_higher=0.28)
    # L = max(-A r, -A clip(r, 0.8, 1.28)):
    #   r=1.5,A=1: max(-1.5,-1.28) = -1.28 (clip)   r=1.1: -1.1   r=0.7: max(-0.7,-0.8) = -0.7
    #   r=1.3,A=-1: max(1.3,1.28) = 1.3             r=0.5: max(0.5,0.8) = 0.8 (clip)   masked
    # Σ = -0.98, N0 = 5 → -0.196
    assert loss.item() == pytest.approx(-0.196, rel=1e-12)
    assert loss.dtype == F64 and loss.device.type == torch.device(device).type
    assert st["clip_mask"].tolist() == [[True, False, False], [False, True, False]]
    assert st["dual_clip_mask"].tolist() == [[False] * 3] * 2
    assert st["importance_weight"].cpu().reshape(-1).tolist() == pytest.approx([1.5, 1.1, 0.7, 1.3, 0.5, 0.0])
    assert st["approx_kl"][1, 2].item() == pytest.approx(LN(9.0))  # not masked, as AReaL
    assert (st["n_total_tokens"], st["n_valid_tokens"], st["n_masked_tokens"]) == (6.0, 5.0, 1.0)
    assert st["masked_token_ratio"] == pytest.approx(1 / 6)
    assert "behave_imp_weight" not in st and "filtered_fraction" not in st
    loss.backward()
    # unclipped tokens: dL/dℓ = -A r / N0: -1.1/5, -0.7/5, +1.3/5; clipped tokens 0
    assert lp.grad.cpu().reshape(-1).tolist() == pytest.approx([0.0, -0.22, -0.14, 0.26, 0.0, 0.0], abs=1e-12)


def test_ppo_dual_clip():
    lp = t64([LN(4.0), LN(2.0), LN(4.0)], grad=True)
    zero = torch.zeros(3, dtype=F64)
    adv = t64([-1.0, -1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, st = ppo_actor_loss(lp, zero, zero, adv, 0.2, mask, c_clip=3.0)
    # A=-1,r=4: max(4, 1.2) = 4 > c|A| = 3 → 3 (dual, not clip); A=-1,r=2: max(2, 1.2) = 2 < 3;
    # A=1,r=4: max(-4, -1.2) = -1.2 (clip). Σ = 3 + 2 - 1.2 = 3.8 → /3
    assert loss.item() == pytest.approx(3.8 / 3, rel=1e-12)
    assert st["dual_clip_mask"].tolist() == [True, False, False]
    assert st["clip_mask"].tolist() == [False, False, True]
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-12)  # d(-A r)/dℓ = r = 2


def test_ppo_decoupled_base_is_proximal():
    # Ratio base is π_prox, not π_behave: behave differs wildly but without rejection sampling it is unused.
    lp = t64([0.0])
    loss, _ = ppo_actor_loss(lp, t64([LN(0.5)]), t64([-50.0]), t64([1.0]), 0.2, torch.tensor([True]))
    # r = 1/0.5 = 2 → max(-2, -1.2) = -1.2
    assert loss.item() == pytest.approx(-1.2, rel=1e-12)


def test_ppo_empty_mask_gives_zero():
    loss, st = ppo_actor_loss(
        t64([1.0, 2.0]), t64([0.0, 0.0]), t64([0.0, 0.0]), t64([1.0, 1.0]), 0.2, torch.zeros(2, dtype=torch.bool)
    )
    assert loss.item() == 0.0 and st["n_valid_tokens"] == 0.0


def test_ppo_masked_garbage_does_not_leak(device):
    nan, inf = float("nan"), float("inf")
    lp = torch.tensor([0.1, nan, inf], device=device, requires_grad=True)
    prox = torch.tensor([0.0, -inf, nan], device=device)
    adv = torch.tensor([1.0, nan, inf], device=device)
    mask = torch.tensor([True, False, False], device=device)
    loss, _ = ppo_actor_loss(lp, prox, prox, adv, 0.2, mask)
    assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    loss.backward()
    assert lp.grad.cpu().tolist() == pytest.approx([-math.exp(0.1), 0.0, 0.0], rel=1e-6)


def test_ppo_mask_accepts_01_and_rejects_other_values():
    args = (t64([0.0, 0.0]), t64([0.0, 0.0]), t64([0.0, 0.0]), t64([1.0, 1.0]), 0.2)
    a, _ = ppo_actor_loss(*args, torch.tensor([1, 0]))
    b, _ = ppo_actor_loss(*args, torch.tensor([1.0, 0.0]))
    assert a.item() == b.item() == -1.0
    with pytest.raises(ValueError):
        ppo_actor_loss(*args, torch.tensor([2, 0]))


# --- ppo_actor_loss: sequence level (GSPO) ----------------------------------------------------------------


def test_ppo_sequence_level_packed_and_padded(device):
    # seq 0: log-ratios [ln 2, 0] → ρ = exp(ln2/2) = √2, Ā = (1 + 3)/2 = 2; seq 1: [ln 0.6] → ρ = 0.6, Ā = -1.
    # ε = 0.5 (bounds [0.5, 1.5]) leaves both unclipped: L = -Ā ρ on every valid token.
    # Σ = 2·(-2√2) + 0.6 → /N0 = 3.
    lp = t64([LN(2.0), 0.0, LN(0.6)], device, grad=True)
    zero = torch.zeros(3, dtype=F64, device=device)
    adv = t64([1.0, 3.0, -1.0], device)
    mask = torch.ones(3, dtype=torch.bool, device=device)
    cu = torch.tensor([0, 2, 3], device=device)
    loss, st = ppo_actor_loss(lp, zero, zero, adv, 0.5, mask, importance_sampling_level="sequence", cu_seqlens=cu)
    assert loss.item() == pytest.approx((-4 * math.sqrt(2) + 0.6) / 3, rel=1e-12)
    assert st["importance_weight"].cpu().tolist() == pytest.approx([math.sqrt(2)] * 2 + [0.6], rel=1e-12)
    loss.backward()
    # seq 0: Σ_t L = -2Āρ = -4ρ, ∂ρ/∂ℓ_j = ρ/2 → -2ρ per token; seq 1: ∂(ρ)/∂ℓ = ρ → 0.6. All / 3.
    expected_grad = [-2 * math.sqrt(2) / 3] * 2 + [0.6 / 3]
    assert lp.grad.cpu().tolist() == pytest.approx(expected_grad, rel=1e-12)

    lp2 = t64([[LN(2.0), 0.0], [LN(0.6), 123.0]], device, grad=True)
    adv2 = t64([[1.0, 3.0], [-1.0, 99.0]], device)  # masked advantage must not enter Ā (AReaL PR #1346)
    mask2 = torch.tensor([[True, True], [True, False]], device=device)
    zero2 = torch.zeros(2, 2, dtype=F64, device=device)
    loss2, _ = ppo_actor_loss(lp2, zero2, zero2, adv2, 0.5, mask2, importance_sampling_level="sequence")
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)


def test_ppo_sequence_level_clip_shared_by_sequence():
    # ε = 0.2: seq 0 ρ = √2 > 1.2 with Ā = 2 → L = -2.4 on both tokens (clip); seq 1 ρ = 0.5, Ā = -1 →
    # max(0.5, 0.8) = 0.8 (clip). Σ = -4.8 + 0.8 = -4 → /3.
    lp = t64([LN(2.0), 0.0, LN(0.5)])
    zero = torch.zeros(3, dtype=F64)
    loss, st = ppo_actor_loss(
        lp,
        zero,
        zero,
        t64([1.0, 3.0, -1.0]),
        0.2,
        torch.ones(3, dtype=torch.bool),
        importance_sampling_level="sequence",
        cu_seqlens=torch.tensor([0, 2, 3]),
    )
    assert loss.item() == pytest.approx(-4 / 3, rel=1e-12)
    assert st["clip_mask"].tolist() == [True, True, True]


# --- rejection sampling inside the loss ------------------------------------------------------------------


def test_ppo_rejection_mask_keeps_denominator(device):
    # π_θ = π_prox (r = 1, A = 1 → L = -1); prox - behave = [0, ln 3, ln 1.5] → w = [1, 3, 1.5].
    # upper 2 rejects token 1: Σ = -1·1 + -1·1.5 = -2.5, denominator stays N0 = 3.
    lp = t64([0.0, 0.0, 0.0], device, grad=True)
    prox = torch.zeros(3, dtype=F64, device=device)
    behave = t64([0.0, -LN(3.0), -LN(1.5)], device)
    cfg = RejectionSamplingConfig(upper=2.0)
    loss, st = ppo_actor_loss(
        lp,
        prox,
        behave,
        t64([1.0, 1.0, 1.0], device),
        0.2,
        torch.ones(3, dtype=torch.bool, device=device),
        rejection_sampling=cfg,
    )
    assert loss.item() == pytest.approx(-2.5 / 3, rel=1e-12)
    assert st["behave_imp_weight"].cpu().tolist() == pytest.approx([1.0, 0.0, 1.5], rel=1e-12)
    assert st["behave_mask"].cpu().tolist() == [True, False, True]
    assert st["behave_approx_kl"].cpu().tolist() == pytest.approx([0.0, 0.0, LN(1.5)], rel=1e-12)
    assert st["filtered_fraction"] == pytest.approx(1 / 3)
    assert st["importance_weight"].cpu().tolist() == [1.0, 1.0, 1.0]  # pre-filter mask (PR #1572)
    assert st["n_valid_tokens"] == 3.0
    loss.backward()
    assert lp.grad.cpu().tolist() == pytest.approx([-1 / 3, 0.0, -0.5], rel=1e-12)  # -A r w_b / N0


def test_ppo_rejection_clamp():
    # token-level clamp to [0, 2]: w = [1, 2, 1.5], token 1 clamped → filtered_fraction 1/3, mask unchanged.
    loss, st = ppo_actor_loss(
        t64([0.0] * 3),
        t64([0.0] * 3),
        t64([0.0, -LN(3.0), -LN(1.5)]),
        t64([1.0] * 3),
        0.2,
        torch.ones(3, dtype=torch.bool),
        rejection_sampling=RejectionSamplingConfig(action="clamp", upper=2.0),
    )
    assert loss.item() == pytest.approx(-(1 + 2 + 1.5) / 3, rel=1e-12)
    assert st["filtered_fraction"] == pytest.approx(1 / 3)


# --- apply_rejection_sampling directly -------------------------------------------------------------------


def _rs(prox, behave, mask, cu, **cfg):
    return apply_rejection_sampling(t64(prox), t64(behave), torch.tensor(mask), cu, RejectionSamplingConfig(**cfg))


def test_rs_sequence_ratio_geometric_mean():
    cu = torch.tensor([0, 2, 3])
    # seq 0: δ = [ln 4, 0] → geometric mean 2; seq 1: δ = [ln 1.5] → 1.5.
    m, w, ff = _rs([LN(4.0), 0.0, LN(1.5)], [0.0] * 3, [True] * 3, cu, level="sequence", upper=1.9)
    assert m.tolist() == [False, False, True] and ff == pytest.approx(2 / 3)
    assert w.tolist() == pytest.approx([0.0, 0.0, 1.5], rel=1e-12)
    m, w, ff = _rs([LN(4.0), 0.0, LN(1.5)], [0.0] * 3, [True] * 3, cu, level="sequence", upper=5.0)
    assert ff == 0.0 and w.tolist() == pytest.approx([2.0, 2.0, 1.5], rel=1e-12)  # uniform sequence weight
    # agg sum → product of ratios 4 > 3.9; agg max → largest ratio 4 > 3.9
    for agg in ("sum", "max"):
        m, _, _ = _rs([LN(4.0), 0.0, LN(1.5)], [0.0] * 3, [True] * 3, cu, level="sequence", agg=agg, upper=3.9)
        assert m.tolist() == [False, False, True]
    m, _, _ = _rs([LN(4.0), 0.0, LN(1.5)], [0.0] * 3, [True] * 3, cu, level="sequence", agg="max", upper=4.1)
    assert m.tolist() == [True, True, True]


def test_rs_sequence_kl_is_arithmetic_and_weight_stays_per_token():
    cu = torch.tensor([0, 2, 3])
    # k2 = δ²/2: seq 0 mean ((ln 4)²/2 + 0)/2 = 0.4805 > 0.3 → out; seq 1 (ln 1.5)²/2 = 0.0822 → in.
    m, w, ff = _rs([LN(4.0), 0.0, LN(1.5)], [0.0] * 3, [True] * 3, cu, level="sequence", metric="kl_k2", upper=0.3)
    assert m.tolist() == [False, False, True] and ff == pytest.approx(2 / 3)
    assert w.tolist() == pytest.approx([0.0, 0.0, 1.5], rel=1e-12)


def test_rs_token_kl_k3_and_bounds_inclusive():
    # k3 = e^-δ - 1 + δ: δ = ln 4 → 0.25 - 1 + 1.3863 = 0.6363 > 0.5; δ = ln 1.5 → 0.0721
    m, w, ff = _rs([LN(4.0), LN(1.5)], [0.0, 0.0], [True, True], None, metric="kl_k3", upper=0.5)
    assert m.tolist() == [False, True] and ff == 0.5
    assert w.tolist() == pytest.approx([0.0, 1.5], rel=1e-12)  # the weight stays exp(δ), zeroed when rejected
    # ratio exactly at the upper bound is kept (inclusive); lower bound excludes smaller ratios
    m, _, _ = _rs([LN(2.0), LN(0.25)], [0.0, 0.0], [True, True], None, upper=2.0, lower=0.5)
    assert m.tolist() == [True, False]


def test_rs_nan_handling():
    inf = float("inf")
    # -inf - -inf = NaN: the weight uses the sanitised δ = 0 (ratio 1, kept), a KL metric stays NaN (rejected)
    m, w, _ = _rs([-inf, 0.0], [-inf, 0.0], [True, True], None)
    assert m.tolist() == [True, True] and w.tolist() == [1.0, 1.0]
    m, _, _ = _rs([-inf, 0.0], [-inf, 0.0], [True, True], None, metric="kl_k1", upper=1.0)
    assert m.tolist() == [False, True]


def test_rs_padded_equals_packed_and_mask_dtype_kept():
    prox = t64([[LN(4.0), 0.0], [LN(1.5), 7.0]])
    behave = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.int32)
    cfg = RejectionSamplingConfig(level="sequence", upper=1.9)
    m2d, w2d, ff2d = apply_rejection_sampling(prox, behave, mask, None, cfg)
    assert m2d.dtype == torch.int32 and m2d.tolist() == [[0, 0], [1, 0]]
    lengths = torch.tensor([2, 1])
    p, cu = padded_to_packed(prox, lengths)
    b, _ = padded_to_packed(behave, lengths)
    mk, _ = padded_to_packed(mask, lengths)
    m1d, w1d, ff1d = apply_rejection_sampling(p, b, mk, cu, cfg)
    assert m1d.tolist() == [0, 0, 1] and w1d.tolist() == pytest.approx([0.0, 0.0, 1.5]) and ff1d == ff2d
    assert w2d.reshape(-1).tolist() == pytest.approx([0.0, 0.0, 1.5, 0.0])


def test_rs_errors():
    cfg = RejectionSamplingConfig(level="sequence")
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rejection_sampling(t64([0.0]), t64([0.0]), torch.tensor([True]), None, cfg)
    with pytest.raises(ValueError, match="shape"):
        apply_rejection_sampling(t64([0.0]), t64([0.0, 0.0]), torch.tensor([True]), None, cfg)
    with pytest.raises(ValueError, match="ndim"):
        apply_rejection_sampling(t64([[[0.0]]]), t64([[[0.0]]]), torch.tensor([[[True]]]), None, cfg)
    with pytest.raises(TypeError):
        apply_rejection_sampling(t64([0.0]), t64([0.0]), torch.tensor([True]), None, {"upper": 2.0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"level": "batch"},
        {"action": "drop"},
        {"metric": "binary_kl"},
        {"agg": "median"},
        {"upper": 2.0, "lower": 3.0},
        {"upper": 1.0},
        {"upper": 2.0, "lower": 0.0},
        {"metric": "kl_k2", "upper": 0.0},
        {"metric": "kl_k3", "upper": -1.0},
        {"metric": "kl_k1", "action": "clamp"},
    ],
)
def test_rs_config_validation(kwargs):
    with pytest.raises(ValueError):
        RejectionSamplingConfig(**kwargs)


def test_rs_config_defaults_and_warning():
    cfg = RejectionSamplingConfig()
    assert (cfg.level, cfg.action, cfg.metric, cfg.agg, cfg.upper, cfg.lower) == (
        "token",
        "mask",
        "ratio",
        "mean",
        5.0,
        None,
    )
    assert RejectionSamplingConfig(action="clamp").lower == 0.0
    assert RejectionSamplingConfig(metric="kl_k1", upper=-0.5).upper == -0.5  # k1 may be negative
    with pytest.warns(UserWarning, match="ignored"):
        RejectionSamplingConfig(agg="max")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RejectionSamplingConfig(level="sequence", agg="max")


# --- M2PO ------------------------------------------------------------------------------------------------


def test_m2po_drops_largest_until_tail_mean_below_threshold(device):
    old = torch.tensor([[0.0, 3.0, 0.1], [1.0, 0.0, 0.0]], device=device)
    prox = torch.zeros(2, 3, device=device)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool, device=device)
    # valid M2 = [0, 9, 0.01, 1]; sorted [9, 1, 0.01, 0]; tail means [2.5025, 0.3367, 0.005, 0]
    # threshold 0.5 → first tail mean < 0.5 is at index 1 → drop the 9 only.
    out = m2po_mask(old, prox, mask, 0.5)
    assert out.dtype == torch.bool and out.cpu().tolist() == [[True, False, True], [True, False, False]]
    # threshold 0.3 → index 2 → drop 9 and 1
    assert m2po_mask(old, prox, mask, 0.3).cpu().tolist() == [[True, False, True], [False, False, False]]
    # threshold 0 → no tail mean < 0 → drop n - 1 = 3, only the smallest (0) survives
    assert m2po_mask(old, prox, mask, 0.0).cpu().tolist() == [[True, False, False], [False, False, False]]
    # threshold above the full mean keeps everything
    assert m2po_mask(old, prox, mask, 10.0).cpu().tolist() == mask.cpu().tolist()


def test_m2po_empty_mask_and_packed():
    mask = torch.zeros(3, dtype=torch.bool)
    out = m2po_mask(torch.ones(3), torch.zeros(3), mask, 0.1)
    assert out.tolist() == [False] * 3
    # ties keep token order (stable sort): M2 = [4, 4, 0], threshold 1 → drop 2 largest
    assert m2po_mask(t64([2.0, -2.0, 0.0]), t64([0.0] * 3), torch.ones(3, dtype=torch.bool), 1.0).tolist() == [
        False,
        False,
        True,
    ]


# --- SAPO ------------------------------------------------------------------------------------------------


def test_sapo_token_level_values_and_gradient(device):
    lp = t64([LN(1.5), LN(0.5), 0.0], device, grad=True)
    old = torch.zeros(3, dtype=F64, device=device)
    adv = t64([1.0, -1.0, 5.0], device)
    mask = torch.tensor([True, True, False], device=device)
    loss, st = sapo_loss(lp, old, adv, 1.0, 1.05, mask)
    # A > 0: gate = σ(1·(1.5-1))·4/1; A < 0: gate = σ(1.05·(0.5-1))·4/1.05; L = -gate·A; N0 = 2
    g0 = sigmoid(0.5) * 4.0
    g1 = sigmoid(-0.525) * 4.0 / 1.05
    assert loss.item() == pytest.approx((-g0 + g1) / 2, rel=1e-12)
    assert st["sapo_soft_gate"][:2].cpu().tolist() == pytest.approx([g0, g1], rel=1e-12)
    assert st["clip_mask"].cpu().tolist() == [False] * 3
    loss.backward()
    # dL/dℓ = -4σ(1-σ)·r·A
    s0, s1 = sigmoid(0.5), sigmoid(-0.525)
    expected = [-4 * s0 * (1 - s0) * 1.5 / 2, -4 * s1 * (1 - s1) * 0.5 * (-1) / 2, 0.0]
    assert lp.grad.cpu().tolist() == pytest.approx(expected, rel=1e-12)


def test_sapo_gradient_is_minus_advantage_at_ratio_one():
    lp = t64([0.0, 0.0], grad=True)
    loss, _ = sapo_loss(lp, t64([0.0, 0.0]), t64([2.0, -3.0]), 0.7, 3.0, torch.ones(2, dtype=torch.bool))
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-2.0 / 2, 3.0 / 2], rel=1e-12)


def test_sapo_sequence_level_matches_gspo_ratio():
    # seq 0: ρ = √2, Ā = 2 (A > 0); seq 1: ρ = 0.6, Ā = -1. L = -gate·Ā on each valid token, N0 = 3.
    loss, _ = sapo_loss(
        t64([LN(2.0), 0.0, LN(0.6)]),
        t64([0.0] * 3),
        t64([1.0, 3.0, -1.0]),
        1.0,
        1.05,
        torch.ones(3, dtype=torch.bool),
        "sequence",
        torch.tensor([0, 2, 3]),
    )
    g0 = sigmoid(math.sqrt(2) - 1) * 4
    g1 = sigmoid(1.05 * (0.6 - 1)) * 4 / 1.05
    assert loss.item() == pytest.approx((2 * (-g0 * 2) + g1) / 3, rel=1e-12)


def test_sapo_errors():
    args = (t64([0.0]), t64([0.0]), t64([1.0]))
    with pytest.raises(ValueError, match="positive"):
        sapo_loss(*args, 0.0, 1.0, torch.tensor([True]))
    with pytest.raises(ValueError, match="positive"):
        sapo_loss(*args, 1.0, -1.0, torch.tensor([True]))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        sapo_loss(*args, 1.0, 1.0, torch.tensor([True]), "batch")
    with pytest.raises(ValueError, match="cu_seqlens"):
        sapo_loss(*args, 1.0, 1.0, torch.tensor([True]), "sequence")


# --- CISPO -----------------------------------------------------------------------------------------------


def test_cispo_values_and_gradient(device):
    lp = t64([-1.0, -2.0, -3.0], device, grad=True)
    prox = t64([-1.0 - LN(2.0), -2.0, 0.0], device, grad=True)
    adv = t64([1.0, -1.0, 4.0], device)
    mask = torch.tensor([True, True, False], device=device)
    loss, st = cispo_loss(lp, prox, None, adv, 0.2, mask, eps_clip_higher=0.28)
    # r = [2, 1]; rc = [1.28, 1]; L = -rc·A·ℓ = [-1.28·1·(-1), -1·(-1)·(-2)] = [1.28, -2] → / N0 = 2
    assert loss.item() == pytest.approx((1.28 - 2.0) / 2, rel=1e-12)
    assert st["clip_mask"].cpu().tolist() == [True, False, False]
    assert st["importance_weight"][:2].cpu().tolist() == pytest.approx([2.0, 1.0], rel=1e-12)
    loss.backward()
    assert lp.grad.cpu().tolist() == pytest.approx([-0.64, 0.5, 0.0], rel=1e-12)  # -rc·A / N0
    assert prox.grad is None or torch.all(prox.grad == 0)


def test_cispo_with_rejection_sampling():
    # w_b = [1, 3] → upper 2 rejects token 1; r = 1; L = -1·A·ℓ·w_b = -(1)(1)(-1) = 1 for token 0; N0 = 2.
    loss, st = cispo_loss(
        t64([-1.0, -1.0]),
        t64([-1.0, -1.0]),
        t64([-1.0, -1.0 - LN(3.0)]),
        t64([1.0, 1.0]),
        0.2,
        torch.ones(2, dtype=torch.bool),
        eps_clip_higher=0.28,
        rejection_sampling=RejectionSamplingConfig(upper=2.0),
    )
    assert loss.item() == pytest.approx(0.5, rel=1e-12)
    assert st["filtered_fraction"] == 0.5 and st["behave_mask"].tolist() == [True, False]


@pytest.mark.parametrize("hi", [None, 0.0, -0.1])
def test_cispo_requires_positive_eps_clip_higher(hi):
    with pytest.raises(ValueError, match="eps_clip_higher"):
        cispo_loss(t64([0.0]), t64([0.0]), None, t64([1.0]), 0.2, torch.tensor([True]), eps_clip_higher=hi)


def test_cispo_other_errors():
    args = (t64([0.0]), t64([0.0]), None, t64([1.0]), 0.2, torch.tensor([True]))
    with pytest.raises(ValueError, match="token"):
        cispo_loss(*args, eps_clip_higher=0.3, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="old_logprobs"):
        cispo_loss(*args, eps_clip_higher=0.3, rejection_sampling=RejectionSamplingConfig())


# --- errors of ppo_actor_loss ----------------------------------------------------------------------------


def test_ppo_errors():
    x, m = t64([0.0, 0.0]), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ppo_actor_loss(x, x, x, x, 0.2, m, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="c_clip"):
        ppo_actor_loss(x, x, x, x, 0.2, m, c_clip=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_actor_loss(x, x, x, x, 0.2, m, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_actor_loss(x, x, x, x, 0.2, m, importance_sampling_level="sequence", cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="shape"):
        ppo_actor_loss(x, t64([0.0]), x, x, 0.2, m)
    with pytest.raises(ValueError, match="ndim"):
        ppo_actor_loss(x[None, None], x[None, None], x[None, None], x[None, None], 0.2, m[None, None])
    with pytest.raises(ValueError, match="eps_clip"):
        ppo_actor_loss(x, x, x, x, -0.2, m)
    with pytest.raises(TypeError):
        ppo_actor_loss(x, x, x, x, 0.2, m, eps_clip_hihger=0.3)  # misspelt keyword


# --- layouts, streaming, gradcheck -----------------------------------------------------------------------


def _random_batch(seed, lengths, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    lp = (torch.randn(n, generator=g, dtype=F64) * 0.3 - 1).to(device)
    prox = (lp.cpu() + torch.randn(n, generator=g, dtype=F64) * 0.3).to(device)
    behave = (prox.cpu() + torch.randn(n, generator=g, dtype=F64) * 0.5).to(device)
    adv = torch.randn(n, generator=g, dtype=F64).to(device)
    mask = (torch.rand(n, generator=g) > 0.2).to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    return lp, prox, behave, adv, mask, cu


def _split(cu, k):
    """Token ranges of two batches of whole sequences split after sequence k."""
    return int(cu[k]), cu[: k + 1], cu[k:] - cu[k]


LOSS_CASES = [
    (
        "ppo-token",
        lambda lp, prox, b, a, m, cu: ppo_actor_loss_terms(
            lp, prox, b, a, 0.2, m, eps_clip_higher=0.3, c_clip=3.0, cu_seqlens=cu
        ),
    ),
    (
        "ppo-seq-rs",
        lambda lp, prox, b, a, m, cu: ppo_actor_loss_terms(
            lp,
            prox,
            b,
            a,
            0.2,
            m,
            importance_sampling_level="sequence",
            cu_seqlens=cu,
            rejection_sampling=RejectionSamplingConfig(level="sequence", upper=1.5, lower=0.7),
        ),
    ),
    ("sapo-seq", lambda lp, prox, b, a, m, cu: sapo_loss_terms(lp, prox, a, 1.0, 1.05, m, "sequence", cu)),
    (
        "cispo-rs",
        lambda lp, prox, b, a, m, cu: cispo_loss_terms(
            lp,
            prox,
            b,
            a,
            0.2,
            m,
            eps_clip_higher=0.28,
            cu_seqlens=cu,
            rejection_sampling=RejectionSamplingConfig(action="clamp", upper=1.5),
        ),
    ),
]


@pytest.mark.parametrize(("name", "fn"), LOSS_CASES)
def test_terms_stream_exactly_over_sequence_splits(name, fn):
    lengths = [3, 1, 4, 2, 5]
    lp, prox, b, a, m, cu = _random_batch(7, lengths)
    num, den, _ = fn(lp, prox, b, a, m, cu)
    for k in range(1, len(lengths)):
        cut, cu1, cu2 = _split(cu, k)
        n1, d1, _ = fn(lp[:cut], prox[:cut], b[:cut], a[:cut], m[:cut], cu1)
        n2, d2, _ = fn(lp[cut:], prox[cut:], b[cut:], a[cut:], m[cut:], cu2)
        assert (n1 + n2).item() == pytest.approx(num.item(), rel=1e-9)
        assert (d1 + d2).item() == den.item()


@pytest.mark.parametrize(("name", "fn"), LOSS_CASES)
def test_padded_equals_packed(name, fn):
    lengths = [3, 1, 4]
    lp, prox, b, a, m, cu = _random_batch(11, lengths)
    num, den, _ = fn(lp, prox, b, a, m, cu)
    width = max(lengths)

    def pad(x, fill):
        out = torch.full((len(lengths), width), fill, dtype=x.dtype)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            out[i, : e - s] = x[s:e]
        return out

    pn, pd, _ = fn(pad(lp, float("nan")), pad(prox, 0.0), pad(b, 0.0), pad(a, float("nan")), pad(m, False), None)
    assert pn.item() == pytest.approx(num.item(), rel=1e-12) and pd.item() == den.item()


def test_loss_equals_numerator_over_denominator():
    lp, prox, b, a, m, cu = _random_batch(5, [4, 3])
    loss, _ = ppo_actor_loss(lp, prox, b, a, 0.2, m, cu_seqlens=cu)
    num, den, _ = ppo_actor_loss_terms(lp, prox, b, a, 0.2, m, cu_seqlens=cu)
    assert loss.item() == pytest.approx((num / den).item(), rel=1e-15)


def test_gradcheck_ppo_sequence_and_sapo():
    lp, prox, b, a, m, cu = _random_batch(13, [3, 2])
    lp = lp.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: ppo_actor_loss(x, prox, b, a, 0.2, m, importance_sampling_level="sequence", cu_seqlens=cu)[0],
        (lp,),
    )
    assert torch.autograd.gradcheck(lambda x: sapo_loss(x, prox, a, 1.0, 1.05, m)[0], (lp,))
    assert torch.autograd.gradcheck(
        lambda x: ppo_actor_loss(x, prox, b, a, 0.2, m, rejection_sampling=RejectionSamplingConfig(upper=1.3))[0],
        (lp,),
    )


def test_float32_and_float16_dtypes():
    lp = torch.tensor([LN(1.5), 0.0], dtype=torch.float16)
    zero = torch.zeros(2, dtype=torch.float16)
    loss, st = ppo_actor_loss(
        lp, zero, zero, torch.tensor([1.0, 1.0], dtype=torch.float16), 0.2, torch.ones(2, dtype=torch.bool)
    )
    # fp16 ℓ ≈ 0.4055 → r ≈ 1.5 → -1.2 and -1 → -1.1 (computed in float32, returned in float16)
    assert loss.dtype == torch.float16 and loss.item() == pytest.approx(-1.1, abs=1e-3)
    assert st["importance_weight"].dtype == torch.float32
