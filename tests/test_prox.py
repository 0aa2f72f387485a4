"""Proximal approximation (AReaL ``compute_prox_logp_approximations``) and its error metrics.

Every expected value below is derived by hand in the comments (or, in the cross-check test, by an independent
plain-Python ``math`` loop), never from the implementation itself.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_cli.core import (
    PROX_APPROX_METHODS,
    PROX_ERROR_KEYS,
    broadcast_current_version,
    compute_prox_logp_approximations,
    prox_approximation_errors,
    prox_importance_weights,
    prox_interpolation_alpha,
    reduce_prox_errors,
)

DTYPES = [torch.float32, torch.float64]
NAN, INF = float("nan"), float("inf")


def _t(values, device, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=device)


def _close(actual: torch.Tensor, expected, dtype=torch.float64, rtol: float | None = None) -> None:
    rtol = rtol if rtol is not None else (1e-6 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(
        actual.double().cpu(), torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=rtol * 1e-2
    )


# ----------------------------------------------------------------------------------------------------
# α
# ----------------------------------------------------------------------------------------------------


def test_alpha_hand_values(device: str) -> None:
    # v_θ = 5, v_prox = 4; α = (v_prox − v_b)/(v_θ − v_b) = (k − 1)/k for lag k = 5 − v_b ≥ 1:
    #   v_b = −1, −5 (prompt)      → 0
    #   v_b = 5  (k = 0: v_θ ≤ v_b) → 0
    #   v_b = 6  (v_b > v_θ)        → 0
    #   v_b = 4  (k = 1)            → 0/1 = 0
    #   v_b = 3  (k = 2)            → 1/2
    #   v_b = 2  (k = 3)            → 2/3
    #   v_b = 1  (k = 4)            → 3/4
    #   v_b = 0  (k = 5)            → 4/5   (version 0 is a generated token, not a prompt)
    versions = torch.tensor([-1, -5, 5, 6, 4, 3, 2, 1, 0], device=device)
    alpha = prox_interpolation_alpha(versions, 5, dtype=torch.float64)
    assert alpha.dtype == torch.float64 and alpha.device.type == torch.device(device).type
    _close(alpha, [0, 0, 0, 0, 0, 1 / 2, 2 / 3, 3 / 4, 4 / 5])
    # AReaL computes α in float32: 2/3 rounds to the float32 nearest 0.6666667
    alpha32 = prox_interpolation_alpha(versions, 5)
    assert alpha32.dtype == torch.float32
    _close(alpha32, [0, 0, 0, 0, 0, 1 / 2, 2 / 3, 3 / 4, 4 / 5], torch.float32)


def test_alpha_zero_when_current_version_is_zero_or_one(device: str) -> None:
    # v_θ = 0: generated tokens have v_b = 0 → v_θ − v_b = 0 (no division) → α = 0; prompt −1 → 0
    versions = torch.tensor([0, 0, -1], device=device)
    _close(prox_interpolation_alpha(versions, 0), [0, 0, 0], torch.float32)
    # v_θ = 1, v_prox = 0: v_b = 0 is lag 1 → α = (0 − 0)/(1 − 0) = 0
    _close(prox_interpolation_alpha(versions, 1), [0, 0, 0], torch.float32)


def test_alpha_clamped_to_unit_interval(device: str) -> None:
    # Fractional versions make the raw ratio negative, which the clamp sends to 0 (for v_θ − v_b > 0 the
    # ratio is 1 − 1/(v_θ − v_b) < 1, so the upper clamp cannot bind for finite versions):
    #   v_b = 4.5,  v_θ = 5: (4 − 4.5)/(5 − 4.5)   = −0.5/0.5  = −1 → 0
    #   v_b = 4.75, v_θ = 5: (4 − 4.75)/(5 − 4.75) = −0.75/0.25 = −3 → 0
    #   v_b = 2.5,  v_θ = 5: (4 − 2.5)/(5 − 2.5)   = 1.5/2.5   = 0.6 (unclamped)
    versions = torch.tensor([4.5, 4.75, 2.5], dtype=torch.float64, device=device)
    _close(prox_interpolation_alpha(versions, 5, dtype=torch.float64), [0.0, 0.0, 0.6])
    # without the clamp α = −1 would extrapolate loglinear to −2 + (−1)(−1 − (−2)) = −3; clamped it stays ℓb
    out = compute_prox_logp_approximations(
        _t([-2.0, -2.0, -2.0], device, torch.float64),
        _t([-1.0, -1.0, -1.0], device, torch.float64),
        versions,
        5,
        "loglinear",
    )
    _close(out["loglinear"], [-2.0, -2.0, -2.0 + 0.6 * 1.0])


# ----------------------------------------------------------------------------------------------------
# approximations
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_loglinear_and_rollout_hand_values(device: str, dtype: torch.dtype) -> None:
    # ℓb = −2, ℓθ = −1 everywhere, v_θ = 5 → loglinear = −2 + α·(−1 − (−2)) = −2 + α
    #   prompt (−1): α = 0 → −2;  v_b = 4: α = 0 → −2;  v_b = 3: α = 1/2 → −1.5
    #   v_b = 2: α = 2/3 → −4/3;  v_b = 1: α = 3/4 → −1.25;  v_b = 5: α = 0 → −2
    # rollout = ℓb = −2 everywhere
    versions = torch.tensor([-1, 4, 3, 2, 1, 5], device=device)
    old = torch.full((6,), -2.0, dtype=dtype, device=device)
    new = torch.full((6,), -1.0, dtype=dtype, device=device)
    out = compute_prox_logp_approximations(old, new, versions, 5)
    assert list(out) == list(PROX_APPROX_METHODS)
    for value in out.values():
        assert value.dtype == dtype and value.device == old.device and value.shape == old.shape
    _close(out["loglinear"], [-2.0, -2.0, -1.5, -2.0 + 2 / 3, -1.25, -2.0], dtype)
    _close(out["rollout"], [-2.0] * 6, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_hand_values(device: str, dtype: torch.dtype) -> None:
    # ℓb = log 0.2, ℓθ = log 0.6 → linear = log((1 − α)·0.2 + α·0.6 + 1e−10):
    #   α = 0   → log(0.2 + 1e−10)
    #   α = 1/2 → log(0.1 + 0.3 + 1e−10)   = log(0.4 + 1e−10)
    #   α = 3/4 → log(0.05 + 0.45 + 1e−10) = log(0.5 + 1e−10)
    # loglinear at α = 1/2 is the geometric mean: log √(0.2·0.6) = log √0.12
    versions = torch.tensor([4, 3, 1], device=device)
    old = torch.full((3,), math.log(0.2), dtype=dtype, device=device)
    new = torch.full((3,), math.log(0.6), dtype=dtype, device=device)
    out = compute_prox_logp_approximations(old, new, versions, 5)
    _close(out["linear"], [math.log(0.2 + 1e-10), math.log(0.4 + 1e-10), math.log(0.5 + 1e-10)], dtype)
    _close(out["loglinear"][1:2], [math.log(math.sqrt(0.12))], dtype)


def test_linear_adds_1e_minus_10_even_at_alpha_zero(device: str) -> None:
    # ℓb = ℓθ = −30, α = 0 (prompt): AReaL still returns log(e^−30 + 1e−10), not −30:
    #   e^−30 = 9.3576e−14, so log(1.00093576e−10) = log(1e−10) + log(1.00093576)
    #         ≈ −23.02585 + 0.000935 ≈ −23.0249
    old = torch.full((1,), -30.0, dtype=torch.float64, device=device)
    out = compute_prox_logp_approximations(old, old.clone(), torch.tensor([-1], device=device), 5)
    _close(out["linear"], [math.log(math.exp(-30.0) + 1e-10)])
    assert abs(out["linear"].item() - (-23.0249)) < 1e-4
    _close(out["loglinear"], [-30.0])  # loglinear and rollout are untouched at α = 0
    _close(out["rollout"], [-30.0])


def test_garbage_current_logp_at_alpha_zero_does_not_poison_prox(device: str) -> None:
    # Prompt/padding positions (α = 0) often carry −inf or NaN ℓθ. α·(ℓθ − ℓb) would be 0·inf = NaN; the
    # implementation selects ℓb there instead, which equals AReaL's value for every finite input.
    #   pos 0: prompt, ℓθ = NaN  → loglinear = ℓb = −1, linear = log(e^−1 + 1e−10)
    #   pos 1: lag 1,  ℓθ = +inf → loglinear = −1,       linear = log(e^−1 + 1e−10)
    #   pos 2: lag 2,  ℓθ = −3   → loglinear = −1 + ½(−3 + 1) = −2, linear = log(½e^−1 + ½e^−3 + 1e−10)
    old = _t([-1.0, -1.0, -1.0], device, torch.float64)
    new = _t([NAN, INF, -3.0], device, torch.float64)
    out = compute_prox_logp_approximations(old, new, torch.tensor([-1, 4, 3], device=device), 5)
    e1 = math.exp(-1.0)
    _close(out["loglinear"], [-1.0, -1.0, -2.0])
    _close(out["linear"], [math.log(e1 + 1e-10)] * 2 + [math.log(0.5 * e1 + 0.5 * math.exp(-3.0) + 1e-10)])


def test_method_selection_and_validation(device: str) -> None:
    old, new = _t([-2.0], device), _t([-1.0], device)
    versions = torch.tensor([3], device=device)
    assert list(compute_prox_logp_approximations(old, new, versions, 5, "linear")) == ["linear"]
    assert list(compute_prox_logp_approximations(old, new, versions, 5, ["rollout", "loglinear"])) == [
        "rollout",
        "loglinear",
    ]
    with pytest.raises(ValueError, match="loglinear, linear, rollout") as info:
        compute_prox_logp_approximations(old, new, versions, 5, "harmonic")
    assert "harmonic" in str(info.value)
    with pytest.raises(ValueError, match="valid"):
        compute_prox_logp_approximations(old, new, versions, 5, [])
    with pytest.raises(ValueError, match="valid"):  # a ProxLogpMethod, not an approximation
        compute_prox_logp_approximations(old, new, versions, 5, "recompute")


def test_mixed_per_sequence_current_versions_padded_and_packed(device: str) -> None:
    # ℓb = −2, ℓθ = −1 → loglinear = −2 + α. Two sequences with different v_θ:
    #   seq 0 (v_θ = 5): versions [3, 1]        → α [1/2, 3/4]          → [−1.5, −1.25]
    #   seq 1 (v_θ = 2): versions [−1, 0, 3, 1] → prompt 0; lag 2 → 1/2; v_b > v_θ → 0; lag 1 → 0
    #                                           → [−2, −1.5, −2, −2]
    # (with a single v_θ = 5, seq 1's v_b = 3 would get α = 1/2: the per-sequence version matters)
    expected_alpha = [[0.5, 0.75], [0.0, 0.5, 0.0, 0.0]]
    expected = [[-2.0 + a for a in row] for row in expected_alpha]
    cv = torch.tensor([5, 2], device=device)

    # packed, per-sequence v_θ with cu_seqlens
    versions = torch.tensor([3, 1, -1, 0, 3, 1], device=device)
    cu = torch.tensor([0, 2, 6], device=device)
    old, new = torch.full((6,), -2.0, device=device), torch.full((6,), -1.0, device=device)
    packed = compute_prox_logp_approximations(old, new, versions, cv, cu_seqlens=cu)["loglinear"]
    _close(packed, expected[0] + expected[1], torch.float32)

    # packed, per-token v_θ [N]
    per_token = torch.tensor([5, 5, 2, 2, 2, 2], device=device)
    _close(compute_prox_logp_approximations(old, new, versions, per_token)["loglinear"], packed.tolist())

    # padded [B, T]: row 0 padded with version −1 and garbage log-probs (NaN/inf) that stay in their slots
    versions_p = torch.tensor([[3, 1, -1, -1], [-1, 0, 3, 1]], device=device)
    old_p = torch.tensor([[-2.0, -2.0, NAN, -INF], [-2.0] * 4], device=device)
    new_p = torch.tensor([[-1.0, -1.0, INF, NAN], [-1.0] * 4], device=device)
    padded = compute_prox_logp_approximations(old_p, new_p, versions_p, cv)
    _close(padded["loglinear"][0, :2], expected[0], torch.float32)
    _close(padded["loglinear"][1], expected[1], torch.float32)
    _close(padded["rollout"][1], [-2.0] * 4, torch.float32)
    assert padded["loglinear"].shape == (2, 4)


def test_dtype_promotion_and_half_precision(device: str) -> None:
    versions = torch.tensor([3], device=device)
    # float16 inputs compute (and return) in float32; −2 + ½ = −1.5 is exact in every dtype
    out16 = compute_prox_logp_approximations(
        _t([-2.0], device, torch.float16), _t([-1.0], device, torch.float16), versions, 5
    )
    assert all(v.dtype == torch.float32 for v in out16.values())
    _close(out16["loglinear"], [-1.5], torch.float32)
    # float32 with float64 promotes to float64
    out = compute_prox_logp_approximations(
        _t([-2.0], device, torch.float32), _t([-1.0], device, torch.float64), versions, 5
    )
    assert all(v.dtype == torch.float64 for v in out.values())


def test_outputs_are_detached(device: str) -> None:
    # AReaL passes logprobs.detach(): the proximal policy is a constant of the loss
    old = _t([-2.0, -2.0], device, torch.float64).requires_grad_()
    new = _t([-1.0, -1.0], device, torch.float64).requires_grad_()
    out = compute_prox_logp_approximations(old, new, torch.tensor([3, 1], device=device), 5)
    assert not any(v.requires_grad for v in out.values())
    errors = prox_approximation_errors(out["loglinear"], new, old, new)
    assert not any(v.requires_grad for v in errors.values())


def test_argument_validation(device: str) -> None:
    old, new = _t([-2.0, -2.0, -2.0], device), _t([-1.0, -1.0, -1.0], device)
    versions = torch.tensor([3, 1, 0], device=device)
    with pytest.raises(ValueError, match="shapes differ"):
        compute_prox_logp_approximations(old, new[:2], versions, 5)
    with pytest.raises(ValueError, match="packed"):
        compute_prox_logp_approximations(old.view(1, 1, 3), new.view(1, 1, 3), versions.view(1, 1, 3), 5)
    with pytest.raises(TypeError, match="current_version"):
        compute_prox_logp_approximations(old, new, versions, True)
    with pytest.raises(TypeError, match="current_version"):
        compute_prox_logp_approximations(old, new, versions, 5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating"):
        compute_prox_logp_approximations(versions, versions, versions, 5)
    # a per-sequence [B] v_θ on packed input needs cu_seqlens (B = 2 ≠ N = 3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        compute_prox_logp_approximations(old, new, versions, torch.tensor([5, 2], device=device))
    with pytest.raises(ValueError, match="token count"):
        compute_prox_logp_approximations(
            old, new, versions, torch.tensor([5, 2], device=device), cu_seqlens=torch.tensor([0, 1, 2])
        )
    with pytest.raises(ValueError, match="per sequence"):
        compute_prox_logp_approximations(
            old, new, versions, torch.tensor([5, 2, 1], device=device), cu_seqlens=torch.tensor([0, 1, 3])
        )
    with pytest.raises(ValueError, match="packed 1-D"):
        compute_prox_logp_approximations(
            old.view(1, 3), new.view(1, 3), versions.view(1, 3), 5, cu_seqlens=torch.tensor([0, 3])
        )
    with pytest.raises(ValueError, match="per row"):
        compute_prox_logp_approximations(
            old.view(1, 3), new.view(1, 3), versions.view(1, 3), torch.tensor([5, 2], device=device)
        )


def test_broadcast_current_version_forms(device: str) -> None:
    versions = torch.zeros(2, 3, device=device)
    # 0-d tensor → everywhere; [B] → per row; [B, T] → as is
    assert broadcast_current_version(torch.tensor(7), versions).tolist() == [[7] * 3] * 2
    assert broadcast_current_version(torch.tensor([7, 4]), versions).tolist() == [[7] * 3, [4] * 3]
    # packed with an empty sequence in the middle: lengths [1, 0, 2]
    out = broadcast_current_version(
        torch.tensor([7, 9, 4]), torch.zeros(3, device=device), cu_seqlens=torch.tensor([0, 1, 1, 3])
    )
    assert out.tolist() == [7, 4, 4]


# ----------------------------------------------------------------------------------------------------
# error metrics
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_metrics_hand_values(device: str, dtype: torch.dtype) -> None:
    # One token: ℓb = −2, ℓθ = −1, truth ℓp* = −1.4, approximation ℓp̂ = −1.5.
    #   d = ℓp* − ℓp̂ = 0.1 → abs 0.1, rel 0.1/(1.4 + 1e−8), squared 0.01
    #   behave weights: ŵ = e^(−1.5+2) = e^0.5, w* = e^(−1.4+2) = e^0.6
    #       abs = e^0.6 − e^0.5;  rel = (e^0.6 − e^0.5)/(e^0.6 + 1e−8) ≈ 1 − e^−0.1
    #   importance weights: r̂ = e^(−1+1.5) = e^0.5, r* = e^(−1+1.4) = e^0.4
    #       abs = e^0.5 − e^0.4;  rel = (e^0.5 − e^0.4)/(e^0.4 + 1e−8) ≈ e^0.1 − 1
    errors = prox_approximation_errors(
        _t([-1.5], device, dtype),
        _t([-1.4], device, dtype),
        _t([-2.0], device, dtype),
        _t([-1.0], device, dtype),
    )
    assert list(errors) == list(PROX_ERROR_KEYS)
    for v in errors.values():
        assert v.dtype == dtype and v.shape == (1,) and v.device.type == torch.device(device).type
    e = math.exp
    expected = {
        "abs_error": 0.1,
        "rel_error": 0.1 / (1.4 + 1e-8),
        "squared_error": 0.01,
        "behave_imp_weight_abs_error": e(0.6) - e(0.5),
        "behave_imp_weight_rel_error": (e(0.6) - e(0.5)) / (e(0.6) + 1e-8),
        "importance_weight_abs_error": e(0.5) - e(0.4),
        "importance_weight_rel_error": (e(0.5) - e(0.4)) / (e(0.4) + 1e-8),
    }
    # float32: the difference of two nearby float32 values loses ~1e−6 relative
    rtol = 2e-5 if dtype == torch.float32 else 1e-9
    for key, value in expected.items():
        _close(errors[key], [value], dtype, rtol=rtol)
    assert abs(expected["behave_imp_weight_rel_error"] - (1 - e(-0.1))) < 1e-7  # the closed forms above
    assert abs(expected["importance_weight_rel_error"] - (e(0.1) - 1)) < 1e-7


def test_rel_error_epsilon_is_1e_minus_8_and_a_fraction(device: str) -> None:
    # truth ℓp* = 0 (probability 1), ℓp̂ = −0.5: rel = 0.5/(0 + 1e−8) = 5e7 — a fraction, not a percentage
    # truth −2, ℓp̂ = −1: rel = 1/(2 + 1e−8) ≈ 0.5 (AReaL docs would say "50%", the code logs 0.5)
    errors = prox_approximation_errors(
        _t([-0.5, -1.0], device, torch.float64),
        _t([0.0, -2.0], device, torch.float64),
        _t([0.0, 0.0], device, torch.float64),
        _t([0.0, 0.0], device, torch.float64),
    )
    _close(errors["rel_error"], [5e7, 1.0 / (2.0 + 1e-8)])


def test_exact_approximation_has_zero_error(device: str) -> None:
    # ℓp̂ = ℓp* → d = 0 → every metric 0 (weights identical, so their differences are 0 too)
    x = _t([-0.3, -2.0, -7.0], device)
    errors = prox_approximation_errors(x, x.clone(), x - 0.5, x + 0.25)
    for v in errors.values():
        assert v.tolist() == [0.0, 0.0, 0.0]


def test_importance_weights_hand_values(device: str) -> None:
    # ℓp = −1.5, ℓb = −2, ℓθ = −1: behave = e^0.5, importance = e^0.5; masked position → 0 despite NaN
    w = prox_importance_weights(
        _t([-1.5, NAN], device, torch.float64),
        _t([-2.0, NAN], device, torch.float64),
        _t([-1.0, INF], device, torch.float64),
        torch.tensor([True, False], device=device),
    )
    _close(w["behave_imp_weight"], [math.exp(0.5), 0.0])
    _close(w["importance_weight"], [math.exp(0.5), 0.0])


def test_masked_garbage_does_not_leak(device: str) -> None:
    # Positions 1 and 3 are masked and hold NaN/±inf in every input; the valid positions are
    #   pos 0: ℓp̂ = −1.5, ℓp* = −1.4 → abs 0.1, squared 0.01
    #   pos 2: ℓp̂ = −1.0, ℓp* = −1.3 → abs 0.3, squared 0.09
    # (ℓb = −2, ℓθ = −1 at both) → abs mean (0.1 + 0.3)/2 = 0.2, max 0.3,
    #   squared mean (0.01 + 0.09)/2 = 0.05, rmse √0.05
    #   behave weight abs: |e^0.6 − e^0.5| and |e^0.7 − e^1.0| → mean of the two
    mask = torch.tensor([True, False, True, False], device=device)
    approx = _t([-1.5, NAN, -1.0, INF], device)
    truth = _t([-1.4, -INF, -1.3, NAN], device)
    old = _t([-2.0, NAN, -2.0, -INF], device)
    new = _t([-1.0, INF, -1.0, NAN], device)
    errors = prox_approximation_errors(approx, truth, old, new, mask)
    for v in errors.values():
        assert torch.isfinite(v).all()
        assert v[1].item() == 0.0 and v[3].item() == 0.0
    summary = reduce_prox_errors(errors, mask)
    assert all(math.isfinite(v) for v in summary.values())
    e = math.exp
    assert summary["abs_error_mean"] == pytest.approx(0.2, rel=1e-6)
    assert summary["abs_error_max"] == pytest.approx(0.3, rel=1e-6)
    assert summary["squared_error_mean"] == pytest.approx(0.05, rel=1e-5)
    assert summary["rmse"] == pytest.approx(math.sqrt(0.05), rel=1e-5)
    assert summary["behave_imp_weight_abs_error_mean"] == pytest.approx(
        ((e(0.6) - e(0.5)) + (e(1.0) - e(0.7))) / 2, rel=1e-5
    )
    # NaN at masked positions of the per-token tensors themselves is also ignored by the reducer
    dirty = {"abs_error": _t([0.1, NAN, 0.3, INF], device)}
    assert reduce_prox_errors(dirty, mask) == pytest.approx({"abs_error_mean": 0.2, "abs_error_max": 0.3})


def test_reduce_hand_values_padded_and_empty(device: str) -> None:
    # padded [2, 3], valid: 0.5, 0.25 (row 0) and 1.0 (row 1) → mean 1.75/3, max 1.0
    values = _t([[0.5, 0.25, 7.0], [1.0, 9.0, 9.0]], device, torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], device=device)  # a 0/1 integer mask means mask != 0
    out = reduce_prox_errors({"abs_error": values, "squared_error": values}, mask)
    assert out["abs_error_mean"] == pytest.approx(1.75 / 3, rel=1e-12)
    assert out["abs_error_max"] == 1.0
    assert out["rmse"] == pytest.approx(math.sqrt(1.75 / 3), rel=1e-12)
    assert set(out) == {"abs_error_mean", "abs_error_max", "squared_error_mean", "squared_error_max", "rmse"}
    # no valid token: figures are absent, never 0
    assert reduce_prox_errors({"abs_error": values}, torch.zeros(2, 3, dtype=torch.bool, device=device)) == {}
    assert reduce_prox_errors({}, None) == {}
    with pytest.raises(ValueError, match="shape"):
        reduce_prox_errors({"abs_error": values[:, :2]}, mask)


def test_errors_validation(device: str) -> None:
    x = _t([-1.0, -2.0], device)
    with pytest.raises(ValueError, match="shapes differ"):
        prox_approximation_errors(x, x[:1], x, x)
    with pytest.raises(ValueError, match="mask shape"):
        prox_approximation_errors(x, x, x, x, torch.tensor([True], device=device))
    with pytest.raises(TypeError, match="Tensor"):
        prox_approximation_errors([-1.0, -2.0], x, x, x)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# independent float64 reference (plain Python, AReaL's formulas written out)
# ----------------------------------------------------------------------------------------------------


def _reference(old: list[float], new: list[float], versions: list[int], cvs: list[int], truth: list[float]):
    approx: dict[str, list[float]] = {m: [] for m in PROX_APPROX_METHODS}
    errors: dict[str, dict[str, list[float]]] = {m: {k: [] for k in PROX_ERROR_KEYS} for m in PROX_APPROX_METHODS}
    for lb, lt, vb, cv, gt in zip(old, new, versions, cvs, truth, strict=True):
        a = (cv - 1 - vb) / (cv - vb) if (cv - vb > 0 and vb >= 0) else 0.0
        a = min(max(a, 0.0), 1.0)
        values = {
            "loglinear": lb + a * (lt - lb),
            "linear": math.log((1 - a) * math.exp(lb) + a * math.exp(lt) + 1e-10),
            "rollout": lb,
        }
        for m, ap in values.items():
            approx[m].append(ap)
            wb_hat, wb = math.exp(ap - lb), math.exp(gt - lb)
            wi_hat, wi = math.exp(lt - ap), math.exp(lt - gt)
            row = {
                "abs_error": abs(gt - ap),
                "rel_error": abs(gt - ap) / (abs(gt) + 1e-8),
                "squared_error": (gt - ap) ** 2,
                "behave_imp_weight_abs_error": abs(wb - wb_hat),
                "behave_imp_weight_rel_error": abs(wb - wb_hat) / (abs(wb) + 1e-8),
                "importance_weight_abs_error": abs(wi - wi_hat),
                "importance_weight_rel_error": abs(wi - wi_hat) / (abs(wi) + 1e-8),
            }
            for k, v in row.items():
                errors[m][k].append(v)
    return approx, errors


def test_against_plain_python_reference(device: str) -> None:
    rng = random.Random(1234)
    lengths = [5, 1, 7, 3]
    seq_cv = [6, 1, 9, 3]
    old, new, truth, versions, cvs = [], [], [], [], []
    for n, cv in zip(lengths, seq_cv, strict=True):
        for i in range(n):
            lb = -rng.uniform(0.01, 6.0)
            lt = lb + rng.uniform(-1.0, 1.0)
            old.append(lb)
            new.append(lt)
            truth.append(lb + rng.uniform(0.0, 1.0) * (lt - lb) + rng.uniform(-0.05, 0.05))
            versions.append(-1 if i == 0 else rng.randint(max(cv - 6, 0), cv + 1))  # first token: prompt
            cvs.append(cv)
    ref_approx, ref_errors = _reference(old, new, versions, cvs, truth)

    f64 = dict(dtype=torch.float64, device=device)
    cu = torch.tensor([0, 5, 6, 13, 16], device=device)
    out = compute_prox_logp_approximations(
        torch.tensor(old, **f64),
        torch.tensor(new, **f64),
        torch.tensor(versions, device=device),
        torch.tensor(seq_cv, device=device),
        cu_seqlens=cu,
    )
    for m in PROX_APPROX_METHODS:
        _close(out[m], ref_approx[m])
        errors = prox_approximation_errors(
            out[m], torch.tensor(truth, **f64), torch.tensor(old, **f64), torch.tensor(new, **f64)
        )
        for k in PROX_ERROR_KEYS:
            _close(errors[k], ref_errors[m][k], rtol=1e-9)
        summary = reduce_prox_errors(errors)
        assert summary["abs_error_mean"] == pytest.approx(math.fsum(ref_errors[m]["abs_error"]) / 16, rel=1e-12)
        assert summary["abs_error_max"] == pytest.approx(max(ref_errors[m]["abs_error"]), rel=1e-12)


def test_float32_bit_identical_to_areal_transcription(device: str) -> None:
    # AReaL's float32 code path written out literally (actor.py compute_prox_logp_approximations and
    # _compute_approximation_errors): for finite inputs the torch.where guards change no bit.
    gen = torch.Generator().manual_seed(7)
    old = (-6 * torch.rand(64, generator=gen)).to(device)
    new = (old + torch.empty(64).uniform_(-1, 1, generator=gen).to(device)).clamp(max=0)
    truth = (old + 0.5 * (new - old) + 0.01).clamp(max=0)
    versions = torch.randint(-1, 9, (64,), generator=gen).to(device)
    cv = 8
    v_behave = versions.float()
    version_diff = float(cv) - v_behave
    alpha = torch.where(
        (version_diff > 0) & (versions >= 0), ((cv - 1) - v_behave) / version_diff, torch.zeros_like(v_behave)
    ).clamp(0.0, 1.0)
    areal = {
        "loglinear": old + alpha * (new - old),
        "linear": torch.log((1 - alpha) * torch.exp(old) + alpha * torch.exp(new) + 1e-10),
        "rollout": old.clone(),
    }
    ours = compute_prox_logp_approximations(old, new, versions, cv)
    for m in PROX_APPROX_METHODS:
        assert torch.equal(ours[m], areal[m]), m
        diff = truth - areal[m]
        errors = prox_approximation_errors(ours[m], truth, old, new)
        assert torch.equal(errors["abs_error"], torch.abs(diff))
        assert torch.equal(errors["rel_error"], torch.abs(diff / (torch.abs(truth) + 1e-8)))
        assert torch.equal(errors["squared_error"], diff * diff)
        wb_gt, wb = torch.exp(truth - old), torch.exp(areal[m] - old)
        assert torch.equal(errors["behave_imp_weight_rel_error"], torch.abs((wb_gt - wb) / (wb_gt.abs() + 1e-8)))
        wi_gt, wi = torch.exp(new - truth), torch.exp(new - areal[m])
        assert torch.equal(errors["importance_weight_abs_error"], torch.abs(wi_gt - wi))
