"""Tests for kl_estimate (k1/k2/k3/abs) and aggregate_loss (verl's four loss_agg_modes)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.core import AGG_MODES, aggregate_loss, aggregate_loss_terms, kl_estimate

LN2 = math.log(2.0)
F64 = torch.float64


# --- kl_estimate ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # Δ = log p - log p_base = 0 - ln 2 = -ln 2
        ("k1", -LN2),  # Δ
        ("k2", LN2**2 / 2),  # Δ²/2 = 0.2402
        ("k3", 2.0 - 1.0 - LN2),  # e^{-Δ} - 1 + Δ = 2 - 1 - ln 2 = 0.3069
        ("abs", LN2),  # |Δ|
    ],
)
def test_kl_values(kind, expected, device):
    lp = torch.tensor([0.0], dtype=F64, device=device)
    base = torch.tensor([LN2], dtype=F64, device=device)
    out = kl_estimate(lp, base, kind)
    assert out.device.type == torch.device(device).type
    assert out.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("x", [1.0, -1.0, 1e-6, -30.0])
def test_k3_of_log_weight_is_e_to_the_x_minus_1_minus_x(x):
    from grpo_cli.core.kl import k3_of_log_weight

    # float64 reference: e^x − 1 − x, with the Taylor series x²/2 + x³/6 where the direct form cancels
    expected = x * x / 2 + x**3 / 6 if abs(x) < 1e-4 else math.exp(x) - 1 - x
    assert k3_of_log_weight(torch.tensor([x], dtype=F64)).item() == pytest.approx(expected, rel=1e-9)


def test_kl_k3_is_k3_of_minus_delta_bit_for_bit():
    from grpo_cli.core.kl import k3_of_log_weight, kl_from_log_ratio

    delta = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(kl_from_log_ratio(delta, "k3"), torch.expm1(-delta) + delta)
    assert torch.equal(k3_of_log_weight(delta), torch.expm1(delta) - delta)


def test_kl_k3_gradients():
    lp = torch.tensor([0.0], dtype=F64, requires_grad=True)
    base = torch.tensor([LN2], dtype=F64, requires_grad=True)
    kl_estimate(lp, base, "k3").sum().backward()
    # d/dℓ (e^{-Δ} - 1 + Δ) = 1 - e^{-Δ} = 1 - 2 = -1; d/dℓ_base = e^{-Δ} - 1 = 1
    assert lp.grad.item() == pytest.approx(-1.0, rel=1e-12)
    assert base.grad.item() == pytest.approx(1.0, rel=1e-12)


def test_kl_k3_small_delta_is_accurate():
    # e^{-Δ} - 1 + Δ ≈ Δ²/2 for tiny Δ; naive float64 evaluation would lose most digits at Δ = 1e-7.
    out = kl_estimate(torch.tensor([1e-7], dtype=F64), torch.tensor([0.0], dtype=F64), "k3")
    assert out.item() == pytest.approx(0.5e-14 - 1e-21 / 6, rel=1e-9)


def test_kl_clamp_and_dtype():
    lp = torch.tensor([0.0, 0.0], dtype=torch.float16)
    base = torch.tensor([20.0, -3.0], dtype=torch.float16)
    # k1 = Δ = [-20, 3] → clamp ±10 → [-10, 3]; half types go through float32 (as AReaL's KLEstimator)
    out = kl_estimate(lp, base, "k1", clamp=10.0)
    assert out.dtype == torch.float32 and out.tolist() == [-10.0, 3.0]
    # k3 at Δ = -20: e^20 - 21 = 4.85e8 → clamped to 10
    assert kl_estimate(lp, base, "k3", clamp=10.0)[0].item() == 10.0


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"kind": "k4"}, ValueError),
        ({"kind": "low_var_kl"}, ValueError),
        ({"clamp": 0.0}, ValueError),
        ({"clamp": -1.0}, ValueError),
        ({"clamp": "10"}, TypeError),
    ],
)
def test_kl_errors(kwargs, exc):
    args = {"log_probs": torch.zeros(2), "log_probs_base": torch.zeros(2), "kind": "k1", **kwargs}
    with pytest.raises(exc):
        kl_estimate(**args)
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")


# --- aggregate_loss ---------------------------------------------------------------------------------------

# L = [[1, 3, 5], [2, 7, 9], [4, 4, 4]], mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
# S = [4, 2, 0], n = [2, 1, 0]
L_PAD = [[1.0, 3.0, 5.0], [2.0, 7.0, 9.0], [4.0, 4.0, 4.0]]
M_PAD = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
EXPECTED = {
    "token-mean": 6.0 / 3,  # Σ S / Σ n
    "seq-mean-token-mean": (4.0 / 2 + 2.0 / 1) / 2,  # mean over the 2 non-empty sequences
    "seq-mean-token-sum": (4.0 + 2.0) / 2,
    "seq-mean-token-sum-norm": 6.0 / 3,  # / T = 3
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_padded(mode, device):
    per_token = torch.tensor(L_PAD, dtype=F64, device=device, requires_grad=True)
    out = aggregate_loss(per_token, torch.tensor(M_PAD, device=device), mode)
    assert out.item() == pytest.approx(EXPECTED[mode], rel=1e-12)
    out.backward()
    grad = per_token.grad.cpu()
    # hand-derived gradients: token-mean 1/3 per valid token; seq-mean-token-mean 1/(2·n_i);
    # seq-mean-token-sum 1/2; sum-norm 1/3. Invalid tokens get 0.
    g = {
        "token-mean": [1 / 3, 1 / 3, 1 / 3],
        "seq-mean-token-mean": [1 / 4, 1 / 4, 1 / 2],
        "seq-mean-token-sum": [1 / 2] * 3,
        "seq-mean-token-sum-norm": [1 / 3] * 3,
    }[mode]
    assert [grad[0, 0].item(), grad[0, 1].item(), grad[1, 0].item()] == pytest.approx(g, rel=1e-12)
    assert grad[0, 2].item() == grad[2, 0].item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_packed_equals_padded(mode):
    # packed: seq lengths 3, 2, 1 (the padded rows truncated: widths differ from the padded T = 3)
    flat = torch.tensor([1.0, 3.0, 5.0, 2.0, 7.0, 4.0], dtype=F64)
    mask = torch.tensor([1, 1, 0, 1, 0, 0])
    cu = torch.tensor([0, 3, 5, 6])
    out = aggregate_loss(flat, mask, mode, cu_seqlens=cu)
    # sum-norm default scale for packed input is the longest sequence (3), the padded T
    assert out.item() == pytest.approx(EXPECTED[mode], rel=1e-12)


def test_aggregate_overrides_and_terms():
    per_token = torch.tensor(L_PAD, dtype=F64)
    mask = torch.tensor(M_PAD)
    assert aggregate_loss(per_token, mask, "token-mean", num_tokens=6).item() == 1.0
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum", num_sequences=3).item() == 2.0
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", loss_scale_factor=12).item() == 0.5
    num, den = aggregate_loss_terms(per_token, mask, "seq-mean-token-mean")
    assert (num.item(), den.item()) == (4.0, 2.0) and num.dtype == den.dtype == F64


def test_aggregate_garbage_and_empty():
    per_token = torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0]])
    mask = torch.tensor([[False, True], [False, True]])
    assert aggregate_loss(per_token, mask, "token-mean").item() == 1.5
    for mode in AGG_MODES:
        assert aggregate_loss(per_token, torch.zeros(2, 2, dtype=torch.bool), mode).item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_terms_stream(mode):
    g = torch.Generator().manual_seed(2)
    lengths = [3, 1, 4, 2]
    flat = torch.randn(10, generator=g, dtype=F64)
    mask = torch.rand(10, generator=g) > 0.3
    cu = torch.tensor([0, 3, 4, 8, 10])
    kw = {"loss_scale_factor": 4.0} if mode == "seq-mean-token-sum-norm" else {}
    num, den = aggregate_loss_terms(flat, mask, mode, cu_seqlens=cu, **kw)
    n1, d1 = aggregate_loss_terms(flat[:4], mask[:4], mode, cu_seqlens=cu[:3], **kw)
    n2, d2 = aggregate_loss_terms(flat[4:], mask[4:], mode, cu_seqlens=cu[2:] - 4, **kw)
    assert (n1 + n2).item() == pytest.approx(num.item(), rel=1e-12)
    if mode != "seq-mean-token-sum-norm":  # the scale factor is a global constant, not a count
        assert (d1 + d2).item() == den.item()
    assert len(lengths) == cu.numel() - 1


def test_aggregate_errors():
    x, m = torch.zeros(4), torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(x, m, "seq-mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate_loss(x, m, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate_loss(x, m, "seq-mean-token-mean", cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(x, m[:3], "token-mean")
    with pytest.raises(ValueError):
        aggregate_loss(x, m, "token-mean", num_tokens=-1)
    with pytest.raises(ValueError):
        aggregate_loss(x, torch.full((4,), 3), "token-mean")
