"""Peer conventions in the core: verl's current ``seq-mean-token-sum-norm``, REINFORCE++ across masked spans and
the straight-through ``+`` KL kinds, each against hand-derived values (and the old releases as options)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.core import aggregate_loss, aggregate_loss_terms, kl_estimate, reinforce_pp_advantages
from grpo_cli.core.conventions import PEER_RELEASES, check_convention

F64 = torch.float64


def test_check_convention() -> None:
    assert check_convention(None, ("verl",), "f") is None
    assert check_convention("verl", ("verl",), "f") == "verl"
    with pytest.raises(ValueError, match="Unknown convention 'verl<=0.5'"):
        check_convention("verl<=0.5", ("verl",), "f")
    with pytest.raises(TypeError):
        check_convention(1, ("verl",), "f")  # type: ignore[arg-type]
    assert PEER_RELEASES["verl"] == "0.9.1"


# --- aggregate_loss seq-mean-token-sum-norm -----------------------------------------------------------------


def test_sum_norm_verl_divides_by_sequences(device: str) -> None:
    # L = [[1, 3], [2, ·]], T = 2: S = [4, 2], B = 2 non-empty sequences.
    per_token = torch.tensor([[1.0, 3.0], [2.0, 99.0]], dtype=F64, device=device, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]], device=device)
    verl = aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", convention="verl")
    assert verl.item() == 1.5  # (4 + 2) / 2 / 2
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", convention="verl<=0.6").item() == 3.0
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm").item() == 3.0  # grpo-cli's default
    verl.backward()
    assert per_token.grad.cpu().tolist() == [[0.25, 0.25], [0.25, 0.0]]  # 1/(B·T) on valid tokens


def test_sum_norm_verl_empty_rows_and_overrides() -> None:
    # An all-masked row leaves B (verl's seq_mask), and the other modes ignore the convention.
    per_token = torch.tensor([[1.0, 3.0, 0.0], [5.0, 5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", convention="verl").item() == pytest.approx(4 / 3)
    out = aggregate_loss(
        per_token, mask, "seq-mean-token-sum-norm", convention="verl", num_sequences=4, loss_scale_factor=2
    )
    assert out.item() == 0.5  # 4 / (4·2)
    num, den = aggregate_loss_terms(per_token, mask, "seq-mean-token-sum-norm", convention="verl")
    assert (num.item(), den.item()) == (4.0, 3.0)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert (
            aggregate_loss(per_token, mask, mode, convention="verl").item()
            == aggregate_loss(per_token, mask, mode).item()
        )
    with pytest.raises(ValueError, match="convention"):
        aggregate_loss(per_token, mask, "token-mean", convention="trl")


def test_sum_norm_verl_packed() -> None:
    flat = torch.tensor([1.0, 3.0, 2.0], dtype=F64)
    cu = torch.tensor([0, 2, 3])
    out = aggregate_loss(
        flat, torch.ones(3, dtype=torch.bool), "seq-mean-token-sum-norm", cu_seqlens=cu, convention="verl"
    )
    assert out.item() == 1.5  # longest sequence 2 stands for T


# --- REINFORCE++ across masked spans --------------------------------------------------------------------------


def test_reinforce_pp_masked_span_conventions(device: str) -> None:
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64, device=device)
    m = torch.tensor([[1, 0, 1, 1]], device=device)
    _, ret_verl = reinforce_pp_advantages(r, m, convention="verl")
    _, ret_old = reinforce_pp_advantages(r, m, convention="verl<=0.8")
    _, ret_default = reinforce_pp_advantages(r, m)
    assert ret_verl.cpu().tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert ret_old.cpu().tolist() == ret_default.cpu().tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_reinforce_pp_verl_discount_and_packed() -> None:
    # γ = 0.5, mask [1, 0, 0, 1, 1], rewards 2 at t=4 and 4 at t=1 (masked: ignored).
    # t=4: 2; t=3: 1; t=2, t=1 masked: carry 1, G = 0; t=0: 0 + 0.5·1 = 0.5.
    r = torch.tensor([0.0, 4.0, 0.0, 0.0, 2.0, 1.0], dtype=F64)
    m = torch.tensor([1, 0, 0, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 5, 6])
    adv, ret = reinforce_pp_advantages(r, m, gamma=0.5, cu_seqlens=cu, convention="verl")
    assert ret.tolist() == [0.5, 0.0, 0.0, 1.0, 2.0, 1.0]
    valid = torch.tensor([0.5, 1.0, 2.0, 1.0], dtype=F64)
    mean, var = valid.mean(), valid.var()  # unbiased, as verl's masked_whiten
    expected = ((valid - mean) / math.sqrt(var.item() + 1e-8)).tolist()
    got = adv[m].tolist()
    assert got == pytest.approx(expected, rel=1e-12)
    assert adv[~m].tolist() == [0.0, 0.0]


# --- straight-through KL --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "value"),
    [("k1+", -1.0), ("k3+", math.exp(1.0) - 1.0 - 1.0), ("abs+", 1.0), ("k2+", 0.5)],
)
def test_straight_through_kl(kind: str, value: float, device: str) -> None:
    # ℓ = -2, ℓ_ref = -1: delta = -1; the gradient is k2's, delta = -1 w.r.t. ℓ and +1 w.r.t. ℓ_ref.
    lp = torch.tensor([-2.0], dtype=F64, device=device, requires_grad=True)
    ref = torch.tensor([-1.0], dtype=F64, device=device, requires_grad=True)
    out = kl_estimate(lp, ref, kind)
    assert out.item() == pytest.approx(value, rel=1e-12)
    out.sum().backward()
    assert lp.grad.item() == pytest.approx(-1.0, rel=1e-12)
    assert ref.grad.item() == pytest.approx(1.0, rel=1e-12)


def test_straight_through_kl_clamped() -> None:
    # k3 clamped to 10 (verl low_var_kl) keeps k2's gradient: delta = -15 → value 10, d/dℓ = -15.
    lp = torch.tensor([-16.0], dtype=F64, requires_grad=True)
    out = kl_estimate(lp, torch.tensor([-1.0], dtype=F64), "k3+", clamp=10.0)
    out.backward()
    assert out.item() == 10.0 and lp.grad.item() == -15.0
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        kl_estimate(lp, lp, "k4+")


# --- TRL use_bias_correction_kl ------------------------------------------------------------------------------


def _grpo_kl_loss(lp_value: float, old_value: float | None, **kw: object) -> tuple[float, float]:
    from grpo_cli.core import grpo_family_loss_terms

    lp = torch.tensor([lp_value], dtype=F64, requires_grad=True)
    old = None if old_value is None else torch.tensor([old_value], dtype=F64)
    num, den = grpo_family_loss_terms(
        "grpo",
        lp,
        old,
        torch.tensor([-2.0], dtype=F64),
        torch.zeros(1, dtype=F64),
        torch.ones(1, dtype=torch.bool),
        torch.tensor([0, 1]),
        beta=1.0,
        **kw,
    )
    loss = num / den
    loss.backward()
    return loss.item(), lp.grad.item()


def test_bias_correction_kl_on_policy() -> None:
    # ℓ = -1, ℓ_ref = -2, A = 0, r = 1: k3 = e^-1 - 1 + 1 = e^-1; d k3/dℓ = 1 - e^-1;
    # with the ratio: d(k3·r)/dℓ = (1 - e^-1)·1 + e^-1·1 = 1.
    k3 = math.exp(-1.0)
    assert _grpo_kl_loss(-1.0, None, convention="trl") == pytest.approx((k3, 1.0), rel=1e-12)
    assert _grpo_kl_loss(-1.0, None, use_bias_correction_kl=True) == pytest.approx((k3, 1.0), rel=1e-12)
    assert _grpo_kl_loss(-1.0, None) == pytest.approx((k3, 1 - k3), rel=1e-12)
    assert _grpo_kl_loss(-1.0, None, convention="twinkle") == pytest.approx((k3, 1 - k3), rel=1e-12)
    assert _grpo_kl_loss(-1.0, None, convention="trl", use_bias_correction_kl=False) == pytest.approx(
        (k3, 1 - k3), rel=1e-12
    )


def test_bias_correction_kl_off_policy() -> None:
    # ℓ = -1, ℓ_old = -1 - ln 2: r = 2 (A = 0, so the surrogate is 0); loss = 2·k3, gradient 2·(1 - e^-1) + 2·e^-1.
    k3 = math.exp(-1.0)
    loss, grad = _grpo_kl_loss(-1.0, -1.0 - math.log(2.0), convention="trl")
    assert loss == pytest.approx(2 * k3, rel=1e-12) and grad == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError, match="convention"):
        _grpo_kl_loss(-1.0, None, convention="verl")


# --- AReaL statistics masks ----------------------------------------------------------------------------------


def _rs_case() -> tuple[torch.Tensor, ...]:
    # ℓθ = [ln 1.5, ln 3, 0], ℓp = 0, ℓb = [0, -ln 3, 0]: w_b = [1, 3, 1]; with upper 2 token 1 is rejected.
    lp = torch.log(torch.tensor([1.5, 3.0, 1.0], dtype=F64))
    prox = torch.zeros(3, dtype=F64)
    behave = torch.tensor([0.0, -math.log(3.0), 0.0], dtype=F64)
    return lp, prox, behave, torch.ones(3, dtype=F64), torch.ones(3, dtype=torch.bool)


def test_cispo_importance_weight_on_pre_filter_mask() -> None:
    from grpo_cli.core import RejectionSamplingConfig, cispo_loss

    lp, prox, behave, adv, mask = _rs_case()
    lp.requires_grad_(True)
    loss, st = cispo_loss(
        lp, prox, behave, adv, 0.2, mask, eps_clip_higher=0.28, rejection_sampling=RejectionSamplingConfig(upper=2.0)
    )
    # the rejected token shows its ratio 3 (not 1); the loss and gradient do not see it
    assert st["importance_weight"].tolist() == pytest.approx([1.5, 3.0, 1.0], rel=1e-12)
    assert st["clip_mask"].tolist() == [True, False, False]  # 1.5 > 1.28 on the kept mask
    loss.backward()
    # -sg(clip(r))·A·w_b / N0 per kept token: [-1.28/3, 0, -1/3]
    assert lp.grad.tolist() == pytest.approx([-1.28 / 3, 0.0, -1 / 3], rel=1e-12)


def test_ppo_convention_areal_statistics_mask() -> None:
    from grpo_cli.core import RejectionSamplingConfig, ppo_actor_loss

    lp, prox, behave, adv, mask = _rs_case()
    cfg = RejectionSamplingConfig(upper=2.0)
    loss_new, st_new = ppo_actor_loss(lp, prox, behave, adv, 0.2, mask, rejection_sampling=cfg)
    loss_old, st_old = ppo_actor_loss(lp, prox, behave, adv, 0.2, mask, rejection_sampling=cfg, convention="areal")
    assert st_new["importance_weight"].tolist() == pytest.approx([1.5, 3.0, 1.0], rel=1e-12)
    assert st_old["importance_weight"].tolist() == pytest.approx([1.5, 0.0, 1.0], rel=1e-12)
    assert st_new["clip_mask"].tolist() == [True, True, False] and st_old["clip_mask"].tolist() == [True, False, False]
    assert loss_new.item() == loss_old.item() == pytest.approx(-(1.2 + 1.0) / 3, rel=1e-12)
