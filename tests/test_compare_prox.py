"""`compare-prox`: the streaming core against hand-derived values and an independent float64 reference, batch
independence, the CLI (formats, exit codes) and the sample data.

The reference below is written from the definitions (AReaL's approximation, ``ppo_actor_loss_fn`` and
``apply_rejection_sampling`` in AReaL's ``areal/utils/functional/functional.py`` and
``compute_prox_logp_approximations`` in ``areal/trainer/ppo/actor.py``) with plain Python loops and
``math``; it never calls grpo_cli.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from pathlib import Path

import pytest
import torch
from reference import Seq, write_sequences

from grpo_cli.cli import main
from grpo_cli.core.prox_compare import (
    P99_REL_ERROR_BOUND,
    max_safe_lag,
    prox_compare_compute,
    prox_compare_fold,
    prox_compare_prepare,
    prox_compare_state,
    prox_compare_update,
    rejection_changes,
)
from grpo_cli.core.rejection import RejectionSamplingConfig

METHODS = ("loglinear", "linear", "rollout")
SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "rollouts.parquet"


# ------------------------------------------------------------------------------------------------------------
# independent float64 reference (plain Python)
# ------------------------------------------------------------------------------------------------------------


def ref_alpha(vb: float, vt: float) -> float:
    """AReaL ``compute_prox_logp_approximations``:
    α = (v_θ − 1 − v_b)/(v_θ − v_b) where v_θ − v_b > 0 and v_b ≥ 0, else 0; clamped to [0, 1]."""
    if vb < 0 or vt - vb <= 0:
        return 0.0
    return min(max((vt - 1 - vb) / (vt - vb), 0.0), 1.0)


def ref_approx(method: str, b: float, th: float, a: float) -> float:
    if method == "loglinear":
        return b + a * (th - b) if a > 0 else b
    if method == "linear":
        return math.log((1 - a) * math.exp(b) + (a * math.exp(th) if a > 0 else 0.0) + 1e-10)
    return b


def ref_rs(
    seq_p: list[float], seq_b: list[float], valid: list[bool], rs: dict
) -> tuple[list[bool], list[float], list[bool]]:
    """AReaL ``apply_rejection_sampling`` for metric 'ratio': (kept mask, weight, changed) per token of one sequence."""
    lo, up = rs.get("lower"), rs.get("upper", 5.0)
    action, level = rs.get("action", "mask"), rs.get("level", "token")
    n = len(seq_p)
    if level == "sequence":
        idx = [t for t in range(n) if valid[t]]
        mean = sum(seq_p[t] - seq_b[t] for t in idx) / max(len(idx), 1)
        w = [math.exp(mean)] * n
        metric = [math.exp(mean)] * n  # agg = mean: the geometric mean ratio
    else:
        w = [math.exp(seq_p[t] - seq_b[t]) for t in range(n)]
        metric = list(w)
    inside = [(metric[t] <= up) if lo is None else (lo <= metric[t] <= up) for t in range(n)]
    if action == "mask":
        kept = [valid[t] and inside[t] for t in range(n)]
        changed = [valid[t] and not inside[t] for t in range(n)]
        weight = [w[t] if kept[t] else 0.0 for t in range(n)]
        return kept, weight, changed
    low = 0.0 if lo is None else lo
    clamped = [w[t] if inside[t] else min(max(w[t], low), up) for t in range(n)]
    if level == "token":
        clamped = [min(max(w[t], low), up) for t in range(n)]
    changed = [valid[t] and clamped[t] != w[t] for t in range(n)]
    return list(valid), [clamped[t] if valid[t] else 0.0 for t in range(n)], changed


def ref_ppo_token(
    th: float, p: float, a: float, eps: float, eps_hi: float, c_clip: float | None
) -> tuple[float, bool, bool]:
    """AReaL ``ppo_actor_loss_fn``, token level: (L, clip, dual)."""
    r = math.exp(th - p)
    rc = min(max(r, 1 - eps), 1 + eps_hi)
    l1, l2 = -a * r, -a * rc
    clip = l1 < l2
    loss = max(l1, l2)
    dual = False
    if c_clip is not None:
        l3 = math.copysign(1.0, a) * c_clip * a if a != 0 else 0.0
        dual = l3 < loss
        loss = min(loss, l3)
    return loss, clip, dual


def ref_figures(seqs: list[dict], *, eps=0.2, eps_hi=None, c_clip=None, rs=None, max_lag=32, tol=0.01) -> dict:
    """Every compare-prox figure by its definition, in float64."""
    eps_hi = eps if eps_hi is None else eps_hi
    out: dict = {}
    n0 = 0
    loss_truth = 0.0
    per: dict = {m: {"err": [], "rel": [], "sq": [], "bw": [], "bwr": [], "iw": [], "iwr": [], "clip": 0,
                     "rs": 0, "loss": 0.0, "lags": []} for m in METHODS}
    all_lags = []
    for s in seqs:
        n = len(s["new"])
        valid = [bool(x) for x in s["mask"]]
        vt = s["cv"]
        prox_hat = {m: [ref_approx(m, s["old"][t], s["new"][t], ref_alpha(s["versions"][t], vt)) for t in range(n)]
                    for m in METHODS}
        truth = s["prox"]
        n0 += sum(valid)
        rs_truth = ref_rs(truth, s["old"], valid, rs) if rs else None
        for t in range(n):
            if not valid[t]:
                continue
            lt, ct, dt = ref_ppo_token(s["new"][t], truth[t], s["adv"], eps, eps_hi, c_clip)
            if rs_truth is None:
                loss_truth += lt
            elif rs_truth[0][t]:
                loss_truth += lt * rs_truth[1][t]
        for m in METHODS:
            ph = prox_hat[m]
            rs_m = ref_rs(ph, s["old"], valid, rs) if rs else None
            d = per[m]
            for t in range(n):
                if not valid[t]:
                    continue
                lm, cm, dm = ref_ppo_token(s["new"][t], ph[t], s["adv"], eps, eps_hi, c_clip)
                if rs_m is None:
                    d["loss"] += lm
                elif rs_m[0][t]:
                    d["loss"] += lm * rs_m[1][t]
                if s["versions"][t] < 0:
                    continue  # errors, flips and lags: valid *generated* tokens only
                _, ct, dt = ref_ppo_token(s["new"][t], truth[t], s["adv"], eps, eps_hi, c_clip)
                tr, b, th = truth[t], s["old"][t], s["new"][t]
                e = abs(tr - ph[t])
                d["err"].append(e)
                d["rel"].append(e / (abs(tr) + 1e-8))
                d["sq"].append((tr - ph[t]) ** 2)
                w_t, w_a = math.exp(tr - b), math.exp(ph[t] - b)
                d["bw"].append(abs(w_t - w_a))
                d["bwr"].append(abs(w_t - w_a) / (abs(w_t) + 1e-8))
                r_t, r_a = math.exp(th - tr), math.exp(th - ph[t])
                d["iw"].append(abs(r_t - r_a))
                d["iwr"].append(abs(r_t - r_a) / (abs(r_t) + 1e-8))
                flip = (ct != cm) or (dt != dm)
                d["clip"] += flip
                if rs:
                    d["rs"] += rs_truth[2][t] != rs_m[2][t]
                lag = vt - s["versions"][t]
                d["lags"].append((lag, e, (tr - ph[t]) ** 2, flip))
                if m == METHODS[0]:
                    all_lags.append(lag)
    n = len(all_lags)
    out["n_valid_tokens"] = n0
    out["prox/n_tokens"] = n
    out["prox/loss_ppo"] = loss_truth / n0
    for m in METHODS:
        d = per[m]
        p = f"prox/{m}/"
        out[p + "abs_error_mean"] = sum(d["err"]) / n
        out[p + "abs_error_max"] = max(d["err"])
        srt = sorted(d["err"])
        out[p + "abs_error_p99_exact"] = srt[math.ceil(99 * n / 100) - 1]  # nearest rank
        out[p + "rel_error_mean"] = sum(d["rel"]) / n
        out[p + "rmse"] = math.sqrt(sum(d["sq"]) / n)
        out[p + "behave_imp_weight_abs_error_mean"] = sum(d["bw"]) / n
        out[p + "behave_imp_weight_rel_error_mean"] = sum(d["bwr"]) / n
        out[p + "importance_weight_abs_error_mean"] = sum(d["iw"]) / n
        out[p + "importance_weight_rel_error_mean"] = sum(d["iwr"]) / n
        out[p + "clip_flip_frac"] = d["clip"] / n
        if rs:
            out[p + "behave_weight_flip_frac"] = d["rs"] / n
        loss = d["loss"] / n0
        out[p + "loss_ppo"] = loss
        out[p + "loss_abs_error"] = abs(loss - out["prox/loss_ppo"])
        out[p + "loss_rel_error"] = abs(loss - out["prox/loss_ppo"]) / (abs(out["prox/loss_ppo"]) + 1e-8)
        # rows: lags 0..max_lag − 1 one each, then lags ≥ max_lag pooled, then negative lags pooled
        buckets: dict = {}
        for lag, e, sq, flip in d["lags"]:
            key = "neg" if lag < 0 else ("over" if lag >= max_lag else lag)
            buckets.setdefault(key, []).append((lag, e, sq, flip))
        rows = []
        order = sorted(k for k in buckets if isinstance(k, int))
        order += [k for k in ("over", "neg") if k in buckets]
        for key in order:
            items = buckets[key]
            if key == "neg":
                label = {"lag": -1, "underflow": True}
            elif key == "over":
                label = {"lag": max_lag, "overflow": True, "lag_max": max(x[0] for x in items)}
            else:
                label = {"lag": key}
            rows.append({
                **label,
                "n_tokens": len(items),
                "abs_error_mean": sum(x[1] for x in items) / len(items),
                "rmse": math.sqrt(sum(x[2] for x in items) / len(items)),
                "clip_flip_frac": sum(x[3] for x in items) / len(items),
            })
        out[p + "by_staleness"] = rows
        safe = None  # the largest k ≥ 1 with every observed lag in [1, k] under tol
        for row in rows:
            if row.get("underflow") or row["lag"] < 1:
                continue
            if not row["abs_error_mean"] <= tol:
                break
            safe = row.get("lag_max", row["lag"])
        out[p + "max_safe_lag"] = safe
    return out


def random_seqs(n_seq: int, seed: int, *, max_lag_drawn: int = 6, negative: bool = True) -> list[dict]:
    """Plausible sequences: prompt tokens (masked, one sometimes in the loss), lags from −1 (``negative``: a
    version newer than the trainer's, which the CLI's validation rejects) or 0 to ``max_lag_drawn``."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(n_seq):
        n = rng.randint(1, 14)
        prompt = rng.randint(0, min(3, n - 1))
        cv = rng.randint(0, 9)
        new = [-rng.expovariate(1.0) for _ in range(n)]
        old = [min(x + rng.gauss(0, 0.4), 0.0) for x in new]
        versions, prox = [], []
        for t in range(n):
            if t < prompt:
                versions.append(-1)
                prox.append(old[t])
                continue
            v = max(cv - rng.randint(-1 if negative else 0, max_lag_drawn), 0)
            versions.append(v)
            a_true = min(max(cv - v, 0), 8) / 9  # truth moves further from old with staleness, plus noise
            prox.append(min(old[t] + a_true * (new[t] - old[t]) + rng.gauss(0, 0.05), 0.0))
        mask = [0] * prompt + [1] * (n - prompt)
        if prompt and rng.random() < 0.3:
            mask[0] = 1  # a prompt token inside the loss mask: in the loss, out of the error figures
        seqs.append({"new": new, "old": old, "prox": prox, "versions": versions, "mask": mask,
                     "adv": rng.choice([-1.0, 1.0]) * rng.random() * 2, "cv": cv})
    return seqs


def packed(seqs: list[dict], dtype=torch.float64, device: str = "cpu") -> dict:
    cat = lambda key: [x for s in seqs for x in s[key]]  # noqa: E731
    lengths = [len(s["new"]) for s in seqs]
    cu = torch.tensor([0, *itertools_accumulate(lengths)], dtype=torch.int64, device=device)
    return {
        "new_logp": torch.tensor(cat("new"), dtype=dtype, device=device),
        "old_logp": torch.tensor(cat("old"), dtype=dtype, device=device),
        "prox_logp": torch.tensor(cat("prox"), dtype=dtype, device=device),
        "versions": torch.tensor(cat("versions"), dtype=torch.int64, device=device),
        "loss_mask": torch.tensor(cat("mask"), dtype=torch.bool, device=device),
        "advantages": torch.tensor([s["adv"] for s in seqs for _ in s["new"]], dtype=dtype, device=device),
        "current_version": torch.tensor([s["cv"] for s in seqs], dtype=torch.int64, device=device),
        "cu_seqlens": cu,
    }


def itertools_accumulate(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def run_core(seqs, *, chunks=1, device="cpu", max_lag=32, tol=0.01, rs=None, **loss):
    """Fold ``seqs`` in ``chunks`` consecutive slices of whole sequences, merging the per-chunk states."""
    cfg = RejectionSamplingConfig(**rs) if rs else None
    merged = None
    size = math.ceil(len(seqs) / chunks)
    for i in range(0, len(seqs), size):
        state = prox_compare_state(METHODS, max_lag=max_lag, device=device)
        prox_compare_update(state, **packed(seqs[i:i + size], device=device), rejection_sampling=cfg, **loss)
        merged = state if merged is None else merged.merge_(state)
    return prox_compare_compute(merged, tolerance=tol)


def assert_matches(got: dict, ref: dict, *, rel=1e-9, abs_=1e-12, flip_abs=0.0) -> None:
    for key, want in ref.items():
        if key.endswith("_p99_exact"):
            p99 = got[key.removesuffix("_exact")]
            assert abs(p99 - want) <= P99_REL_ERROR_BOUND * want, key
            continue
        assert key in got, key
        if key.endswith("by_staleness"):
            label = ("lag", "overflow", "underflow", "lag_max", "n_tokens")
            assert [[r.get(f) for f in label] for r in got[key]] == [[r.get(f) for f in label] for r in want], key
            for g, w in zip(got[key], want):
                for field in ("abs_error_mean", "rmse"):
                    assert g[field] == pytest.approx(w[field], rel=rel, abs=abs_), (key, field)
                assert g["clip_flip_frac"] == pytest.approx(w["clip_flip_frac"], abs=flip_abs + 1e-15), key
        elif key.endswith("flip_frac"):
            assert got[key] == pytest.approx(want, abs=flip_abs + 1e-15), key
        elif isinstance(want, float):
            assert got[key] == pytest.approx(want, rel=rel, abs=abs_), key
        else:
            assert got[key] == want, key


# ------------------------------------------------------------------------------------------------------------
# hand-derived values
# ------------------------------------------------------------------------------------------------------------


def hand_batch(device: str = "cpu") -> dict:
    """Two sequences with per-sequence current versions 5 and 2 (tokens t0..t5; ε = 0.2).

    seq A (v_θ = 5, A = +1): t0 prompt, masked, NaN/−inf garbage; t1 v_b 3 (lag 2, α = ½): ℓb −2, ℓθ −1, ℓp* −1.1;
                             t2 v_b 4 (lag 1, α = 0): ℓb −1, ℓθ −0.5, ℓp* −1.
    seq B (v_θ = 2, A = −1): t3 prompt inside the loss mask (v_b −1): ℓb = ℓθ = ℓp* = −1;
                             t4 v_b 0 (lag 2, α = ½): ℓb −3, ℓθ −1, ℓp* −2.5;
                             t5 v_b 3 (lag −1, α = 0): ℓb −0.5, ℓθ −0.5, ℓp* −0.7.
    """
    f = lambda xs: torch.tensor(xs, dtype=torch.float64, device=device)  # noqa: E731
    nan, ninf = math.nan, -math.inf
    return {
        "new_logp": f([nan, -1.0, -0.5, -1.0, -1.0, -0.5]),
        "old_logp": f([ninf, -2.0, -1.0, -1.0, -3.0, -0.5]),
        "prox_logp": f([nan, -1.1, -1.0, -1.0, -2.5, -0.7]),
        "versions": torch.tensor([-1, 3, 4, -1, 0, 3], device=device),
        "loss_mask": torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool, device=device),
        "advantages": f([1.0, 1.0, 1.0, -1.0, -1.0, -1.0]),
        "current_version": torch.tensor([5, 2], device=device),
        "cu_seqlens": torch.tensor([0, 3, 6], device=device),
    }


def test_hand_derived_errors_lags_and_verdict(device):
    state = prox_compare_state(("loglinear", "rollout"), max_lag=8, device=device)
    prox_compare_update(state, **hand_batch(device))
    out = prox_compare_compute(state, tolerance=0.3)
    # Compared tokens (valid ∧ v_b ≥ 0): t1, t2, t4, t5 → n = 4; t3 (prompt in the loss) is not compared.
    assert out["prox/n_tokens"] == 4 and out["n_valid_tokens"] == 5
    # loglinear ℓp̂: t1 −2 + ½·1 = −1.5, t2 −1 (α = 0), t4 −3 + ½·2 = −2, t5 −0.5 (lag −1: α = 0)
    # |d|: 0.4, 0, 0.5, 0.2 → mean 1.1/4; max 0.5; d²: 0.16 + 0 + 0.25 + 0.04 = 0.45 → rmse √(0.45/4)
    assert out["prox/loglinear/abs_error_mean"] == pytest.approx(1.1 / 4, abs=1e-12)
    assert out["prox/loglinear/abs_error_max"] == pytest.approx(0.5, abs=1e-12)
    assert out["prox/loglinear/rmse"] == pytest.approx(math.sqrt(0.45 / 4), abs=1e-12)
    # rel: 0.4/1.1, 0, 0.5/2.5, 0.2/0.7 (the 1e−8 changes nothing at this precision)
    rel = (0.4 / 1.1 + 0 + 0.2 + 0.2 / 0.7) / 4
    assert out["prox/loglinear/rel_error_mean"] == pytest.approx(rel, rel=1e-7)
    # rollout ℓp̂ = ℓb: |d| 0.9, 0, 0.5, 0.2 → mean 0.4, max 0.9, rmse √((0.81 + 0.25 + 0.04)/4)
    assert out["prox/rollout/abs_error_mean"] == pytest.approx(0.4, abs=1e-12)
    assert out["prox/rollout/abs_error_max"] == pytest.approx(0.9, abs=1e-12)
    assert out["prox/rollout/rmse"] == pytest.approx(math.sqrt(1.1 / 4), abs=1e-12)
    # behaviour weight w = exp(ℓp − ℓb) at t1: truth e^0.9, loglinear e^0.5; others: t2 equal, t4 e^0.5 vs e^1,
    # t5 e^−0.2 vs 1
    bw = (abs(math.exp(0.9) - math.exp(0.5)) + 0 + abs(math.exp(0.5) - math.e) + abs(math.exp(-0.2) - 1)) / 4
    assert out["prox/loglinear/behave_imp_weight_abs_error_mean"] == pytest.approx(bw, rel=1e-12)
    # by lag (v_θ − v_b): lag 1 {t2}, lag 2 {t1, t4}, then the negative-lag row {t5} (analyze's order)
    rows = out["prox/loglinear/by_staleness"]
    assert [(r["lag"], r.get("underflow", False), r["n_tokens"]) for r in rows] == [
        (1, False, 1), (2, False, 2), (-1, True, 1)]
    assert [r["abs_error_mean"] for r in rows] == pytest.approx([0.0, 0.45, 0.2], abs=1e-12)
    assert rows[1]["rmse"] == pytest.approx(math.sqrt((0.16 + 0.25) / 2), abs=1e-12)
    assert [r["abs_error_mean"] for r in out["prox/rollout/by_staleness"]] == pytest.approx([0, 0.7, 0.2], abs=1e-12)
    # verdict at T = 0.3: lag 1 (0) passes, lag 2 fails for both → 1; at T = 0.5 loglinear reaches 2
    assert out["prox/loglinear/max_safe_lag"] == 1 and out["prox/rollout/max_safe_lag"] == 1
    assert prox_compare_compute(state, tolerance=0.5)["prox/loglinear/max_safe_lag"] == 2
    assert prox_compare_compute(state, tolerance=0.5)["prox/rollout/max_safe_lag"] == 1
    # p99 of four values is the largest (rank ⌈3.96⌉ = 4): 0.5, read from the histogram within its bound
    assert abs(out["prox/loglinear/abs_error_p99"] - 0.5) <= P99_REL_ERROR_BOUND * 0.5
    # Clip decisions (ε = 0.2), A = +1 on seq A: t1 truth r = e^0.1 = 1.105 (not clipped), loglinear r = e^0.5
    # and rollout r = e^1 (clipped) → a flip each; t2 r = e^0.5 everywhere (clipped, no flip).
    # A = −1 on seq B: clipping needs r < 0.8; t4 r = e^1.5 / e^1 / e^2, t5 e^0.2 / 1: never clipped.
    assert out["prox/loglinear/clip_flip_frac"] == pytest.approx(1 / 4)
    assert out["prox/rollout/clip_flip_frac"] == pytest.approx(1 / 4)
    assert [r["clip_flip_frac"] for r in rows] == pytest.approx([0.0, 0.5, 0.0])
    # loss/ppo = Σ L / N0, N0 = 5 valid tokens (t3 included). Truth: t1 −e^0.1 (unclipped), t2 −1.2 (clipped),
    # t3 +1 (r = 1, A = −1), t4 +e^1.5, t5 +e^0.2 (L = max(−A·r, −A·1.2) = r for A = −1, r > 1.2)
    truth = (-math.exp(0.1) - 1.2 + 1 + math.exp(1.5) + math.exp(0.2)) / 5
    assert out["prox/loss_ppo"] == pytest.approx(truth, rel=1e-12)
    # loglinear: t1 −1.2, t2 −1.2, t3 1, t4 e^1, t5 max(1, 1.2·1)?  A = −1: L1 = r = 1, L2 = clip(1) = 1 → 1
    approx = (-1.2 - 1.2 + 1 + math.e + 1) / 5
    assert out["prox/loglinear/loss_ppo"] == pytest.approx(approx, rel=1e-12)
    assert out["prox/loglinear/loss_abs_error"] == pytest.approx(abs(approx - truth), rel=1e-12)
    assert out["prox/loglinear/loss_rel_error"] == pytest.approx(abs(approx - truth) / (abs(truth) + 1e-8))
    assert all(math.isfinite(v) for k, v in out.items() if isinstance(v, float)), "masked NaN leaked"


def test_hand_derived_dual_clip_and_rejection_flips(device):
    state = prox_compare_state(("loglinear", "rollout"), device=device)
    rs = RejectionSamplingConfig(upper=2.0)  # token, mask, ratio
    prox_compare_update(state, **hand_batch(device), c_clip=3.0, rejection_sampling=rs)
    out = prox_compare_compute(state)
    # Dual clip c = 3 (A = −1): t4 truth r = e^1.5 = 4.48 > 3 (dual), loglinear r = e = 2.72 (not dual) → flip;
    # rollout r = e^2 = 7.39 (dual) → no flip. Plus the t1 clip flips: loglinear 2/4, rollout 1/4.
    assert out["prox/loglinear/clip_flip_frac"] == pytest.approx(2 / 4)
    assert out["prox/rollout/clip_flip_frac"] == pytest.approx(1 / 4)
    # Rejection (w = exp(ℓp − ℓb) ≤ 2 kept): truth drops t1 (e^0.9 = 2.46) and keeps t4 (e^0.5 = 1.65);
    # loglinear keeps t1 (e^0.5) and drops t4 (e^1) → 2 flips; rollout (w = 1) keeps both → 1 flip (t1).
    assert out["prox/loglinear/behave_weight_flip_frac"] == pytest.approx(2 / 4)
    assert out["prox/rollout/behave_weight_flip_frac"] == pytest.approx(1 / 4)


def test_alpha_zero_edges_and_current_version_forms(device):
    """Lag 1, lag 0, negative lag and prompt tokens all give α = 0: every method equals ℓb there (linear up to
    its 1e−10), so rollout, loglinear and linear report the same error; an int, per-sequence and per-token
    current version agree."""
    b = hand_batch(device)
    b["versions"] = torch.tensor([-1, 4, 5, -1, 4, 6], device=device)  # lags 1, 0 | prompt, 1, −1
    outs = []
    for cv in (5, torch.tensor([5, 5], device=device), torch.full((6,), 5, device=device)):
        state = prox_compare_state(device=device)
        prox_compare_update(state, **{**b, "current_version": cv})
        outs.append(prox_compare_compute(state))
    for other in outs[1:]:
        assert other == outs[0]
    out = outs[0]
    assert out["prox/loglinear/abs_error_mean"] == out["prox/rollout/abs_error_mean"]
    assert out["prox/linear/abs_error_mean"] == pytest.approx(out["prox/rollout/abs_error_mean"], abs=1e-8)
    # With v_θ = 5 for both sequences: |d| = |ℓp* − ℓb| = 0.9, 0, 0.5, 0.2 (t1, t2, t4, t5) → 1.6/4
    assert out["prox/rollout/abs_error_mean"] == pytest.approx(0.4, abs=1e-12)


@pytest.mark.parametrize("level, rs", [
    ("token", None),
    ("sequence", None),
    ("token", {"level": "sequence", "upper": 1.2}),
    ("sequence", {"action": "clamp", "upper": 1.3, "lower": 0.9}),
])
def test_exact_approximation_changes_nothing(level, rs, device):
    """When the truth *is* the loglinear interpolation (ℓp* = ℓb + α(ℓθ − ℓb), α written out below), loglinear
    has zero error, no flip and the truth's loss, at token or GSPO sequence level and under any rejection sampling;
    rollout then differs exactly where α > 0."""
    seqs = random_seqs(30, seed=9, negative=False)
    for s in seqs:
        s["prox"] = [
            b + ref_alpha(v, s["cv"]) * (th - b) if ref_alpha(v, s["cv"]) > 0 else b
            for b, th, v in zip(s["old"], s["new"], s["versions"])
        ]
    out = run_core(seqs, device=device, rs=rs, importance_sampling_level=level, c_clip=2.0)
    for key in ("abs_error_mean", "abs_error_max", "abs_error_p99", "rmse", "clip_flip_frac", "loss_abs_error"):
        assert out[f"prox/loglinear/{key}"] == pytest.approx(0.0, abs=1e-12), key
    if rs:
        assert out["prox/loglinear/behave_weight_flip_frac"] == 0.0
    assert out["prox/loglinear/loss_ppo"] == pytest.approx(out["prox/loss_ppo"], rel=1e-12)
    stale = sum(1 for s in seqs for t, v in enumerate(s["versions"]) if s["mask"][t] and v >= 0 and s["cv"] - v >= 2)
    assert stale > 0 and out["prox/rollout/abs_error_mean"] > 0.01
    assert out["prox/rollout/max_safe_lag"] == 1 and out["prox/loglinear/max_safe_lag"] == max(
        s["cv"] - v for s in seqs for t, v in enumerate(s["versions"]) if s["mask"][t] and v >= 0)


def test_padded_equals_packed(device):
    seqs = random_seqs(12, seed=3)
    flat = run_core(seqs, device=device)
    width = max(len(s["new"]) for s in seqs)
    pad = lambda key, fill: [s[key] + [fill] * (width - len(s[key])) for s in seqs]  # noqa: E731
    state = prox_compare_state(device=device)
    prox_compare_update(
        state,
        new_logp=torch.tensor(pad("new", math.nan), dtype=torch.float64, device=device),
        old_logp=torch.tensor(pad("old", -math.inf), dtype=torch.float64, device=device),
        prox_logp=torch.tensor(pad("prox", math.nan), dtype=torch.float64, device=device),
        versions=torch.tensor(pad("versions", 7), device=device),
        loss_mask=torch.tensor(pad("mask", 0), device=device),
        advantages=torch.tensor([[s["adv"]] * width for s in seqs], dtype=torch.float64, device=device),
        current_version=torch.tensor([s["cv"] for s in seqs], device=device),
    )
    padded = prox_compare_compute(state)
    assert_same_figures(padded, flat)


def assert_same_figures(got: dict, want: dict) -> None:
    """Equal keys and values; floats (also inside by_staleness rows) to float64 summation-order precision."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        elif isinstance(value, list):
            assert len(got[key]) == len(value), key
            for a, b in zip(got[key], value):
                assert a == pytest.approx(b, rel=1e-12, abs=1e-15), key
        else:
            assert got[key] == value, key


# ------------------------------------------------------------------------------------------------------------
# independent reference on random data; batch independence
# ------------------------------------------------------------------------------------------------------------

CONFIGS = [
    {},
    {"eps_hi": 0.28, "c_clip": 3.0, "rs": {"upper": 1.3}},
    {"rs": {"level": "sequence", "upper": 1.2, "lower": 0.9}},
    {"eps": 0.1, "rs": {"action": "clamp", "upper": 1.4, "lower": 0.8}},
    {"rs": {"level": "sequence", "action": "clamp", "upper": 1.2}},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_random_against_reference(cfg, device):
    seqs = random_seqs(80, seed=11)
    eps = cfg.get("eps", 0.2)
    ref = ref_figures(seqs, eps=eps, eps_hi=cfg.get("eps_hi"), c_clip=cfg.get("c_clip"), rs=cfg.get("rs"),
                      max_lag=3, tol=0.05)
    got = run_core(seqs, device=device, max_lag=3, tol=0.05, rs=cfg.get("rs"), eps_clip=eps,
                   eps_clip_higher=cfg.get("eps_hi"), c_clip=cfg.get("c_clip"))
    assert_matches(got, ref)
    # the data really spans the bins: single lags 0..2, an overflow row (lags ≥ 3) and a negative-lag row
    rows = got["prox/rollout/by_staleness"]
    assert [r["lag"] for r in rows] == [0, 1, 2, 3, -1] and rows[3]["overflow"] and rows[3]["lag_max"] > 3
    assert rows[4]["underflow"]
    if "rs" in cfg:
        assert 0 < got["prox/rollout/behave_weight_flip_frac"] < 1
    assert 0 < got["prox/rollout/clip_flip_frac"] < 1


@pytest.mark.parametrize("chunks", [2, 7, 80])
def test_batch_size_independence(chunks):
    seqs = random_seqs(80, seed=5)
    rs = {"level": "sequence", "upper": 1.3}
    whole = run_core(seqs, rs=rs, c_clip=2.5)
    split = run_core(seqs, chunks=chunks, rs=rs, c_clip=2.5)
    assert_same_figures(split, whole)


def test_one_prepared_batch_folded_per_method_equals_one_update():
    # compare-prox folds a shared prepared batch into one state per method (one metric group each, in threads):
    # every state holds the shared counts and its method's figures, exactly as one state of all methods would.
    seqs = random_seqs(30, seed=12)
    batch = packed(seqs)
    rs = RejectionSamplingConfig(upper=1.5)
    whole = prox_compare_state(METHODS, max_lag=8)
    prox_compare_update(whole, **batch, c_clip=3.0, rejection_sampling=rs)
    prepared = prox_compare_prepare(**batch, c_clip=3.0, rejection_sampling=rs, max_lag=8, methods=METHODS)
    for m in METHODS:
        state = prox_compare_state([m], max_lag=8)
        prox_compare_fold(state, prepared)
        for name in state:
            assert torch.equal(state[name], whole[name]), (m, name)
    with pytest.raises(ValueError, match="max_lag"):
        prox_compare_fold(prox_compare_state(METHODS, max_lag=4), prepared)
    only_one = prox_compare_prepare(**batch, max_lag=8, methods=["loglinear"])
    with pytest.raises(ValueError, match="linear"):
        prox_compare_fold(prox_compare_state(["linear"], max_lag=8), only_one)


def test_p99_histogram_bound_and_edges():
    # Values spread over 9 decades: the histogram p99 is within its stated bound of the exact nearest-rank p99.
    rng = random.Random(2)
    for n in (1, 99, 100, 101, 1000, 4321):
        values = [10 ** rng.uniform(-8, 2) for _ in range(n)]
        state = prox_compare_state(("rollout",))
        z = torch.zeros(n, dtype=torch.float64)
        # rollout ℓp̂ = ℓb = 0 at lag 1, so |error| = |ℓp*|: feed the values as −ℓp*
        prox_compare_update(state, new_logp=z, old_logp=z, prox_logp=-torch.tensor(values, dtype=torch.float64),
                            versions=torch.zeros(n, dtype=torch.int64), current_version=1,
                            cu_seqlens=torch.tensor([0, n]))
        got = prox_compare_compute(state)["prox/rollout/abs_error_p99"]
        exact = sorted(values)[math.ceil(99 * n / 100) - 1]
        assert abs(got - exact) <= P99_REL_ERROR_BOUND * exact, n
    assert 0.0039 < P99_REL_ERROR_BOUND < 0.004  # the shared histogram's 2^−8 + 2^−24
    # all-zero errors have their own bin and report exactly 0
    state = prox_compare_state(("rollout",))
    z = torch.zeros(3, dtype=torch.float64)
    prox_compare_update(state, new_logp=z, old_logp=z, prox_logp=z, versions=torch.zeros(3, dtype=torch.int64),
                        current_version=1, cu_seqlens=torch.tensor([0, 3]))
    out = prox_compare_compute(state)
    assert out["prox/rollout/abs_error_p99"] == 0.0 and out["prox/rollout/abs_error_max"] == 0.0


def test_max_safe_lag_rules():
    row = lambda lag, err, **extra: {"lag": lag, "abs_error_mean": err, **extra}  # noqa: E731
    rows = [row(0, 9.0), row(1, 0.0), row(2, 0.01), row(3, 0.02), row(-1, 9.0, underflow=True)]
    assert max_safe_lag(rows, 0.01) == 2  # lag 0 and negative lags are outside the verdict; ≤ is safe
    assert max_safe_lag([row(1, 0.5), row(2, 0.0)], 0.01) is None  # the smallest lag ≥ 1 fails: no verdict
    assert max_safe_lag([row(2, 0.0), row(5, 0.0), row(64, 0.001, overflow=True, lag_max=70)], 0.01) == 70
    assert max_safe_lag([row(1, 0.0), row(2, math.nan)], 0.01) == 1  # NaN is not under the tolerance
    assert max_safe_lag([row(0, 0.0)], 0.01) is None


def test_rejection_changes_clamp_by_hand():
    prox, old = torch.tensor([0.0, 1.0, -1.0, 0.2]), torch.zeros(4)
    mask = torch.tensor([True, True, True, False])
    # token clamp to [0.5, 2]: w = 1, e, e^−1 = 0.37, (masked) → truncated: e (to 2) and 0.37 (to 0.5)
    cfg = RejectionSamplingConfig(action="clamp", upper=2.0, lower=0.5)
    assert rejection_changes(prox, old, mask, None, cfg).tolist() == [False, True, True, False]
    # sequence clamp: one sequence, geometric mean exp((0 + 1 − 1)/3) = 1 is in bounds → nothing changes
    cfg = RejectionSamplingConfig(level="sequence", action="clamp", upper=2.0, lower=0.5)
    assert not rejection_changes(prox, old, mask, torch.tensor([0, 4]), cfg).any()


def test_core_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown proximal"):
        prox_compare_state(("bogus",))
    with pytest.raises(ValueError, match="max_lag"):
        prox_compare_state(max_lag=-1)
    state = prox_compare_state()
    b = hand_batch()
    b.pop("cu_seqlens")
    with pytest.raises(ValueError, match="cu_seqlens"):
        prox_compare_update(state, **b)
    with pytest.raises(ValueError, match="tolerance"):
        prox_compare_compute(state, tolerance=-1)


# ------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def f32(xs: list[float]) -> list[float]:
    return torch.tensor(xs, dtype=torch.float32).tolist()


def to_seq_objects(seqs: list[dict]) -> list[Seq]:
    return [Seq(new=s["new"], old=s["old"], prox=s["prox"], mask=s["mask"], versions=s["versions"],
                advantage=s["adv"], current_version=s["cv"]) for s in seqs]


@pytest.fixture
def dump(tmp_path):
    seqs = random_seqs(60, seed=21, negative=False)
    for s in seqs:  # the file stores float32: the reference reads what the tool reads
        for key in ("new", "old", "prox"):
            s[key] = f32(s[key])
        s["adv"] = f32([s["adv"]])[0]
    path = tmp_path / "rollouts.parquet"
    write_sequences(str(path), to_seq_objects(seqs), row_group_size=7)
    return path, seqs


def test_cli_json_matches_reference(capsys, dump):
    path, seqs = dump
    code, out, err = run(capsys, "compare-prox", path, "-f", "json", "--rs-upper", "1.3", "--c-clip", "3",
                         "--tolerance", "0.05", "--max-lag", "3")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["tool"]["command"] == "compare-prox"
    cfg = doc["config"]
    assert cfg["methods"] == list(METHODS) and cfg["tolerance"] == 0.05 and cfg["max_lag"] == 3
    assert cfg["rejection_sampling"] == {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean",
                                         "upper": 1.3, "lower": None}
    assert cfg["p99_rel_error"] == pytest.approx(P99_REL_ERROR_BOUND)
    assert cfg["current_version_source"] == "column"
    ref = ref_figures(seqs, c_clip=3.0, rs={"upper": 1.3}, max_lag=3, tol=0.05)
    n = ref["prox/n_tokens"]
    # float32 data computed in float32: means agree to float32 precision; a decision exactly at a bound could
    # differ between float32 and float64, so flips may be off by at most one token
    assert_matches(doc["metrics"], ref, rel=2e-5, abs_=2e-6, flip_abs=1.01 / n)
    for m in METHODS:
        assert set(doc["recommendations"]) == set(METHODS) and doc["recommendations"][m].startswith(m)
        for row in doc["metrics"][f"prox/{m}/by_staleness"]:
            extra = {"overflow", "lag_max"} if row.get("overflow") else set()
            assert set(row) == {"lag", "n_tokens", "abs_error_mean", "rmse", "clip_flip_frac"} | extra
    assert doc["omitted"] == {}


def test_cli_batch_tokens_do_not_change_figures(capsys, dump):
    path, _ = dump
    docs = []
    for batch_tokens in (1, 13, 100000):
        code, out, _ = run(capsys, "compare-prox", path, "-f", "json", "--batch-tokens", batch_tokens,
                           "--rs-level", "sequence", "--rs-upper", "1.5")
        assert code == 0
        docs.append(json.loads(out)["metrics"])
    for other in docs[1:]:
        assert_same_figures(other, docs[0])


def test_cli_method_selection_table_and_csv(capsys, dump, tmp_path):
    path, _ = dump
    code, out, _ = run(capsys, "compare-prox", path, "--method", "loglinear", "-f", "json")
    metrics = json.loads(out)["metrics"]
    assert code == 0 and "prox/loglinear/abs_error_mean" in metrics
    assert not any(k.startswith(("prox/linear/", "prox/rollout/")) for k in metrics)
    # rejection sampling off: its figure is omitted with the reason, never 0
    assert "rejection sampling is off" in json.loads(out)["omitted"]["prox/loglinear/behave_weight_flip_frac"]
    code, out, _ = run(capsys, "compare-prox", path, "--tolerance", "0.05")
    assert code == 0
    for text in ("loglinear", "linear", "rollout", "By staleness lag", "Max safe lag (tolerance 0.05",
                 "abs_error_p99", "clip flip"):
        assert text in out, text
    code, out, _ = run(capsys, "compare-prox", path, "-f", "csv")
    rows = dict(list(csv.reader(io.StringIO(out)))[1:])
    assert float(rows["prox/rollout/abs_error_mean"]) > 0
    assert json.loads(rows["prox/rollout/by_staleness"])[0]["n_tokens"] > 0
    target = tmp_path / "r.json"
    code, out, _ = run(capsys, "compare-prox", path, "-f", "json", "-o", target)
    assert code == 0 and out == "" and json.loads(target.read_text())["tool"]["command"] == "compare-prox"


def test_cli_current_version_option(capsys, tmp_path):
    seqs = random_seqs(20, seed=8, negative=False)
    for s in seqs:  # one trainer version for the whole dump, no token newer than it
        s["cv"] = 6
        s["versions"] = [min(v, 6) for v in s["versions"]]
    with_col = tmp_path / "with.parquet"
    write_sequences(str(with_col), to_seq_objects(seqs))
    for s in seqs:
        s["cv"] = None
    without = tmp_path / "without.parquet"
    write_sequences(str(without), to_seq_objects(seqs))
    code, _, err = run(capsys, "compare-prox", without, "-f", "json")
    assert code == 2 and "current_version" in err and "--current-version" in err
    code, a, _ = run(capsys, "compare-prox", without, "-f", "json", "--current-version", "6")
    assert code == 0
    code, b, _ = run(capsys, "compare-prox", with_col, "-f", "json")
    assert json.loads(a)["metrics"] == json.loads(b)["metrics"]
    code, _, err = run(capsys, "compare-prox", with_col, "-f", "json", "--current-version", "3")
    assert code == 0 and "--current-version is ignored" in err  # the column wins, and the user is told
    assert json.loads(a)["config"]["current_version_source"] == "--current-version"


@pytest.mark.parametrize("column, attr, why", [
    ("prox_logp", "prox", "truth"),
    ("old_logp", "old", "behaviour"),
    ("versions", "versions", "version"),
])
def test_cli_missing_columns_exit_2(capsys, tmp_path, column, attr, why):
    seqs = to_seq_objects(random_seqs(8, seed=1, negative=False))
    for s in seqs:
        setattr(s, attr, None)
    path = tmp_path / "m.parquet"
    write_sequences(str(path), seqs)
    code, out, err = run(capsys, "compare-prox", path)
    assert code == 2 and out == ""
    assert f"column '{column}'" in err and why in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_missing_advantages_omits_loss_figures(capsys, tmp_path):
    seqs = to_seq_objects(random_seqs(8, seed=1, negative=False))
    for s in seqs:
        s.advantage = None
    path = tmp_path / "a.parquet"
    write_sequences(str(path), seqs)
    code, out, _ = run(capsys, "compare-prox", path, "-f", "json")
    doc = json.loads(out)
    assert code == 0 and "prox/rollout/abs_error_mean" in doc["metrics"]
    for key in ("prox/loss_ppo", "prox/rollout/clip_flip_frac", "prox/rollout/loss_rel_error"):
        assert key not in doc["metrics"] and "advantages" in doc["omitted"][key]
    assert "clip_flip_frac" not in doc["metrics"]["prox/rollout/by_staleness"][0]


@pytest.mark.parametrize("args, message", [
    (["--rs-level", "bogus"], "level must be one of"),
    (["--rs-metric", "ratio", "--rs-upper", "0.5"], "upper must be > 1.0"),
    (["--tolerance", "-1"], "--tolerance"),
    (["--c-clip", "0.5"], "--c-clip (dual clipping) must be"),
    (["--max-lag", "-2"], "--max-lag"),
    (["--importance-level", "row"], "--importance-level"),
    (["--method", "bogus"], "bogus"),
])
def test_cli_bad_options_exit_2(capsys, dump, args, message):
    path, _ = dump
    code, _, err = run(capsys, "compare-prox", path, *args)
    assert code == 2 and message in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------------------
# the sample data (a real tiny asynchronous GRPO run)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not SAMPLE.exists(), reason="sample_data/rollouts.parquet not generated")
def test_sample_errors_are_plausible_and_grow_with_lag(capsys):
    code, out, err = run(capsys, "compare-prox", SAMPLE, "-f", "json", "--max-lag", "64")
    assert code == 0, err
    metrics = json.loads(out)["metrics"]
    for m in METHODS:
        assert 1e-3 < metrics[f"prox/{m}/abs_error_mean"] < 1.0, m
        rows = [r for r in metrics[f"prox/{m}/by_staleness"] if r["lag"] >= 1]
        assert len(rows) >= 3 and all(r["n_tokens"] >= 100 for r in rows)
        errors = [r["abs_error_mean"] for r in rows]
        assert errors == sorted(errors) and errors[-1] > 5 * errors[0], (m, errors)
    # interpolating beats no correction once the token is stale (lag ≥ 2, α > 0)
    for ll, ro in zip(metrics["prox/loglinear/by_staleness"], metrics["prox/rollout/by_staleness"]):
        if ll["lag"] >= 2:
            assert ll["abs_error_mean"] < ro["abs_error_mean"]
