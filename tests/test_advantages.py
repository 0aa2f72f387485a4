"""Reward shaping, AReaL normalisation, GAE and the GRPO-family estimators against hand-derived values.

Every expected number is either derived by hand in a comment next to it or produced by a plain-Python float64
reference written below (loops over groups/time steps, straight from the formulas of AReaL's
``areal/trainer/ppo/actor.py`` and ``areal/utils/data.py`` and verl's ``core_algos.py``), never by the
implementation itself.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_cli.core import (
    AdvantageConfig,
    Normalization,
    NormConfig,
    compute_advantages,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    kl_regularized_rewards,
    masked_whiten,
    normalize,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reward_overlong_penalty,
    rloo_advantages,
    roll_to_next_token,
    sequence_to_tokens,
    shape_rewards,
)
from grpo_cli.core.packing import cu_seqlens_from_lengths

F64 = torch.float64
NAN = float("nan")


def t64(x: object, device: str) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, device=device)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-12, rtol: float = 1e-12) -> None:
    exp = torch.as_tensor(expected, dtype=actual.dtype, device=actual.device)
    torch.testing.assert_close(actual, exp, atol=atol, rtol=rtol)


# ==============================================================================================================
# plain-Python references
# ==============================================================================================================


def ref_normalize(rows: list[list[float]], masks: list[list[bool]], groups: list[int], cfg: NormConfig):
    """AReaL ``Normalization`` with Python loops; rows are sequences, groups[b] the id of row b."""
    n_rows = len(rows)
    if not any(any(m) for m in masks):
        return [list(r) for r in rows]

    def segments(level: str | None) -> list[list[int]]:
        if level == "group":
            ids = sorted(set(groups))
            return [[b for b in range(n_rows) if groups[b] == g] for g in ids]
        return [list(range(n_rows))]

    mean = [[0.0] * len(r) for r in rows]
    if cfg.mean_level is not None:
        for seg in segments(cfg.mean_level):
            s = sum(rows[b][t] for b in seg for t in range(len(rows[b])) if masks[b][t])
            n = sum(1 for b in seg for t in range(len(rows[b])) if masks[b][t])
            for b in seg:
                for t in range(len(rows[b])):
                    if cfg.mean_leave1out:
                        if cfg.mean_level == "group" and len(seg) == 1:
                            mean[b][t] = rows[b][t]
                        elif n <= 1:
                            mean[b][t] = 0.0
                        elif masks[b][t]:
                            mean[b][t] = (s - rows[b][t]) / (n - 1)
                        else:
                            mean[b][t] = s / n
                    else:
                        mean[b][t] = s / n if n > 0 else 0.0
    std = [[1.0] * len(r) for r in rows]
    eps = cfg.eps
    if cfg.std_level is None:
        eps = 0.0
    else:
        for seg in segments(cfg.std_level):
            ss = sum((rows[b][t] - mean[b][t]) ** 2 for b in seg for t in range(len(rows[b])) if masks[b][t])
            n = sum(1 for b in seg for t in range(len(rows[b])) if masks[b][t])
            if cfg.std_unbiased:
                sd = 1.0 if (cfg.std_level == "group" and len(seg) == 1) or n <= 1 else math.sqrt(ss / (n - 1))
            else:
                sd = 1.0 if n == 0 else math.sqrt(ss / n)
            for b in seg:
                std[b] = [sd] * len(rows[b])
    return [
        [(rows[b][t] - mean[b][t]) / (std[b][t] + eps) if masks[b][t] else 0.0 for t in range(len(rows[b]))]
        for b in range(n_rows)
    ]


def ref_gae(r: list[float], v: list[float], m: list[bool], no_eos: bool, gamma: float, lam: float):
    """AReaL's token-level GAE loop for one sequence of length L (AReaL ``PPOActor._compute_advantages``)."""
    n = len(r)
    adv = [0.0] * n
    last, next_v = 0.0, (v[n - 1] if no_eos else 0.0)
    for t in range(n - 2, -1, -1):
        if m[t]:
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            next_v = v[t]
        adv[t] = last
    return adv


def ref_grpo(r: list[float], g: list[int], eps: float, unbiased: bool, scale: bool) -> list[float]:
    """verl compute_grpo_outcome_advantage with dict-of-lists loops (``verl/trainer/ppo/core_algos.py``)."""
    by: dict[int, list[float]] = {}
    for x, k in zip(r, g, strict=True):
        by.setdefault(k, []).append(x)
    out = []
    for x, k in zip(r, g, strict=True):
        xs = by[k]
        if len(xs) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(xs) / len(xs)
            sd = math.sqrt(sum((y - mu) ** 2 for y in xs) / (len(xs) - 1 if unbiased else len(xs)))
        out.append((x - mu) / (sd + eps) if scale else x - mu)
    return out


def ref_rloo(r: list[float], g: list[int], zero_singleton: bool) -> list[float]:
    out = []
    for i, (x, k) in enumerate(zip(r, g, strict=True)):
        others = [r[j] for j in range(len(r)) if g[j] == k and j != i]
        out.append(x - sum(others) / len(others) if others else (0.0 if zero_singleton else x))
    return out


# ==============================================================================================================
# reward shaping
# ==============================================================================================================


def test_shape_rewards_bias_scale_clip(device: str) -> None:
    r = torch.tensor([0.0, 1.0, 3.0, -30.0], device=device)
    # (r − 0.5)·10 = [−5, 5, 25 → clip 20, −305 → clip −20]
    close(shape_rewards(r, reward_bias=-0.5, reward_scaling=10.0), [-5.0, 5.0, 20.0, -20.0])
    # defaults: identity but the clip at ±20
    close(shape_rewards(t64([25.0, -1.5], device)), [20.0, -1.5])
    close(shape_rewards(t64([25.0], device), reward_clip=None), [25.0])
    assert shape_rewards(torch.tensor([1.0], dtype=torch.float16, device=device)).dtype == torch.float32
    with pytest.raises(ValueError):
        shape_rewards(r, reward_clip=-1.0)
    with pytest.raises(TypeError):
        shape_rewards(r, reward_bais=0.0)  # type: ignore[call-arg]


def test_overlong_penalty_areal_examples(device: str) -> None:
    # AReaL ``reward_overlong_penalty``: max 1024, overlong_tokens 128, factor 1 → expected length 896; len 800 → 0;
    # 900 → −4/128 = −0.03125; 950 → −54/128 = −0.421875; 1024 → −1; 1100 → −204/128 = −1.59375.
    lengths = torch.tensor([800, 900, 950, 1024, 1100], device=device)
    out = reward_overlong_penalty(t64([1.0] * 5, device), lengths, overlong_tokens=128, overlong_penalty_factor=1.0)
    close(out, [1.0, 0.96875, 0.578125, 0.0, -0.59375])
    # factor 0.5, max 10, overlong_tokens 4: expected 6; len 8 → −(2/4)·0.5 = −0.25
    out = reward_overlong_penalty(
        t64([0.0], device),
        torch.tensor([8], device=device),
        overlong_tokens=4,
        overlong_penalty_factor=0.5,
        max_response_length=10,
    )
    close(out, [-0.25])
    with pytest.raises(ValueError):
        reward_overlong_penalty(t64([0.0], device), lengths[:1], overlong_tokens=0, overlong_penalty_factor=1.0)
    with pytest.raises(ValueError):
        reward_overlong_penalty(t64([0.0, 1.0], device), lengths, overlong_tokens=4, overlong_penalty_factor=1.0)


# ==============================================================================================================
# KL-regularised token rewards
# ==============================================================================================================


def test_kl_estimators_and_clamp(device: str) -> None:
    # kl_ctl = −1 turns kl_rewards into the estimate itself. Δ = old − ref per column: 1, −30, 15, 0.5.
    old = t64([[-1.0, -31.0, 5.0, -0.5]], device)
    ref = t64([[-2.0, -1.0, -10.0, -1.0]], device)
    mask = torch.ones(1, 4, dtype=torch.bool, device=device)
    s = t64([0.0], device)
    k1 = kl_regularized_rewards(s, old, ref, mask, kl_ctl=-1.0, kl_estimator="k1")[1]
    close(k1, [[1.0, -10.0, 10.0, 0.5]])  # Δ, clamped to ±10
    k2 = kl_regularized_rewards(s, old, ref, mask, kl_ctl=-1.0, kl_estimator="k2")[1]
    close(k2, [[0.5, 10.0, 10.0, 0.125]])  # Δ²/2 = 0.5, 450 → 10, 112.5 → 10, 0.125
    k3 = kl_regularized_rewards(s, old, ref, mask, kl_ctl=-1.0, kl_estimator="k3")[1]
    # exp(−Δ) − 1 + Δ: Δ=1 → e⁻¹; Δ=−30 → e³⁰ − 31 → 10; Δ=15 → e⁻¹⁵ + 14 → 10; Δ=0.5 → e^−0.5 − 0.5
    close(k3, [[math.exp(-1.0), 10.0, 10.0, math.exp(-0.5) - 0.5]])
    with pytest.raises(ValueError):
        kl_regularized_rewards(s, old, ref, mask, kl_estimator="k4")


def test_kl_rewards_placement_padded(device: str) -> None:
    # Row 0: seqlen 5, next-token mask [0, 1, 1, 1, 0]; Δ = old − ref = [·, 0.5, 0, −1, ·]
    #   kl_rewards = −0.1·Δ on valid tokens = [0, −0.05, 0, 0.1, 0]
    #   tot: index seqlen−1 = 4 → 0, score 2 added at index 3 → [0, −0.05, 0, 2.1, 0]
    # Row 1: seqlen 3 (two pad positions), mask [1, 1, 0, 0, 0]; Δ = [0.2, −0.4, ·]
    #   kl = [−0.02, 0.04, 0, 0, 0]; index 2 → 0; score −1 added at index 1 → [−0.02, −0.96, 0, 0, 0]
    # Row 2: seqlen 1, mask all 0: index 0 zeroed, then score 3 added at max(1−2, 0) = 0.
    nan_pad = NAN  # garbage at masked positions must not leak
    old = t64([[nan_pad, -1.0, -0.5, -2.0, nan_pad], [-0.3, -1.4, nan_pad, 0, 0], [nan_pad, 0, 0, 0, 0]], device)
    ref = t64([[0.0, -1.5, -0.5, -1.0, 0.0], [-0.5, -1.0, 0.0, 0, 0], [0.0, 0, 0, 0, 0]], device)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], device=device)
    scores = t64([2.0, -1.0, 3.0], device)
    seqlens = torch.tensor([5, 3, 1], device=device)
    tot, kl = kl_regularized_rewards(scores, old, ref, mask, kl_ctl=0.1, seqlens=seqlens)
    close(kl, [[0, -0.05, 0, 0.1, 0], [-0.02, 0.04, 0, 0, 0], [0, 0, 0, 0, 0]], atol=1e-15)
    close(tot, [[0, -0.05, 0, 2.1, 0], [-0.02, -0.96, 0, 0, 0], [3.0, 0, 0, 0, 0]], atol=1e-15)
    # mask_no_eos_with_zero: default AReaL rule marks only the row filling T = 5 (row 0) as "no EOS"
    tot0, _ = kl_regularized_rewards(scores, old, ref, mask, kl_ctl=0.1, seqlens=seqlens, mask_no_eos_with_zero=True)
    close(tot0[0], [0, -0.05, 0, 0.1, 0], atol=1e-15)
    close(tot0[1:], tot[1:])


def test_kl_rewards_ref_defaults_to_zero_and_kl_ctl_zero(device: str) -> None:
    # No reference model: AReaL uses ref = 0, so the default kl_ctl 0.1 adds −0.1·clamp(old, ±10) per token.
    old = t64([[-2.0, -20.0, 0.0]], device)
    mask = torch.tensor([[1, 1, 0]], device=device)
    tot, kl = kl_regularized_rewards(t64([1.0], device), old, None, mask)
    close(kl, [[0.2, 1.0, 0.0]])  # −0.1·(−2), −0.1·clamp(−20) = 1.0
    close(tot, [[0.2, 2.0, 0.0]])  # seqlen 3: index 2 zeroed, score 1 at index 1
    # a mask that is 1 at the last position (not AReaL's rolled layout): the KL reward there is still zeroed
    tot, kl = kl_regularized_rewards(t64([1.0], device), old, None, torch.ones_like(mask))
    close(kl, [[0.2, 1.0, 0.0]])  # −0.1·0 at the last position
    old_last = t64([[-2.0, -20.0, -3.0]], device)
    tot, kl = kl_regularized_rewards(t64([1.0], device), old_last, None, torch.ones_like(mask))
    close(kl, [[0.2, 1.0, 0.3]])
    close(tot, [[0.2, 2.0, 0.0]])
    tot, kl = kl_regularized_rewards(t64([1.0], device), None, None, mask, kl_ctl=0.0)
    close(kl, [[0.0, 0.0, 0.0]])
    close(tot, [[0.0, 1.0, 0.0]])
    with pytest.raises(ValueError):
        kl_regularized_rewards(t64([1.0], device), None, None, mask, kl_ctl=0.1)


def test_kl_rewards_packed_equals_padded(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4, 1, 6, 2])
    n = int(lengths.sum())
    old = (-torch.rand(n, generator=gen, dtype=F64) * 3).to(device)
    ref = (-torch.rand(n, generator=gen, dtype=F64) * 3).to(device)
    mask = (torch.rand(n, generator=gen) > 0.3).to(device)
    scores = t64([1.0, -2.0, 0.5, 3.0], device)
    cu = cu_seqlens_from_lengths(lengths).to(device)
    no_eos = torch.tensor([True, False, True, False], device=device)
    for est in ("k1", "k2", "k3"):
        kw = {"kl_ctl": 0.3, "kl_estimator": est, "no_eos": no_eos, "mask_no_eos_with_zero": True}
        tot_p, kl_p = kl_regularized_rewards(scores, old, ref, mask, cu_seqlens=cu, **kw)
        pad = {name: torch.zeros(4, 6, dtype=x.dtype, device=device) for name, x in [("o", old), ("r", ref)]}
        mpad = torch.zeros(4, 6, dtype=torch.bool, device=device)
        keep = torch.arange(6, device=device)[None] < lengths.to(device)[:, None]
        pad["o"][keep], pad["r"][keep], mpad[keep] = old, ref, mask
        tot_d, kl_d = kl_regularized_rewards(scores, pad["o"], pad["r"], mpad, seqlens=lengths.to(device), **kw)
        close(tot_p, tot_d[keep])
        close(kl_p, kl_d[keep])


# ==============================================================================================================
# token-level GAE
# ==============================================================================================================


def test_gae_hand_values(device: str) -> None:
    # γ = 0.9, λ = 0.5 (γλ = 0.45); rewards [0, 0.1, −0.2, 1.0, 0]; V = [0.5, 0.2, 0.4, 0.3, 0.7];
    # mask [0, 1, 1, 1, 0].  With EOS (no bootstrap, V_next starts at 0):
    #   t=3: δ = 1.0 + 0.9·0 − 0.3 = 0.7;            A = 0.7;                     V_next = 0.3
    #   t=2: δ = −0.2 + 0.9·0.3 − 0.4 = −0.33;       A = −0.33 + 0.45·0.7 = −0.015; V_next = 0.4
    #   t=1: δ = 0.1 + 0.9·0.4 − 0.2 = 0.26;         A = 0.26 + 0.45·(−0.015) = 0.25325
    #   t=0: masked → carries 0.25325;  t=4 (last position) → 0.
    r = t64([[0.0, 0.1, -0.2, 1.0, 0.0]], device)
    v = t64([[0.5, 0.2, 0.4, 0.3, 0.7]], device)
    m = torch.tensor([[0, 1, 1, 1, 0]], device=device)
    adv, ret = gae_advantages(r, v, m, discount=0.9, gae_lambda=0.5, no_eos=torch.tensor([False], device=device))
    close(adv, [[0.25325, 0.25325, -0.015, 0.7, 0.0]])
    close(ret, [[0.75325, 0.45325, 0.385, 1.0, 0.7]])  # adv + V
    # Without EOS: V_next starts at V[4] = 0.7:
    #   t=3: δ = 1.0 + 0.63 − 0.3 = 1.33; A = 1.33
    #   t=2: δ = −0.33; A = −0.33 + 0.45·1.33 = 0.2685
    #   t=1: δ = 0.26;  A = 0.26 + 0.45·0.2685 = 0.380825
    adv, _ = gae_advantages(r, v, m, discount=0.9, gae_lambda=0.5)  # default: row fills T → no EOS
    close(adv, [[0.380825, 0.380825, 0.2685, 1.33, 0.0]])


def test_gae_skips_masked_gap(device: str) -> None:
    # γ = 0.5, λ = 1; rewards [1, 9, 2, 4, 0]; V = [0.1, 5, 0.2, 0.3, 0]; mask [1, 0, 1, 1, 0]; EOS.
    #   t=3: δ = 4 − 0.3 = 3.7;                A = 3.7;                 V_next = 0.3
    #   t=2: δ = 2 + 0.5·0.3 − 0.2 = 1.95;     A = 1.95 + 0.5·3.7 = 3.8;  V_next = 0.2
    #   t=1: masked: reward 9 and V 5 ignored, A and V_next carried → A = 3.8
    #   t=0: δ = 1 + 0.5·0.2 − 0.1 = 1.0;      A = 1.0 + 0.5·3.8 = 2.9
    r = t64([[1.0, 9.0, 2.0, 4.0, 0.0]], device)
    v = t64([[0.1, 5.0, 0.2, 0.3, 0.0]], device)
    m = torch.tensor([[True, False, True, True, False]], device=device)
    adv, _ = gae_advantages(r, v, m, discount=0.5, gae_lambda=1.0, no_eos=torch.tensor([False], device=device))
    close(adv, [[2.9, 3.8, 3.8, 3.7, 0.0]])
    # Garbage (NaN/inf) at masked positions does not leak into any advantage.
    r_bad, v_bad = r.clone(), v.clone()
    r_bad[0, 1], v_bad[0, 1], r_bad[0, 4] = NAN, float("inf"), NAN
    adv_bad, _ = gae_advantages(
        r_bad, v_bad, m, discount=0.5, gae_lambda=1.0, no_eos=torch.tensor([False], device=device)
    )
    close(adv_bad, [[2.9, 3.8, 3.8, 3.7, 0.0]])


def test_gae_no_critic_is_reward_to_go(device: str) -> None:
    # γ = λ = 1, V = 0: A_t = Σ_{s ≥ t, valid} r_s; rewards [0, 0.5, 2, 0] with mask [0, 1, 1, 0] → [2.5, 2.5, 2, 0]
    adv, ret = gae_advantages(t64([[0.0, 0.5, 2.0, 0.0]], device), None, torch.tensor([[0, 1, 1, 0]], device=device))
    close(adv, [[2.5, 2.5, 2.0, 0.0]])
    close(ret, [[2.5, 2.5, 2.0, 0.0]])
    assert gae_advantages(torch.zeros(1, 3, device=device), None, torch.ones(1, 3, device=device))[0].dtype == (
        torch.float32
    )


def test_gae_padded_bootstrap_reads_last_column_like_areal(device: str) -> None:
    # AReaL: the bootstrap is V[:, T−1]·no_eos whatever the row length. Row: mask [1, 0, 0] (padding after),
    # rewards 0, V = [0, 0, 4]; no_eos True, γ = 0.5, λ = 1:
    #   default (seqlen = T = 3): t=1 masked (carry), t=0: δ = 0 + 0.5·4 − 0 = 2 → A = [2, 0, 0]
    #   seqlens = [2]: bootstrap V[1] = 0 and positions ≥ 1 skipped → A = [0, 0, 0]
    r = t64([[0.0, 0.0, 0.0]], device)
    v = t64([[0.0, 0.0, 4.0]], device)
    m = torch.tensor([[1, 0, 0]], device=device)
    yes = torch.tensor([True], device=device)
    close(gae_advantages(r, v, m, discount=0.5, no_eos=yes)[0], [[2.0, 0.0, 0.0]])
    close(gae_advantages(r, v, m, discount=0.5, no_eos=yes, seqlens=torch.tensor([2], device=device))[0], [[0.0] * 3])


def test_gae_random_against_reference_packed_and_padded(device: str) -> None:
    rng = random.Random(1)
    lengths = [1, 2, 7, 4, 9, 3]
    seqs = []
    for n in lengths:
        r = [rng.uniform(-1, 1) for _ in range(n)]
        v = [rng.uniform(-1, 1) for _ in range(n)]
        m = [rng.random() > 0.3 for _ in range(n)]
        seqs.append((r, v, m))
    no_eos = [True, False, True, True, False, True]
    gamma, lam = 0.93, 0.71
    expected = [ref_gae(r, v, m, e, gamma, lam) for (r, v, m), e in zip(seqs, no_eos, strict=True)]
    flat = [x for e in expected for x in e]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)).to(device)
    rp = t64([x for s in seqs for x in s[0]], device)
    vp = t64([x for s in seqs for x in s[1]], device)
    mp = torch.tensor([x for s in seqs for x in s[2]], device=device)
    eos_t = torch.tensor(no_eos, device=device)
    adv, ret = gae_advantages(rp, vp, mp, discount=gamma, gae_lambda=lam, no_eos=eos_t, cu_seqlens=cu)
    close(adv, flat)
    close(ret, [a + b for a, b in zip(flat, vp.tolist(), strict=True)])
    # padded with NaN garbage in the padding and explicit seqlens gives the same values
    width = max(lengths)
    pad = lambda k, fill: t64([s[k] + [fill] * (width - len(s[k])) for s in seqs], device)  # noqa: E731
    mpad = torch.tensor([s[2] + [False] * (width - len(s[2])) for s in seqs], device=device)
    adv_d, _ = gae_advantages(
        pad(0, NAN),
        pad(1, NAN),
        mpad,
        discount=gamma,
        gae_lambda=lam,
        no_eos=eos_t,
        seqlens=torch.tensor(lengths, device=device),
    )
    keep = torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    close(adv_d[keep], flat)


# ==============================================================================================================
# AReaL Normalization
# ==============================================================================================================


def test_normalize_batch_hand(device: str) -> None:
    # x = [1, 2, 3, 4]: mean 2.5, unbiased var = (2.25 + 0.25 + 0.25 + 2.25)/3 = 5/3
    x = t64([1.0, 2.0, 3.0, 4.0], device)
    sd = math.sqrt(5 / 3)
    close(normalize(x), [(v - 2.5) / (sd + 1e-5) for v in (1, 2, 3, 4)])
    # biased: var = 5/4
    cfg = NormConfig(std_unbiased=False, eps=0.0)
    close(normalize(x, config=cfg), [(v - 2.5) / math.sqrt(1.25) for v in (1, 2, 3, 4)])
    # eps matters: x = [1, 3], biased std 1, eps 0.5 → (x − 2)/1.5
    close(normalize(t64([1.0, 3.0], device), config=NormConfig(std_unbiased=False, eps=0.5)), [-2 / 3, 2 / 3])
    # std_level None → std 1 and eps 0 (exact centering); mean_level None → RMS-style std around 0
    close(normalize(t64([1.0, 2.0, 6.0], device), config=NormConfig(std_level=None, eps=9.0)), [-2.0, -1.0, 3.0])
    # mean None, unbiased std: sqrt((1 + 4 + 36)/2) = sqrt(20.5)
    close(
        normalize(t64([1.0, 2.0, 6.0], device), config=NormConfig(mean_level=None, eps=0.0)),
        [v / math.sqrt(20.5) for v in (1, 2, 6)],
    )


def test_normalize_leave_one_out_hand(device: str) -> None:
    # x = [1, 2, 6], S = 9: leave-one-out means [8/2, 7/2, 3/2] = [4, 3.5, 1.5] → centred [−3, −1.5, 4.5];
    # std around those means (unbiased): sqrt((9 + 2.25 + 20.25)/2) = sqrt(15.75)
    cfg = NormConfig(mean_leave1out=True, eps=0.0)
    close(normalize(t64([1.0, 2.0, 6.0], device), config=cfg), [v / math.sqrt(15.75) for v in (-3, -1.5, 4.5)])
    # masked element: its mean would be S/N = 3, but it is masked, so the output is 0; the others use N = 3.
    x = t64([1.0, 2.0, 6.0, 100.0], device)
    m = torch.tensor([1, 1, 1, 0], device=device)
    close(normalize(x, m, cfg), [v / math.sqrt(15.75) for v in (-3, -1.5, 4.5)] + [0.0])
    # a batch of one element: N ≤ 1 → mean 0 and (unbiased) std 1 → x/(1 + eps)
    close(normalize(t64([5.0], device), config=NormConfig(mean_leave1out=True)), [5.0 / (1 + 1e-5)])


def test_normalize_groups_non_contiguous_and_singletons(device: str) -> None:
    # ids [7, 3, 7, 3, 9]: group 7 = [1, 3] (mean 2, unbiased std √2), group 3 = [0, 4] (mean 2, std 2√2),
    # group 9 = [5] alone: its mean is itself → 0 (and unbiased std 1).
    x = t64([1.0, 0.0, 3.0, 4.0, 5.0], device)
    ids = torch.tensor([7, 3, 7, 3, 9], device=device)
    cfg = NormConfig(mean_level="group", std_level="group", eps=0.0)
    s2, s8 = math.sqrt(2), math.sqrt(8)
    close(normalize(x, config=cfg, group_ids=ids), [-1 / s2, -2 / s8, 1 / s2, 2 / s8, 0.0])
    # leave-one-out: group 7 → [1 − 3, 3 − 1] = [−2, 2], std sqrt((4 + 4)/1) = √8; singleton → mean x → 0
    cfg = NormConfig(mean_level="group", std_level="group", mean_leave1out=True, eps=0.0)
    close(normalize(x, config=cfg, group_ids=ids), [-2 / s8, -4 / math.sqrt(32), 2 / s8, 4 / math.sqrt(32), 0.0])
    # group mean, batch std: centred [−1, −2, 1, 2, 0], unbiased batch std sqrt(10/4)
    cfg = NormConfig(mean_level="group", std_level="batch", eps=0.0)
    close(normalize(x, config=cfg, group_ids=ids), [v / math.sqrt(2.5) for v in (-1, -2, 1, 2, 0)])
    # batch mean 2.6, group std; the singleton group with unbiased std → 1: 5 − 2.6 = 2.4
    cfg = NormConfig(mean_level="batch", std_level="group", eps=0.0)
    out = normalize(x, config=cfg, group_ids=ids)
    close(out[4:], [2.4])
    # group 7 around 2.6: deviations −1.6, 0.4 → std sqrt((2.56 + 0.16)/1)
    close(out[[0, 2]], [-1.6 / math.sqrt(2.72), 0.4 / math.sqrt(2.72)])
    # the same with group_sizes (contiguous) and with group_size
    y = t64([1.0, 3.0, 0.0, 4.0], device)
    cfg = NormConfig(mean_level="group", std_level="group", eps=0.0, group_size=2)
    expected = [-1 / s2, 1 / s2, -2 / s8, 2 / s8]
    close(normalize(y, config=cfg), expected)
    close(normalize(y, config=cfg, group_sizes=[2, 2]), expected)
    close(Normalization(cfg)(y, group_ids=torch.tensor([-5, -5, 11, 11], device=device)), expected)
    with pytest.raises(ValueError, match="multiple of group_size"):
        normalize(t64([1.0, 2.0, 3.0], device), config=cfg)
    with pytest.raises(ValueError):
        normalize(y, config=cfg, group_sizes=[3, 2])
    with pytest.raises(ValueError):
        normalize(y, config=cfg, group_ids=torch.tensor([0.0, 0.0, 1.0, 1.0], device=device))


def test_normalize_singleton_biased_std_and_small_groups(device: str) -> None:
    # biased std for a one-row group: std 0 around its own mean → 0/(0 + eps) = 0
    cfg = NormConfig(mean_level="group", std_level="group", std_unbiased=False)
    close(
        normalize(t64([1.0, 3.0, 5.0], device), config=cfg, group_ids=torch.tensor([0, 0, 1], device=device)),
        [-1 / (1 + 1e-5), 1 / (1 + 1e-5), 0.0],
    )
    # a two-row group with only one valid token: N = 1 → leave-one-out mean 0, unbiased std 1 → x/(1 + eps)
    cfg = NormConfig(mean_level="group", std_level="group", mean_leave1out=True)
    x = t64([4.0, 8.0], device)
    close(
        normalize(x, torch.tensor([True, False], device=device), cfg, group_ids=torch.tensor([1, 1], device=device)),
        [4.0 / (1 + 1e-5), 0.0],
    )


def test_normalize_token_weighted_2d_and_empty_mask(device: str) -> None:
    # Two rows in one group, valid tokens {1, 2} and {3}: token-weighted mean 2, unbiased std 1.
    x = t64([[1.0, 2.0, NAN], [3.0, float("inf"), 7.0]], device)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], device=device)
    cfg = NormConfig(mean_level="group", std_level="group", eps=0.0)
    close(normalize(x, m, cfg, group_ids=torch.tensor([4, 4], device=device)), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # an empty mask returns x unchanged (AReaL's early return)
    z = t64([[1.0, 2.0]], device)
    close(normalize(z, torch.zeros(1, 2, dtype=torch.bool, device=device)), [[1.0, 2.0]])
    assert normalize(torch.tensor([1.0, 2.0], dtype=torch.float16, device=device)).dtype == torch.float32


ALL_CONFIGS = [
    NormConfig(mean_level=ml, std_level=sl, mean_leave1out=l1o, std_unbiased=ub, eps=eps)
    for ml in ("batch", "group", None)
    for sl in ("batch", "group", None)
    for l1o in (False, True)
    for ub in (False, True)
    for eps in (1e-5,)
]


def test_normalize_all_configs_against_reference(device: str) -> None:
    rng = random.Random(7)
    lengths = [3, 1, 4, 2, 5, 3, 2]
    groups = [5, 2, 5, 8, 2, 5, 1]  # group 8 and group 1 are singletons; not contiguous
    rows = [[rng.uniform(-2, 2) for _ in range(n)] for n in lengths]
    masks = [[rng.random() > 0.25 for _ in range(n)] for n in lengths]
    masks[3] = [False] * lengths[3]  # a singleton group whose row is fully masked
    cu = cu_seqlens_from_lengths(torch.tensor(lengths)).to(device)
    xp = t64([v for r in rows for v in r], device)
    mp = torch.tensor([v for m in masks for v in m], device=device)
    ids = torch.tensor(groups, device=device)
    width = max(lengths)
    xd = t64([r + [NAN] * (width - len(r)) for r in rows], device)
    md = torch.tensor([m + [False] * (width - len(m)) for m in masks], device=device)
    keep = torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    scalar = [r[0] for r in rows]
    for cfg in ALL_CONFIGS:
        expected = [v for r in ref_normalize(rows, masks, groups, cfg) for v in r]
        close(normalize(xp, mp, cfg, group_ids=ids, cu_seqlens=cu), expected, atol=1e-10, rtol=1e-10)
        close(normalize(xd, md, cfg, group_ids=ids)[keep], expected, atol=1e-10, rtol=1e-10)
        # per-sequence values ([B], no mask), the reward_norm case
        exp_seq = [r[0] for r in ref_normalize([[v] for v in scalar], [[True]] * len(scalar), groups, cfg)]
        close(normalize(t64(scalar, device), None, cfg, group_ids=ids), exp_seq, atol=1e-10, rtol=1e-10)


def test_norm_config_validation() -> None:
    assert NormConfig(mean_level="none", std_level="None").mean_level is None
    with pytest.raises(ValueError):
        NormConfig(mean_level="token")
    with pytest.raises(ValueError):
        NormConfig(eps=-1.0)
    with pytest.raises(ValueError):
        NormConfig(group_size=0)
    with pytest.raises(TypeError):
        NormConfig(mean_leave1out=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        NormConfig(std="batch")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Normalization({"mean_level": "batch"})  # type: ignore[arg-type]


# ==============================================================================================================
# GRPO, Dr.GRPO, RLOO
# ==============================================================================================================


def test_grpo_hand(device: str) -> None:
    # ids [10, 20, 10, 20, 30]: group 10 = [1, 1] (σ = 0 → 0/(0 + ε) = 0);
    # group 20 = [0, 0.5]: μ = 0.25, unbiased σ = sqrt(2·0.0625/1) = 0.353553…; singleton 30: μ = 0, σ = 1.
    r = t64([1.0, 0.0, 1.0, 0.5, 0.7], device)
    ids = torch.tensor([10, 20, 10, 20, 30], device=device)
    sd = math.sqrt(0.125)
    close(grpo_advantages(r, ids), [0.0, -0.25 / (sd + 1e-6), 0.0, 0.25 / (sd + 1e-6), 0.7 / (1 + 1e-6)])
    # biased σ = 0.25; TRL's ε = 1e-4
    close(
        grpo_advantages(r, ids, std_unbiased=False, eps=1e-4), [0.0, -0.25 / 0.2501, 0.0, 0.25 / 0.2501, 0.7 / 1.0001]
    )
    # Dr.GRPO: r − μ_g, singleton keeps r
    close(drgrpo_advantages(r, ids), [0.0, -0.25, 0.0, 0.25, 0.7])
    assert grpo_advantages(r.float(), ids).dtype == torch.float32


def test_rloo_hand(device: str) -> None:
    # group 3 = [1, 2, 6]: 1 − (2 + 6)/2 = −3, 2 − 7/2 = −1.5, 6 − 3/2 = 4.5; group 8 = [4] alone
    r = t64([1.0, 2.0, 6.0, 4.0, 0.0, 0.5], device)
    ids = torch.tensor([3, 3, 3, 8, 20, 20], device=device)
    close(rloo_advantages(r, ids), [-3.0, -1.5, 4.5, 4.0, -0.5, 0.5])
    close(rloo_advantages(r, ids, singleton="zero"), [-3.0, -1.5, 4.5, 0.0, -0.5, 0.5])
    with pytest.raises(ValueError):
        rloo_advantages(r, ids, singleton="drop")  # type: ignore[arg-type]


def test_group_estimators_random_against_reference(device: str) -> None:
    rng = random.Random(3)
    r = [float(rng.choice([0, 1])) if i % 3 else rng.uniform(-1, 1) for i in range(40)]
    g = [rng.choice([101, -4, 7, 7, 55, 9000]) for _ in range(40)] + [77]  # 77: singleton
    r.append(0.3)
    rt, gt = t64(r, device), torch.tensor(g, device=device)
    for eps in (0.0, 1e-6):
        for ub in (True, False):
            close(grpo_advantages(rt, gt, eps=eps, std_unbiased=ub), ref_grpo(r, g, eps, ub, True), atol=1e-9)
    close(drgrpo_advantages(rt, gt), ref_grpo(r, g, 0.0, True, False))
    close(rloo_advantages(rt, gt), ref_rloo(r, g, False))
    close(rloo_advantages(rt, gt, singleton="zero"), ref_rloo(r, g, True))


def test_group_estimator_validation(device: str) -> None:
    r = t64([1.0, 2.0], device)
    with pytest.raises(ValueError):
        grpo_advantages(r, torch.tensor([0, 0, 1], device=device))
    with pytest.raises(ValueError):
        grpo_advantages(r, torch.tensor([0.0, 1.0], device=device))
    with pytest.raises(ValueError):
        grpo_advantages(t64([[1.0, 2.0]], device), torch.tensor([0], device=device))
    with pytest.raises(ValueError):
        grpo_advantages(r, torch.tensor([0, 0], device=device), eps=-1.0)
    with pytest.raises(TypeError):
        grpo_advantages(r, torch.tensor([0, 0], device=device), epsilon=1e-6)  # type: ignore[call-arg]


# ==============================================================================================================
# REINFORCE++ and whitening
# ==============================================================================================================


def test_masked_whiten_hand(device: str) -> None:
    # valid [1, 3]: mean 2, unbiased var 2 → ±1/√2; masked 99 → 0
    x = t64([1.0, 3.0, 99.0], device)
    m = torch.tensor([1, 1, 0], device=device)
    close(masked_whiten(x, m, eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])
    close(masked_whiten(x, m, eps=0.0, unbiased=False), [-1.0, 1.0, 0.0])  # biased var 1
    close(masked_whiten(x, m, eps=0.0, shift_mean=False), [2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0])
    # one valid element: variance taken as 0 → (x − mean) = 0
    close(masked_whiten(x, torch.tensor([0, 1, 0], device=device)), [0.0, 0.0, 0.0])


def test_reinforce_pp_hand(device: str) -> None:
    # γ = 0.5. Row 0 rewards [0, 0, 1], all valid → returns [0.25, 0.5, 1].
    # Row 1 rewards [0, 2, ·] with mask [1, 1, 0] → returns [1, 2, 0] (padding reward counts as 0).
    # Valid returns [0.25, 0.5, 1, 1, 2]: mean 0.95; deviations −0.7, −0.45, 0.05, 0.05, 1.05;
    # squares sum 1.8 → unbiased var 0.45 → A = (G − 0.95)/sqrt(0.45 + 1e−8).
    r = t64([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]], device)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    adv, ret = reinforce_pp_advantages(r, m, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    sd = math.sqrt(0.45 + 1e-8)
    close(adv, [[(0.25 - 0.95) / sd, (0.5 - 0.95) / sd, 0.05 / sd], [0.05 / sd, 1.05 / sd, 0.0]])
    # verl resets the running return at masked positions: rewards [0, 0, 1], mask [1, 0, 1], γ = 1
    # → G = [0, 1, 1] (t=1 masked: G_1 = 1 then reset, so G_0 = 0); valid G [0, 1] → A = ∓0.5/sqrt(0.5)
    adv, ret = reinforce_pp_advantages(
        t64([[0.0, 0.0, 1.0]], device), torch.tensor([[1, 0, 1]], device=device), eps=0.0
    )
    close(ret, [[0.0, 1.0, 1.0]])
    close(adv, [[-0.5 / math.sqrt(0.5), 0.0, 0.5 / math.sqrt(0.5)]])


def test_reinforce_pp_packed_equals_padded(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 1, 5, 2])
    n = int(lengths.sum())
    r = torch.randn(n, generator=gen, dtype=F64).to(device)
    m = (torch.rand(n, generator=gen) > 0.2).to(device)
    cu = cu_seqlens_from_lengths(lengths).to(device)
    adv_p, ret_p = reinforce_pp_advantages(r, m, gamma=0.9, cu_seqlens=cu)
    keep = torch.arange(5, device=device)[None] < lengths.to(device)[:, None]
    rd = torch.full((4, 5), NAN, dtype=F64, device=device)
    md = torch.zeros(4, 5, dtype=torch.bool, device=device)
    rd[keep], md[keep] = r, m
    adv_d, ret_d = reinforce_pp_advantages(rd, md, gamma=0.9)
    close(adv_p, adv_d[keep])
    close(torch.where(m, ret_p, 0.0), torch.where(m, ret_d[keep], 0.0))


# ==============================================================================================================
# layout helpers and the AReaL pipeline
# ==============================================================================================================


def test_token_helpers(device: str) -> None:
    m = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], device=device)
    close(sequence_to_tokens(t64([2.0, -1.0], device), m), [[0.0, 2.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    close(outcome_to_token_rewards(t64([2.0, 5.0], device), m), [[0.0, 0.0, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    # packed: lengths [3, 2, 1]; masks [1, 1, 0 | 0, 0 | 1]; the middle sequence has no valid token
    cu = torch.tensor([0, 3, 5, 6], device=device)
    mp = torch.tensor([1, 1, 0, 0, 0, 1], device=device)
    close(sequence_to_tokens(t64([1.0, 2.0, 3.0], device), mp, cu_seqlens=cu), [1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    close(outcome_to_token_rewards(t64([1.0, 2.0, 3.0], device), mp, cu_seqlens=cu), [0.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    x = torch.tensor([1, 2, 3, 7, 8, 9], device=device)
    assert roll_to_next_token(x, cu_seqlens=cu).tolist() == [2, 3, 1, 8, 7, 9]
    assert roll_to_next_token(x.view(2, 3)).tolist() == [[2, 3, 1], [8, 9, 7]]


def test_compute_advantages_grpo_style_pipeline(device: str) -> None:
    # Two rollouts of one prompt, AReaL's GRPO example: bias −0.5, scaling 10, kl_ctl 0, γ = λ = 1, no critic,
    # reward_norm group/group (unbiased, eps 1e-5).
    # rewards [1, 0] → shaped [5, −5] → group mean 0, std sqrt(50) → ±5/(√50 + 1e−5).
    # Token rewards: score at index seqlen − 2 = 3; GAE with γ = λ = 1 and V = 0 gives every valid position
    # (and the masked prompt position before them, carried) that score; position 4 (last) gets 0.
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0]], device=device)
    cfg = AdvantageConfig(
        reward_bias=-0.5,
        reward_scaling=10.0,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group"),
    )
    out = compute_advantages(t64([1.0, 0.0], device), mask, group_ids=torch.tensor([3, 3], device=device), config=cfg)
    a = 5 / (math.sqrt(50) + 1e-5)
    close(out["rewards"], [a, -a])
    close(out["advantages"], [[a, a, a, a, 0.0], [-a, -a, -a, -a, 0.0]])
    close(out["tot_rewards"], [[0, 0, 0, a, 0], [0, 0, 0, -a, 0]])
    # adv_norm batch/batch on top: valid advantages {a×3, −a×3}: mean 0, unbiased std a·sqrt(6/5)
    cfg2 = AdvantageConfig(
        reward_bias=-0.5,
        reward_scaling=10.0,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group"),
        adv_norm=NormConfig(),
    )
    out2 = compute_advantages(t64([1.0, 0.0], device), mask, group_ids=torch.tensor([3, 3], device=device), config=cfg2)
    b = a / (a * math.sqrt(6 / 5) + 1e-5)
    close(out2["advantages"], [[0, b, b, b, 0], [0, -b, -b, -b, 0]])


def test_compute_advantages_with_kl_and_overlong(device: str) -> None:
    # One packed sequence of 4 positions, mask [1, 1, 1, 0] (3 generated tokens), max_new_tokens 3,
    # overlong_tokens 2, factor 1: expected length 1, exceed 2 → penalty −1; reward 2 → 1.
    # KL k1 with kl_ctl 0.5: old [−1, −1, −1, ·], ref [−2, −1, 0, ·] → Δ [1, 0, −1] → kl_r [−0.5, 0, 0.5, 0].
    # tot: index 3 → 0, score 1 at index 2 → [−0.5, 0, 1.5, 0]. GAE γ = λ = 1, V = 0: [1.0, 1.5, 1.5, 0].
    cfg = AdvantageConfig(
        overlong_reward_penalty=True, overlong_tokens=2, overlong_penalty_factor=1.0, max_new_tokens=3, kl_ctl=0.5
    )
    out = compute_advantages(
        t64([2.0], device),
        torch.tensor([1, 1, 1, 0], device=device),
        old_logp=t64([-1.0, -1.0, -1.0, NAN], device),
        ref_logp=t64([-2.0, -1.0, 0.0, NAN], device),
        cu_seqlens=torch.tensor([0, 4], device=device),
        config=cfg,
    )
    close(out["rewards"], [1.0])
    close(out["kl_rewards"], [-0.5, 0.0, 0.5, 0.0])
    close(out["tot_rewards"], [-0.5, 0.0, 1.5, 0.0])
    close(out["advantages"], [1.0, 1.5, 1.5, 0.0])
    close(out["returns"], [1.0, 1.5, 1.5, 0.0])


def test_advantage_config_validation() -> None:
    with pytest.raises(ValueError):
        AdvantageConfig(overlong_reward_penalty=True)
    with pytest.raises(ValueError):
        AdvantageConfig(kl_estimator="k9")
    with pytest.raises(TypeError):
        AdvantageConfig(adv_norm={"mean_level": "batch"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AdvantageConfig(gamma=1.0)  # type: ignore[call-arg]


def test_token_weighted_grpo_advantages_equal_areal_token_normalisation(device: str) -> None:
    from grpo_cli.core.advantages import token_weighted_grpo_advantages

    # Hand value: scores [1, 0] over 3 and 1 tokens: tokens [1, 1, 1, 0], mean 0.75, unbiased std
    # sqrt((3·0.0625 + 0.5625)/3) = 0.5 → [0.25/0.5, −0.75/0.5].
    one = token_weighted_grpo_advantages(t64([1.0, 0.0], device), torch.tensor([0, 0], device=device),
                                         torch.tensor([3, 1], device=device), eps=0.0)
    close(one, [0.5, -1.5])
    # Against AReaL's token-level normalisation on the broadcast tokens: non-contiguous groups, a one-row group
    # (output 0) and a one-token group member.
    scores = t64([1.0, 0.0, 0.5, 2.0, 1.0, 3.0], device)
    group = torch.tensor([0, 1, 0, 1, 2, 0], device=device)
    n_tokens = torch.tensor([4, 2, 1, 5, 3, 2], device=device)
    got = token_weighted_grpo_advantages(scores, group, n_tokens)
    tokens = scores.repeat_interleave(n_tokens)
    cfg = NormConfig(mean_level="group", std_level="group", eps=1e-5)
    per_token = normalize(tokens, config=cfg, group_ids=group, cu_seqlens=cu_seqlens_from_lengths(n_tokens))
    starts = torch.cumsum(n_tokens, 0) - n_tokens
    close(got, per_token.index_select(0, starts), atol=1e-12, rtol=1e-9)
    assert got[4].item() == 0.0
