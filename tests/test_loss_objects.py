"""Tests for grpo_cli.core.loss_objects (the GRPO-family loss objects) and the packed core grpo_family_loss_terms."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_cli.core import grpo_family_loss_terms
from grpo_cli.core.loss_objects import BNPOLoss, CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, SAPOLoss

LN = math.log
F64 = torch.float64
X = 123.0  # value at padded positions: must never matter


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def batch(device="cpu", dtype=F64):
    """B = 2 rows, T = 3: row 0 has 2 valid tokens, row 1 has 1; advantages [1, -1]; old log-probs 0."""
    labels = torch.tensor([[5, 6, -100], [7, -100, -100]], device=device)
    logps = torch.tensor([[LN(1.5), LN(1.1), X], [LN(0.5), X, X]], dtype=dtype, device=device, requires_grad=True)
    old = torch.zeros(2, 3, dtype=dtype, device=device)
    return {"labels": labels}, {"logps": logps}, old


def grad_of(outputs):
    g = outputs["logps"].grad.detach().cpu()
    return [g[0, 0].item(), g[0, 1].item(), g[1, 0].item(), g[0, 2].item(), g[1, 1].item()]


# --- hand-derived values and gradients, one class at a time ---------------------------------------------
# Token ratios: r = 1.5 and 1.1 (A = 1), r = 0.5 (A = -1); ε = 0.2.


def test_grpo_value_and_gradient(device):
    inputs, outputs, old = batch(device)
    loss = GRPOLoss(clip_range=0.2)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # seq 0: -min(1.5, 1.2) = -1.2, -min(1.1, 1.1) = -1.1 → mean -1.15; seq 1: -min(-0.5, -0.8) = 0.8
    # loss = (-1.15 + 0.8)/2 = -0.175
    assert loss.item() == pytest.approx(-0.175, rel=1e-12)
    assert loss.dtype == F64 and loss.device.type == torch.device(device).type
    loss.backward()
    # only r = 1.1 is unclipped: d(-rA)/dℓ / n_0 / S = -1.1/2/2; padded positions get 0
    assert grad_of(outputs) == pytest.approx([0.0, -0.275, 0.0, 0.0, 0.0], abs=1e-12)


def test_bnpo_value_and_gradient():
    inputs, outputs, old = batch()
    loss = BNPOLoss()(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # token mean: (-1.2 - 1.1 + 0.8)/3 = -0.5
    assert loss.item() == pytest.approx(-0.5, rel=1e-12)
    loss.backward()
    assert grad_of(outputs)[:3] == pytest.approx([0.0, -1.1 / 3, 0.0], abs=1e-12)


def test_dr_grpo_value_and_gradient():
    inputs, outputs, old = batch()
    loss = DRGRPOLoss(max_completion_length=4)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # Σ / (B · max_completion_length) = -1.5 / 8
    assert loss.item() == pytest.approx(-1.5 / 8, rel=1e-12)
    loss.backward()
    assert grad_of(outputs)[:3] == pytest.approx([0.0, -1.1 / 8, 0.0], abs=1e-12)
    assert DRGRPOLoss().max_completion_length == 1024


def test_cispo_value_and_gradient():
    inputs, outputs, old = batch()
    loss = CISPOLoss(clip_range=0.2)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # L = -sg(min(r, 1.2))·A·ℓ: -1.2·ln1.5, -1.1·ln1.1, -0.5·(-1)·ln0.5; token mean over 3
    expected = (-1.2 * LN(1.5) - 1.1 * LN(1.1) + 0.5 * LN(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # gradient -sg(min(r, 1.2))·A / N: no gradient through the ratio
    assert grad_of(outputs)[:3] == pytest.approx([-1.2 / 3, -1.1 / 3, 0.5 / 3], rel=1e-12)


def test_cispo_caps_with_clip_range_high():
    inputs, outputs, old = batch()
    loss = CISPOLoss(clip_range=0.2, clip_range_high=0.4)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # the cap is 1 + 0.4 = 1.4 (TRL/issue convention; twinkle uses 1 + epsilon): r = 1.5 → 1.4
    expected = (-1.4 * LN(1.5) - 1.1 * LN(1.1) + 0.5 * LN(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_gspo_value_and_gradient():
    inputs, outputs, old = batch()
    loss = GSPOLoss(clip_range=0.3)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # seq 0: s = exp((ln1.5 + ln1.1)/2) = √1.65 = 1.2845 < 1.3 → L = -s on both tokens → mean -s
    # seq 1: s = 0.5 < 0.7 with A = -1 → -min(-0.5, -0.7) = 0.7 (clipped). loss = (-s + 0.7)/2
    s = math.sqrt(1.65)
    assert loss.item() == pytest.approx((-s + 0.7) / 2, rel=1e-12)
    loss.backward()
    # ∂s/∂ℓ_j = s/2 for both tokens of seq 0 → -s/2 / S = -s/4; seq 1 clipped → 0
    assert grad_of(outputs)[:3] == pytest.approx([-s / 4, -s / 4, 0.0], rel=1e-12, abs=1e-15)


def test_sapo_value_and_gradient():
    inputs, outputs, old = batch()
    loss = SAPOLoss(tau=1.0)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    # gate σ(τ(r-1))·4/τ, τ = 1: L = -gate·A
    l00, l01, l10 = -sigmoid(0.5) * 4, -sigmoid(0.1) * 4, sigmoid(-0.5) * 4
    assert loss.item() == pytest.approx(((l00 + l01) / 2 + l10) / 2, rel=1e-12)
    loss.backward()
    # dL/dℓ = -4σ(1-σ)·r·A, then / n_s / S
    d = [
        -4 * sigmoid(0.5) * (1 - sigmoid(0.5)) * 1.5 / 4,
        -4 * sigmoid(0.1) * (1 - sigmoid(0.1)) * 1.1 / 4,
        4 * sigmoid(-0.5) * (1 - sigmoid(-0.5)) * 0.5 / 2,
    ]
    assert grad_of(outputs)[:3] == pytest.approx(d, rel=1e-12)


def test_sapo_tau_pos_neg():
    inputs, outputs, old = batch()
    loss = SAPOLoss(tau_pos=2.0, tau_neg=0.5)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
    l00, l01 = -sigmoid(2 * 0.5) * 4 / 2, -sigmoid(2 * 0.1) * 4 / 2
    l10 = sigmoid(0.5 * -0.5) * 4 / 0.5
    assert loss.item() == pytest.approx(((l00 + l01) / 2 + l10) / 2, rel=1e-12)


def test_kl_penalty_k3_only_with_beta_and_ref():
    inputs, outputs, old = batch()
    ref = torch.zeros(2, 3, dtype=F64)
    base = GRPOLoss()(inputs, outputs, old_logps=old, advantages=[1.0, -1.0]).item()
    # k3 = exp(ref-ℓ) - (ref-ℓ) - 1 with ref = 0: ℓ = ln1.5 → 2/3 + ln1.5 - 1; ℓ = ln1.1 → 1/1.1 + ln1.1 - 1;
    # ℓ = ln0.5 → 2 + ln0.5 - 1. Added per token (β = 0.1) before the per-sequence mean.
    k = [2 / 3 + LN(1.5) - 1, 1 / 1.1 + LN(1.1) - 1, 2 + LN(0.5) - 1]
    with_kl = GRPOLoss(beta=0.1)(inputs, outputs, old_logps=old, ref_logps=ref, advantages=[1.0, -1.0])
    assert with_kl.item() == pytest.approx(base + 0.1 * ((k[0] + k[1]) / 2 + k[2]) / 2, rel=1e-12)
    # β > 0 without ref_logps, or ref_logps with β = 0: no penalty
    assert GRPOLoss(beta=0.1)(inputs, outputs, old_logps=old, advantages=[1.0, -1.0]).item() == base
    assert GRPOLoss()(inputs, outputs, old_logps=old, ref_logps=ref, advantages=[1.0, -1.0]).item() == base
    with_kl.backward()
    # d(β·k3)/dℓ = β(1 - exp(ref - ℓ)); token (0,0) is clipped in the PPO part so only the KL gradient is left:
    # 0.1·(1 - 2/3) / 2 / 2
    assert outputs["logps"].grad[0, 0].item() == pytest.approx(0.1 * (1 / 3) / 4, rel=1e-12)


def test_old_logps_none_means_ratio_one_with_gradient():
    inputs, outputs, _ = batch()
    loss = GRPOLoss()(inputs, outputs, advantages=[1.0, -1.0])
    # r = 1 everywhere: seq 0 → -1, seq 1 → +1 → 0; gradient -A / n_s / S
    assert loss.item() == 0.0
    loss.backward()
    assert grad_of(outputs)[:3] == pytest.approx([-0.25, -0.25, 0.5], rel=1e-12)


def test_no_advantages_returns_attached_zero():
    inputs, outputs, old = batch()
    loss = GRPOLoss()(inputs, outputs, old_logps=old)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert outputs["logps"].grad.abs().sum().item() == 0.0


def test_log_ratio_clamped_to_20():
    labels = torch.tensor([[1]])
    logps = torch.tensor([[0.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-50.0]], dtype=F64)
    # log-ratio 50 → clamped to 20; A = -1: -min(-e^20, -1.2) = e^20 (twinkle; without the clamp e^50)
    loss = GRPOLoss()({"labels": labels}, {"logps": logps}, old_logps=old, advantages=[-1.0])
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-12)
    loss.backward()
    assert logps.grad.item() == 0.0


@pytest.mark.parametrize(("convention", "bound"), [(None, 20.0), ("twinkle", 20.0), ("trl", None)])
def test_log_ratio_clamp_by_convention(convention, bound):
    # log-ratio 25, A = -1: -min(-e^25, -1.2) = e^25 unclamped (TRL 1.16 _compute_loss), e^20 clamped (twinkle).
    # Gradient: d/dℓ of e^(ℓ − ℓ_old) is e^25 unclamped, 0 beyond the clamp.
    logps = torch.tensor([[0.0]], dtype=F64, requires_grad=True)
    old, adv, mask = torch.tensor([[-25.0]], dtype=F64), torch.tensor([[-1.0]], dtype=F64), torch.ones(1, 1)
    num, den = grpo_family_loss_terms("grpo", logps, old, None, adv, mask, None, convention=convention)
    expected = math.exp(25.0 if bound is None else bound)
    assert (num / den).item() == pytest.approx(expected, rel=1e-12)
    (num / den).backward()
    assert logps.grad.item() == pytest.approx(math.exp(25.0) if bound is None else 0.0, rel=1e-12)


# --- packing, alignment, ignore_index --------------------------------------------------------------------


def test_packed_row_split_at_position_zero_including_final_single_token():
    # one packed row: seq 0 = tokens 0-1, seq 1 = token 2 (position_ids [0, 1, 0]) — twinkle's detector
    # would miss this pack; we split and get the same value as the unpacked batch (-0.175).
    logps = torch.tensor([[LN(1.5), LN(1.1), LN(0.5)]], dtype=F64, requires_grad=True)
    inputs = {"labels": torch.tensor([[5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 0]])}
    for cls, expected in ((GRPOLoss, -0.175), (BNPOLoss, -0.5), (DRGRPOLoss, -1.5 / 2048)):
        loss = cls()(inputs, {"logps": logps}, old_logps=torch.zeros(1, 3, dtype=F64), advantages=[1.0, -1.0])
        assert loss.item() == pytest.approx(expected, rel=1e-12)
    # 1-D inputs get a batch dimension
    loss = GRPOLoss()(
        {"labels": [5, 6, 7], "position_ids": [0, 1, 0]},
        {"logps": logps[0]},
        old_logps=[0.0, 0.0, 0.0],
        advantages=[1.0, -1.0],
    )
    assert loss.item() == pytest.approx(-0.175, rel=1e-12)


def test_packed_padding_segments_count_as_sequences():
    # trailing pad with position_id 0 forms a third, all-masked segment: it counts in S (documented)
    logps = torch.tensor([[LN(1.5), LN(1.1), LN(0.5), 0.0]], dtype=F64)
    inputs = {"labels": torch.tensor([[5, 6, 7, -100]]), "position_ids": torch.tensor([[0, 1, 0, 0]])}
    loss = GRPOLoss()(
        inputs,
        {"logps": logps},
        old_logps=torch.zeros(1, 4, dtype=F64),
        advantages=torch.tensor([[1.0, 1.0, -1.0, 0.0]]),
    )
    assert loss.item() == pytest.approx((-1.15 + 0.8 + 0.0) / 3, rel=1e-12)


def test_mrope_position_ids_use_first_channel():
    logps = torch.tensor([[LN(1.5), LN(1.1), LN(0.5)]], dtype=F64)
    pos = torch.tensor([[[0, 1, 0]], [[0, 0, 0]], [[5, 5, 5]]])  # [3, B, T]
    loss = GRPOLoss()(
        {"labels": torch.tensor([[5, 6, 7]]), "position_ids": pos},
        {"logps": logps},
        old_logps=torch.zeros(1, 3, dtype=F64),
        advantages=[1.0, -1.0],
    )
    assert loss.item() == pytest.approx(-0.175, rel=1e-12)


def test_old_logps_alignment_forms_agree():
    inputs, outputs, _ = batch()
    full = torch.tensor([[LN(1.5), 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    forms = [
        full,  # exactly (B, T)
        [[LN(1.5), 0.0], [0.0]],  # response-only rows, scattered onto the valid positions
        [[LN(1.5), 0.0, 9.0, 9.0], [0.0, 1.0, 2.0]],  # full-sequence rows (≥ T values, first T used)
        [torch.tensor([LN(1.5), 0.0], dtype=F64), torch.tensor([0.0], dtype=F64)],
    ]
    # r = 1 and 1.1 for seq 0 → -1, -1.1; seq 1 r = 0.5 → 0.8: (-1.05 + 0.8)/2
    for form in forms:
        loss = GRPOLoss()(inputs, outputs, old_logps=form, advantages=[1.0, -1.0])
        assert loss.item() == pytest.approx(-0.125, rel=1e-12)
    for adv in (
        [1.0, -1.0],
        torch.tensor([1.0, -1.0]),
        torch.tensor([[1.0], [-1.0]]),
        torch.tensor([[1.0, 1.0, 7.0], [-1.0, 7.0, 7.0]]),
        [[1.0], [-1.0]],
    ):
        loss = GRPOLoss()(inputs, outputs, old_logps=full, advantages=adv)
        assert loss.item() == pytest.approx(-0.125, rel=1e-12)


def test_ignore_index_and_masked_garbage():
    labels = torch.tensor([[3, -1, 4]])
    logps = torch.tensor([[0.0, float("nan"), 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, float("inf"), 0.0]])
    ref = torch.tensor([[0.0, float("-inf"), 0.0]])
    loss = GRPOLoss(beta=0.5, ignore_index=-1)(
        {"labels": labels},
        {"logps": logps},
        old_logps=old,
        ref_logps=ref,
        advantages=torch.tensor([[2.0, float("nan"), 2.0]]),
    )
    assert loss.item() == -2.0 and loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(logps.grad).all() and logps.grad[0, 1].item() == 0.0


def test_logits_path_matches_logps():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 5, generator=g, dtype=F64)  # one extra prefix position is dropped
    labels = torch.tensor([[1, -100, 4]])
    lp = torch.log_softmax(logits[:, 1:], dim=-1).gather(-1, torch.tensor([[[1], [0], [4]]])).squeeze(-1)
    a = GRPOLoss()(
        {"labels": labels}, {"logits": logits}, old_logps=torch.full((1, 3), -1.5, dtype=F64), advantages=[0.7]
    )
    b = GRPOLoss()({"labels": labels}, {"logps": lp}, old_logps=torch.full((1, 3), -1.5, dtype=F64), advantages=[0.7])
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


# --- constructor names and errors -----------------------------------------------------------------------


def test_constructor_names_and_aliases():
    assert GRPOLoss().clip_range == 0.2 and GRPOLoss().clip_range_high == 0.2 and GRPOLoss().beta == 0.0
    assert GRPOLoss(epsilon=0.3).clip_range == 0.3
    assert GRPOLoss(clip_range=0.1).clip_range_high == 0.1
    assert GRPOLoss(clip_range=0.2, epsilon_high=0.28).clip_range_high == 0.28
    assert GRPOLoss(clip_range=0.3, epsilon=0.3).clip_range == 0.3  # same value twice is fine
    s = SAPOLoss(tau=2.0)
    assert (s.tau_pos, s.tau_neg) == (2.0, 2.0)
    assert SAPOLoss(tau=2.0, tau_neg=1.05).tau_neg == 1.05
    assert GRPOLoss(epsilon_high=0.4).epsilon_high == 0.4


@pytest.mark.parametrize(
    ("factory", "exc"),
    [
        (lambda: GRPOLoss(clip_rnage=0.2), TypeError),  # misspelt: twinkle would ignore it silently
        (lambda: GRPOLoss(tau=1.0), TypeError),
        (lambda: BNPOLoss(max_completion_length=10), TypeError),
        (lambda: GRPOLoss(0.2), TypeError),  # keyword-only
        (lambda: GRPOLoss(clip_range=0.2, epsilon=0.3), TypeError),
        (lambda: GRPOLoss(clip_range_high=0.2, epsilon_high=0.3), TypeError),
        (lambda: GRPOLoss(clip_range=-0.1), ValueError),
        (lambda: GRPOLoss(beta=-1.0), ValueError),
        (lambda: SAPOLoss(tau=0.0), ValueError),
        (lambda: SAPOLoss(tau_neg=-1.0), ValueError),
        (lambda: DRGRPOLoss(max_completion_length=0), ValueError),
        (lambda: GRPOLoss(ignore_index=1.5), ValueError),
    ],
)
def test_constructor_errors(factory, exc):
    with pytest.raises(exc):
        factory()


def test_call_errors():
    inputs, outputs, old = batch()
    loss_fn = GRPOLoss()
    with pytest.raises(ValueError, match="per sequence"):
        loss_fn(inputs, outputs, old_logps=old, advantages=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="sequences"):
        loss_fn(inputs, outputs, old_logps=[[0.0], [0.0], [0.0]], advantages=[1.0, -1.0])
    with pytest.raises(ValueError, match="row"):
        loss_fn(inputs, outputs, old_logps=[[0.0] * 2, [0.0] * 2], advantages=[1.0, -1.0])
    with pytest.raises(ValueError, match="shape"):
        loss_fn({"labels": torch.zeros(2, 4, dtype=torch.long)}, outputs, advantages=[1.0, -1.0])
    with pytest.raises(ValueError, match="position_ids"):
        loss_fn({**inputs, "position_ids": torch.zeros(1, 3)}, outputs, advantages=[1.0, -1.0])
    with pytest.raises(TypeError):
        loss_fn(inputs, outputs, old_logps=old, advantages=[1.0, -1.0], num_items_in_batch=3)


# --- streaming, reference, gradcheck, device ------------------------------------------------------------

CLASSES = [GRPOLoss, GSPOLoss, SAPOLoss, CISPOLoss, BNPOLoss, DRGRPOLoss]


def _random_packed(seed, n_rows=4, width=6, dtype=F64):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (n_rows, width), generator=g)
    pos = torch.zeros(n_rows, width, dtype=torch.long)
    for b in range(n_rows):  # random packing: segments of random length, occasional masked tokens
        p = 0
        for t in range(width):
            if t and rnd.random() < 0.25:
                p = 0
            pos[b, t] = p
            p += 1
            if rnd.random() < 0.2:
                labels[b, t] = -100
    logps = (torch.randn(n_rows, width, generator=g, dtype=dtype) * 0.3 - 1).requires_grad_()
    old = logps.detach() + torch.randn(n_rows, width, generator=g, dtype=dtype) * 0.3
    ref = logps.detach() + torch.randn(n_rows, width, generator=g, dtype=dtype) * 0.3
    adv = torch.randn(n_rows, width, generator=g, dtype=dtype)
    return {"labels": labels, "position_ids": pos}, logps, old, ref, adv


def _kwargs(cls):
    kw = {"clip_range": 0.2, "clip_range_high": 0.28, "beta": 0.05}
    if cls is SAPOLoss:
        kw.update(tau_pos=1.0, tau_neg=1.05)
    if cls is DRGRPOLoss:
        kw.update(max_completion_length=8)
    return kw


@pytest.mark.parametrize("cls", CLASSES)
def test_call_equals_terms_and_terms_stream_over_rows(cls):
    inputs, logps, old, ref, adv = _random_packed(1)
    loss_fn = cls(**_kwargs(cls))
    num, den = loss_fn.terms(inputs, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv)
    value = loss_fn(inputs, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv)
    assert value.item() == pytest.approx((num / den).item(), rel=1e-15)
    parts = []
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):  # rows hold whole sequences
        sub = {k: v[rows] for k, v in inputs.items()}
        parts.append(
            loss_fn.terms(sub, {"logps": logps[rows]}, old_logps=old[rows], ref_logps=ref[rows], advantages=adv[rows])
        )
    assert sum(p[0].item() for p in parts) == pytest.approx(num.item(), rel=1e-9)
    assert sum(p[1].item() for p in parts) == pytest.approx(den.item(), rel=1e-12)


def _reference(variant, lp, old, ref, adv, segments, eps_lo, eps_hi, beta, tau_pos, tau_neg, mcl):
    """Independent plain-Python loss over segments = list of lists of (ℓ, ℓ_old, ℓ_ref, A) for valid tokens
    (each list one sequence, possibly empty)."""
    per_seq, tok_sum, tok_n = [], 0.0, 0
    for seg in segments:
        if variant == "gspo":
            w = [min(max(x - o, -20.0), 20.0) for x, o, _, _ in seg]
            seq_w = sum(w) / max(1, len(w))
        total = 0.0
        for x, o, rf, a in seg:
            lw = seq_w if variant == "gspo" else min(max(x - o, -20.0), 20.0)
            r = math.exp(lw)
            if variant == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                loss = -sigmoid(tau * (r - 1)) * 4 / tau * a
            elif variant == "cispo":
                loss = -min(r, 1 + eps_hi) * a * x
            else:
                loss = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            loss += beta * (math.exp(rf - x) - (rf - x) - 1)
            total += loss
        per_seq.append(total / max(1, len(seg)))
        tok_sum += total
        tok_n += len(seg)
    if variant in ("grpo", "gspo", "sapo"):
        return sum(per_seq) / len(segments)
    if variant in ("bnpo", "cispo"):
        return tok_sum / tok_n
    return tok_sum / (len(segments) * mcl)


@pytest.mark.parametrize("cls", CLASSES)
def test_matches_independent_reference(cls):
    for seed in range(3):
        inputs, logps, old, ref, adv = _random_packed(10 + seed)
        kw = _kwargs(cls)
        value = cls(**kw)(inputs, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv).item()
        segments = []
        labels, pos = inputs["labels"].tolist(), inputs["position_ids"].tolist()
        for b in range(len(labels)):
            for t in range(len(labels[b])):
                if t == 0 or pos[b][t] == 0:
                    segments.append([])
                if labels[b][t] != -100:
                    segments[-1].append((logps[b, t].item(), old[b, t].item(), ref[b, t].item(), adv[b, t].item()))
        expected = _reference(
            cls.variant,
            None,
            None,
            None,
            None,
            segments,
            0.2,
            0.28,
            0.05,
            kw.get("tau_pos", 1.0),
            kw.get("tau_neg", 1.0),
            kw.get("max_completion_length", 1024),
        )
        assert value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("cls", [c for c in CLASSES if c is not CISPOLoss])
def test_gradcheck(cls):
    inputs, logps, old, ref, adv = _random_packed(21, n_rows=2, width=4)
    loss_fn = cls(**_kwargs(cls))
    assert torch.autograd.gradcheck(
        lambda x: loss_fn(inputs, {"logps": x}, old_logps=old, ref_logps=ref, advantages=adv),
        (logps.detach().clone().requires_grad_(),),
    )


def test_cispo_gradient_is_stop_gradient_weight_times_advantage():
    # CISPO's value depends on ℓ also through the stop-gradient weight, so finite differences (gradcheck)
    # do not apply; its gradient is exactly -sg(min(r, 1 + ε_hi))·A / N on valid tokens (no β here).
    inputs, logps, old, _, adv = _random_packed(21, n_rows=2, width=4)
    loss = CISPOLoss(clip_range_high=0.28)(inputs, {"logps": logps}, old_logps=old, advantages=adv)
    loss.backward()
    valid = inputs["labels"] != -100
    r = torch.exp((logps.detach() - old).clamp(-20, 20))
    expected = torch.where(valid, -torch.clamp(r, max=1.28) * adv / valid.sum(), torch.zeros_like(r))
    assert torch.allclose(logps.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("cls", CLASSES)
def test_runs_on_device_and_keeps_dtype(cls, device):
    inputs, logps, old, ref, adv = _random_packed(4, dtype=torch.float32)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    lp = logps.detach().to(device).requires_grad_()
    loss = cls(**_kwargs(cls))(
        inputs, {"logps": lp}, old_logps=old.to(device), ref_logps=ref.to(device), advantages=adv.to(device)
    )
    assert loss.dtype == torch.float32 and loss.device.type == torch.device(device).type
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    cpu = cls(**_kwargs(cls))(
        {k: v.cpu() for k, v in inputs.items()}, {"logps": logps.detach()}, old_logps=old, ref_logps=ref, advantages=adv
    )
    assert loss.item() == pytest.approx(cpu.item(), rel=1e-5)


# --- the packed core used by `analyze` ------------------------------------------------------------------


def test_core_terms_packed_matches_loss_object():
    inputs, outputs, old = batch()
    lp = torch.tensor([LN(1.5), LN(1.1), LN(0.5)], dtype=F64)
    cu = torch.tensor([0, 2, 3])
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)
    mask = torch.ones(3, dtype=torch.bool)
    for cls in CLASSES:
        loss = cls()(inputs, outputs, old_logps=old, advantages=[1.0, -1.0])
        num, den = grpo_family_loss_terms(cls.variant, lp, torch.zeros(3, dtype=F64), None, adv, mask, cu, tau_neg=1.0)
        assert loss.item() == pytest.approx((num / den).item(), rel=1e-12)


def test_core_terms_errors():
    x, m = torch.zeros(3), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="variant"):
        grpo_family_loss_terms("ppo", x, x, None, x, m, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        grpo_family_loss_terms("grpo", x, x, None, x, m, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        grpo_family_loss_terms("gspo", x, x, None, x, m, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        grpo_family_loss_terms("grpo", x, x, None, x, m, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_family_loss_terms("dr_grpo", x, x, None, x, m, torch.tensor([0, 3]), max_completion_length=0)
    with pytest.raises(ValueError, match="shape"):
        grpo_family_loss_terms("bnpo", x, x[:2], None, x, m, None)
    num, den = grpo_family_loss_terms("bnpo", x, x, None, x, m, None)  # token mean needs no cu_seqlens
    assert den.item() == 3.0 and num.item() == 0.0
