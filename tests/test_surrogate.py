"""Tests for ``clipped_grpo_surrogate`` (the clipped surrogate): examples, hand-derived values and gradients."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_cli.core import clipped_grpo_surrogate

LN = math.log


def _reference(new, old, adv, mask, eps):
    """Independent float64 loop version of the clipped surrogate (plain Python math)."""
    b, t = len(new), len(new[0])
    sel, total, clipped, per_seq = 0, 0.0, 0, []
    for i in range(b):
        row_sum, row_n = 0.0, 0
        for j in range(t):
            if not mask[i][j]:
                continue
            a = adv[i] if not isinstance(adv[i], list) else adv[i][j]
            r = math.exp(min(max(new[i][j] - old[i][j], -60.0), 60.0))
            s = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            row_sum += s
            row_n += 1
            clipped += (r < 1 - eps) or (r > 1 + eps)
        per_seq.append(row_sum / row_n if row_n else 0.0)
        total += row_sum
        sel += row_n
    return (-total / sel if sel else 0.0), per_seq, (clipped / sel if sel else 0.0)


# --- three documented examples (lists → float32) -------------------------------------------------------


def test_seed_example_1():
    out = clipped_grpo_surrogate(
        [[0.4054651081081644, -0.6931471805599453], [0, 0]],
        [[0, 0], [0, 0]],
        [2, -1],
        [[True, True], [True, False]],
        0.2,
    )
    # r = 1.5, 0.5 (A=2) and 1 (A=-1): s = min(3, 2.4) = 2.4, min(1, 1.6) = 1, -1 → means 1.7, -1;
    # loss = -(2.4 + 1 - 1)/3 = -0.8; clipped 2 of 3.
    assert out["loss"].dtype == torch.float32
    assert out["loss"].item() == pytest.approx(-0.8, abs=1e-6)
    assert out["per_sequence_surrogate"].tolist() == pytest.approx([1.7, -1.0], abs=1e-6)
    assert out["clipped_fraction"].item() == pytest.approx(0.666667, abs=1e-6)


def test_seed_example_2_bounds_in_input_dtype():
    out = clipped_grpo_surrogate([[0.1823215567939546, -0.2231435513142097]], [[0, 0]], [1], [[True, True]], 0.2)
    # float32: exp(f32(ln 1.2)) == f32(1.2) and exp(f32(ln 0.8)) == f32(0.8): on the bounds, not outside.
    assert out["loss"].item() == pytest.approx(-1.0, abs=1e-6)
    assert out["per_sequence_surrogate"].tolist() == pytest.approx([1.0], abs=1e-6)
    assert out["clipped_fraction"].item() == 0.0


def test_seed_example_3_empty_mask():
    out = clipped_grpo_surrogate([[2, -2]], [[0, 0]], [3], [[False, False]], 0.2)
    assert out["loss"].item() == 0.0 and not math.copysign(1, out["loss"].item()) < 0
    assert out["per_sequence_surrogate"].tolist() == [0.0]
    assert out["clipped_fraction"].item() == 0.0
    assert out["loss"].dtype == torch.float32  # int lists read as the default float dtype


# --- hand-derived values in several dtypes ------------------------------------------------------------


def test_float64_values_and_gradient(device):
    new = torch.tensor([[LN(1.5), LN(1.1), LN(0.7)]], dtype=torch.float64, device=device, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64, device=device)
    out = clipped_grpo_surrogate(new, old, torch.tensor([[-2.0]], device=device), torch.ones(1, 3, device=device), 0.2)
    # A = -2: s = min(-3, -2.4) = -3 (unclipped branch), min(-2.2, -2.2) = -2.2, min(-1.4, -1.6) = -1.6
    # per_seq = -6.8/3, loss = 6.8/3, clipped: 1.5 > 1.2 and 0.7 < 0.8 → 2/3.
    assert out["loss"].dtype == torch.float64 and out["loss"].device.type == torch.device(device).type
    assert out["loss"].item() == pytest.approx(6.8 / 3, rel=1e-12)
    assert out["per_sequence_surrogate"].tolist() == pytest.approx([-6.8 / 3], rel=1e-12)
    assert out["clipped_fraction"].item() == pytest.approx(2 / 3, rel=1e-12)
    out["loss"].backward()
    # d(-s/N)/dℓ = -r·A/N on unclipped branches (r·A = -3, -2.2), 0 on the clipped one.
    assert new.grad.tolist()[0] == pytest.approx([1.0, 2.2 / 3, 0.0], rel=1e-12)


def test_float64_just_outside_bound_is_clipped():
    # In float64 a ratio of 1.2·(1 + 1e-12) is strictly outside [0.8, 1.2]: fraction 1.
    out = clipped_grpo_surrogate(torch.tensor([[LN(1.2) + 1e-12]], dtype=torch.float64), [[0.0]], [1.0], [[1]], 0.2)
    assert out["clipped_fraction"].item() == 1.0
    assert out["loss"].item() == pytest.approx(-1.2, rel=1e-12)  # min(1.2·(1+1e-12), 1.2)


def test_float32_values_and_gradient(device):
    new = torch.tensor([[LN(2.0), LN(0.9)], [LN(0.5), 0.0]], dtype=torch.float32, device=device, requires_grad=True)
    old = torch.zeros(2, 2, device=device)
    adv = torch.tensor([1.0, -1.0], device=device)
    mask = torch.tensor([[1, 1], [1, 0]], device=device)
    out = clipped_grpo_surrogate(new, old, adv, mask, 0.25)
    # row 0, A = 1: r = 2 → min(2, 1.25) = 1.25 (clipped branch); r = 0.9 → 0.9. mean 1.075
    # row 1, A = -1: r = 0.5 → min(-0.5, -0.75) = -0.75 (clipped branch). mean -0.75
    # loss = -(1.25 + 0.9 - 0.75)/3 = -1.4/3; clipped: r = 2 (> 1.25) and r = 0.5 (< 0.75) → 2/3
    assert out["loss"].dtype == torch.float32
    assert out["loss"].item() == pytest.approx(-1.4 / 3, rel=1e-6)
    assert out["per_sequence_surrogate"].tolist() == pytest.approx([1.075, -0.75], rel=1e-6)
    assert out["clipped_fraction"].item() == pytest.approx(2 / 3, rel=1e-6)
    out["loss"].backward()
    # only r = 0.9 is on the unclipped branch: d(-r·A/3)/dℓ = -0.9/3
    assert new.grad.cpu().reshape(-1).tolist() == pytest.approx([0.0, -0.3, 0.0, 0.0], abs=1e-6)


def test_bfloat16_hand_rounded(device):
    new = torch.tensor([[0.1823215567939546, -0.2231435513142097]], dtype=torch.bfloat16, device=device)
    out = clipped_grpo_surrogate(new, [[0, 0]], [1], [[True, True]], 0.2)
    # bf16 (8 significant bits): ℓ → 0.1826171875 and -0.22265625; exp → 1.2004 and 0.8004, which round to
    # 1.203125 and 0.80078125 — exactly bf16(1.2) and bf16(0.8): on the bounds, so nothing is clipped.
    # per-sequence mean (1.203125 + 0.80078125)/2 = 1.001953125 → bf16 1.0.
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    assert out["clipped_fraction"].item() == 0.0
    assert out["per_sequence_surrogate"].tolist() == [1.0]
    assert out["loss"].item() == -1.0


def test_float16_goes_through_float32():
    new = torch.tensor([[0.1823215567939546, -0.2231435513142097]], dtype=torch.float16)
    out = clipped_grpo_surrogate(new, [[0, 0]], [1], [[True, True]], 0.2)
    # fp16 rounds ℓ to 0.182373 and -0.223145 (grid 2^-13); in float32 exp gives 1.20006 > f32(1.2) and
    # 0.7999992 < f32(0.8): both strictly outside → fraction 1; s = 1.2 and 0.7999992 → mean ≈ 1.0.
    assert out["loss"].dtype == torch.float16
    assert out["clipped_fraction"].item() == 1.0
    assert out["loss"].item() == pytest.approx(-1.0, abs=1e-3)


# --- broadcasting, bound, nested lists, mask forms ------------------------------------------------------


def test_advantage_shapes_broadcast_identically(device):
    g = torch.Generator().manual_seed(0)
    new = (torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3).to(device)
    old = torch.zeros(3, 4, dtype=torch.float64, device=device)
    mask = torch.rand(3, 4, generator=g).to(device) > 0.3
    a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, device=device)
    r1 = clipped_grpo_surrogate(new, old, a, mask, 0.2)
    r2 = clipped_grpo_surrogate(new, old, a[:, None], mask, 0.2)
    r3 = clipped_grpo_surrogate(new, old, a[:, None].expand(3, 4), mask, 0.2)
    for k in r1:
        assert torch.equal(r1[k], r2[k]) and torch.equal(r1[k], r3[k])


def test_log_ratio_bound_60():
    new = torch.tensor([[100.0, -100.0]], requires_grad=True)
    out = clipped_grpo_surrogate(new, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2)
    # r = exp(60) (A = -1: min(-e^60, -1.2) = -e^60) and r = exp(-60) (A = 1: min(e^-60, 0.8) = e^-60).
    # Without the bound exp(100) would overflow float32 to inf.
    expected = -(-math.exp(60) + math.exp(-60)) / 2
    assert math.isfinite(out["loss"].item())
    assert out["loss"].item() == pytest.approx(expected, rel=1e-6)
    assert out["clipped_fraction"].item() == 1.0
    out["loss"].backward()
    assert new.grad.tolist() == [[0.0, 0.0]]  # the clamp is flat beyond ±60


def test_nested_lists_with_ints_and_float_mask():
    out = clipped_grpo_surrogate([[0, 1]], [[0, 0]], [[1, 1]], [[1.0, 0.0]], 0.5)
    # only token 0: r = 1, A = 1 → s = 1
    assert out["loss"].item() == -1.0 and out["per_sequence_surrogate"].tolist() == [1.0]


def test_row_without_selected_tokens_has_mean_zero():
    out = clipped_grpo_surrogate([[0.0, 0.0], [5.0, 5.0]], [[0.0, 0.0]] * 2, [2.0, 7.0], [[1, 1], [0, 0]], 0.2)
    assert out["per_sequence_surrogate"].tolist() == [2.0, 0.0]
    assert out["loss"].item() == -2.0


def test_empty_batch():
    out = clipped_grpo_surrogate(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3), 0.2)
    assert out["loss"].item() == 0.0 and out["clipped_fraction"].item() == 0.0
    assert out["per_sequence_surrogate"].shape == (0,)


def test_masked_garbage_never_leaks(device):
    new = torch.tensor([[0.1, float("nan"), float("inf")]], device=device, requires_grad=True)
    old = torch.tensor([[0.0, float("-inf"), float("nan")]], device=device)
    adv = torch.tensor([[1.0, float("nan"), float("inf")]], device=device)
    out = clipped_grpo_surrogate(new, old, adv, torch.tensor([[True, False, False]], device=device), 0.2)
    # r = e^0.1 = 1.10517 inside [0.8, 1.2]: s = 1.10517
    assert out["loss"].item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    out["loss"].backward()
    assert torch.isfinite(new.grad).all()
    assert new.grad.cpu().tolist()[0] == pytest.approx([-math.exp(0.1), 0.0, 0.0], rel=1e-6)


def test_matches_independent_reference_on_random_inputs():
    rnd = random.Random(3)
    for _ in range(20):
        b, t = rnd.randint(1, 4), rnd.randint(1, 6)
        new = [[rnd.gauss(0, 0.4) for _ in range(t)] for _ in range(b)]
        old = [[rnd.gauss(0, 0.4) for _ in range(t)] for _ in range(b)]
        mask = [[rnd.random() < 0.7 for _ in range(t)] for _ in range(b)]
        per_token = rnd.random() < 0.5
        adv = (
            [[rnd.gauss(0, 1) for _ in range(t)] for _ in range(b)]
            if per_token
            else [rnd.gauss(0, 1) for _ in range(b)]
        )
        eps = rnd.choice([0.1, 0.2, 0.3])
        out = clipped_grpo_surrogate(
            torch.tensor(new, dtype=torch.float64), torch.tensor(old, dtype=torch.float64), adv, mask, eps
        )
        loss, per_seq, frac = _reference(new, old, adv, mask, eps)
        assert out["loss"].item() == pytest.approx(loss, rel=1e-12, abs=1e-15)
        assert out["per_sequence_surrogate"].tolist() == pytest.approx(per_seq, rel=1e-12, abs=1e-15)
        assert out["clipped_fraction"].item() == pytest.approx(frac, rel=1e-12, abs=1e-15)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    new = (torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    old = torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.3, -0.7], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.autograd.gradcheck(lambda x: clipped_grpo_surrogate(x, old, adv, mask, 0.2)["loss"], (new,))


# --- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"clip_epsilon": -0.1}, ValueError),
        ({"clip_epsilon": float("nan")}, ValueError),
        ({"clip_epsilon": "0.2"}, TypeError),
        ({"token_mask": [[2, 0]]}, ValueError),
        ({"token_mask": [[1, 0, 1]]}, ValueError),
        ({"old_log_probs": [[0.0]]}, ValueError),
        ({"advantages": [1.0, 2.0]}, ValueError),
        ({"advantages": [[1.0, 2.0, 3.0]]}, ValueError),
        ({"new_log_probs": [0.0, 0.0], "old_log_probs": [0.0, 0.0], "token_mask": [1, 1]}, ValueError),
        ({"new_log_probs": [[0.0], [0.0, 1.0]]}, ValueError),
    ],
)
def test_bad_arguments(kwargs, exc):
    args = {
        "new_log_probs": [[0.0, 0.0]],
        "old_log_probs": [[0.0, 0.0]],
        "advantages": [1.0],
        "token_mask": [[1, 1]],
        "clip_epsilon": 0.2,
    }
    args.update(kwargs)
    with pytest.raises(exc):
        clipped_grpo_surrogate(**args)
