"""Tests of the findings statistics (``grpo_cli.core.diagnosis``) and detectors (``grpo_cli.findings.detect``)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from simulate import fault_config, simulate

from grpo_cli.commands.analyze import AnalyzeConfig, analyze
from grpo_cli.core.diagnosis import (
    by_step_compute,
    by_step_state,
    by_step_update,
    duplicates_compute,
    duplicates_state,
    duplicates_update,
    equality_compute,
    equality_state,
    equality_update,
    groups_compute,
    groups_state,
    groups_update,
    lags_compute,
    lags_state,
    lags_update,
    pairs_compute,
    pairs_state,
    pairs_update,
    sequence_hash,
    shift_compute,
    shift_state,
    shift_update,
    zeros_compute,
    zeros_state,
    zeros_update,
)
from grpo_cli.core.packing import segment_ids
from grpo_cli.findings.detect import CATEGORIES, CODES, DetectConfig, detect
from grpo_cli.io import RolloutDataset


# -- an independent float64 reference of the existing ``analyze`` keys the detectors read ---------------------------
def existing_figures(paths: list[Path] | Path, epsilon: float = 0.2, is_threshold: float = 2.0) -> dict[str, Any]:
    """The ``analyze`` keys the detectors read, recomputed in float64 from the whole dump (docs/metrics.md
    formulas): ``n_sequences``, ``n_valid_tokens``, ``kl/abs_diff_mean``, ``clip/ratio`` (base prox else old),
    ``is/frac_high``, ``is/frac_low``, ``is/ess`` (truncated weights), ``spikes/n_ratio_gt_1e3``,
    ``seq/no_eos_frac``, ``groups/zero_std_frac``, ``entropy/mean``, ``staleness/hist``, ``staleness/theta_max``."""
    ds = RolloutDataset([paths] if isinstance(paths, Path) else paths)
    n_seq = n_valid = 0
    s_abs = n_clip = n_hi = n_lo = n_spike = 0.0
    s_wt = s_wt2 = 0.0
    s_ent = 0.0
    n_ent = 0
    no_eos = n_eos = 0
    hist: dict[int, int] = {}
    groups: dict[tuple[int, int], tuple[float, float]] = {}
    for b in ds.iter_batches(batch_tokens=1 << 20):
        n_seq += b.n_sequences
        v = b.valid()
        new = v.new_logp.double()
        n_valid += new.numel()
        if v.old_logp is not None:
            old = v.old_logp.double()
            x = new - old
            s_abs += float(x.abs().sum())
            w = torch.exp(x)
            n_hi += float((w > is_threshold).sum())
            n_lo += float((w < 1 / is_threshold).sum())
            n_spike += float((w > 1e3).sum())
            wt = w.clamp(1 / is_threshold, is_threshold)
            s_wt += float(wt.sum())
            s_wt2 += float((wt * wt).sum())
            base = v.prox_logp.double() if v.prox_logp is not None else old
            if v.advantages is not None:
                r = torch.exp(new - base)
                a = v.advantages.double()
                n_clip += float((((r > 1 + epsilon) & (a > 0)) | ((r < 1 - epsilon) & (a < 0))).sum())
        if v.entropy is not None:
            s_ent += float(v.entropy.double().sum())
            n_ent += v.entropy.numel()
        if b.eos is not None:
            no_eos += int((b.eos == 0).sum())
            n_eos += b.n_sequences
        if v.versions is not None and v.current_version is not None:
            seq = segment_ids(v.cu_seqlens, new.numel())
            lag = v.current_version.index_select(0, seq) - v.versions
            for k, c in zip(*torch.unique(lag[v.versions >= 0], return_counts=True)):
                hist[int(k)] = hist.get(int(k), 0) + int(c)
        if b.rewards is not None and b.group_id is not None:
            steps = b.step.tolist() if b.step is not None else [0] * b.n_sequences
            for g, s, r in zip(b.group_id.tolist(), steps, b.rewards.tolist()):
                lo, hi = groups.get((s, g), (math.inf, -math.inf))
                groups[(s, g)] = (min(lo, r), max(hi, r))
    out: dict[str, Any] = {"n_sequences": n_seq, "n_valid_tokens": n_valid}
    if s_wt:
        out.update({
            "kl/abs_diff_mean": s_abs / n_valid, "is/frac_high": n_hi / n_valid, "is/frac_low": n_lo / n_valid,
            "is/ess": (s_wt / n_valid) ** 2 / (s_wt2 / n_valid), "spikes/n_ratio_gt_1e3": int(n_spike),
            "clip/ratio": n_clip / n_valid,
        })
    if n_ent:
        out["entropy/mean"] = s_ent / n_ent
    if n_eos:
        out["seq/no_eos_frac"] = no_eos / n_eos
    if hist:
        out["staleness/hist"] = [{"lag": k, "n_tokens": c} for k, c in sorted(hist.items())]
        out["staleness/theta_max"] = max(hist)
    if groups:
        out["groups/zero_std_frac"] = sum(lo == hi for lo, hi in groups.values()) / len(groups)
    return out


def diag_figures(paths: list[Path] | Path, batch_tokens: int = 1 << 14) -> dict[str, Any]:
    """Every ``diag/*`` figure of a dump, streamed by the engine in batches of about ``batch_tokens`` tokens (the
    findings-only groups alone)."""
    ds = RolloutDataset([paths] if isinstance(paths, Path) else paths)
    result = analyze(ds, AnalyzeConfig(batch_tokens=batch_tokens), groups=[], findings=DetectConfig())
    return result.evidence


def _close(a: Any, b: Any, rel: float = 1e-12, path: str = "") -> None:
    """Recursive equality of figure dicts: floats to ``rel`` relative, everything else exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], rel, f"{path}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, rel, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if math.isnan(a):
            assert math.isnan(b), path
        else:
            assert a == pytest.approx(b, rel=rel, abs=1e-15), path
    else:
        assert a == b, path


def _cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


# -- shift -----------------------------------------------------------------------------------------------------------
def _shift_example() -> dict[str, torch.Tensor]:
    # sequence A: old written one token late (old[t] = new[t − 1]); sequence B: old == new
    new = torch.tensor([0.0, -1, -2, -3, -4, -1, -1.5, -2, -2.5])
    old = torch.tensor([0.0, 0, -1, -2, -3, -1, -1.5, -2, -2.5])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    return {"new_logp": new, "old_logp": old, "loss_mask": mask}


def test_shift_hand_values() -> None:
    ex = _shift_example()
    state = shift_state()
    shift_update(state, **ex, cu_seqlens=_cu(5, 4), file_index=3, rows=torch.tensor([10, 11]))
    out = shift_compute(state)
    # shift 0: A |Δ| = 1 on 4 tokens, B 0 on 4; +1: A 0 on 3 pairs, B 0.5 on 3; −1: A 2 on 3, B 0.5 on 3
    assert out["diag/shift_abs_diff_0"] == pytest.approx(0.5)
    assert out["diag/shift_abs_diff_p1"] == pytest.approx(0.25)
    assert out["diag/shift_abs_diff_m1"] == pytest.approx(1.25)
    assert out["diag/shift_best"] == 1 and out["diag/shift_gain"] == pytest.approx(2.0)
    assert out["diag/shift_n_seq"] == 2
    assert out["diag/shift_seq_late_frac"] == 0.5 and out["diag/shift_seq_early_frac"] == 0.0
    assert out["diag/shift_top"] == [{"score": 1.0, "file": 3, "row": 10, "step": None, "value": 1.0}]


def test_shift_merges_across_batches() -> None:
    ex = _shift_example()
    whole = shift_state()
    shift_update(whole, **ex, cu_seqlens=_cu(5, 4))
    a, b = shift_state(), shift_state()
    shift_update(a, **{k: v[:5] for k, v in ex.items()}, cu_seqlens=_cu(5), rows=torch.tensor([0]))
    shift_update(b, **{k: v[5:] for k, v in ex.items()}, cu_seqlens=_cu(4), rows=torch.tensor([1]))
    _close(shift_compute(b.merge(a)), shift_compute(whole))


# -- pairs -----------------------------------------------------------------------------------------------------------
def _residual(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    design = torch.stack([torch.ones_like(h), h], 1)
    return v - design @ torch.linalg.lstsq(design, v[:, None]).solution.flatten()


def _reference_ratio(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> tuple[float, float, float]:
    """(b_yx, b_xy⁻¹, sd(x)/sd(y)) of the residuals on h: an independent float64 least-squares reference."""
    rx, ry = _residual(x, h), _residual(y, h)
    c = float((rx * ry).mean())
    vx, vy = float((rx * rx).mean()), float((ry * ry).mean())
    return c / vx, vy / c, math.sqrt(vx / vy)


def test_pairs_against_float64_reference_with_jackknife() -> None:
    g = torch.Generator().manual_seed(0)
    n_seq, per = 12, 10
    x = -torch.rand(n_seq * per, generator=g, dtype=torch.float64) * 3
    h = torch.rand(n_seq * per, generator=g, dtype=torch.float64)
    y = 1.4 * x + 0.2 * h + 0.01 * torch.randn(n_seq * per, generator=g, dtype=torch.float64)
    block = torch.arange(n_seq) % 4  # four blocks of three sequences
    cu = _cu(*([per] * n_seq))
    whole = pairs_state()
    pairs_update(whole, new_logp=x.float(), old_logp=y.float(), entropy=h.float(), cu_seqlens=cu, block=block)
    split = pairs_state()
    for lo, hi in ((0, 5), (5, 12)):
        pairs_update(split, new_logp=x[lo * per:hi * per].float(), old_logp=y[lo * per:hi * per].float(),
                     entropy=h[lo * per:hi * per].float(), cu_seqlens=_cu(*([per] * (hi - lo))), block=block[lo:hi])
    out = pairs_compute(whole)
    _close(out, pairs_compute(split), rel=1e-9)
    xf, yf, hf = x.float().double(), y.float().double(), h.float().double()
    b_yx, b_inv, ratio = _reference_ratio(xf, yf, hf)
    assert out["diag/pair_slope_old_on_new"]["value"] == pytest.approx(b_yx, rel=1e-9)
    assert out["diag/pair_slope_new_on_old_inverse"]["value"] == pytest.approx(b_inv, rel=1e-9)
    assert out["diag/temperature_ratio"]["value"] == pytest.approx(ratio, rel=1e-9)
    assert ratio == pytest.approx(1 / 1.4, rel=0.01)
    # delete-a-block jackknife by hand: the slope without each block's tokens, t(3) = 3.182
    token_block = block.repeat_interleave(per)
    loo = [_reference_ratio(xf[token_block != k], yf[token_block != k], hf[token_block != k])[0] for k in range(4)]
    mean = sum(loo) / 4
    half = 3.182 * math.sqrt(3 / 4 * sum((v - mean) ** 2 for v in loo))
    assert out["diag/pair_slope_old_on_new"]["low"] == pytest.approx(b_yx - half, rel=1e-9)
    assert out["diag/pair_slope_old_on_new"]["high"] == pytest.approx(b_yx + half, rel=1e-9)
    # no lag: every token is a same-weights pair; d > 0 on neither bin's majority, no re-tokenised token
    assert out["diag/pair_scope"] == "all tokens" and out["diag/retok_n_seq"] == 0


def test_pairs_retokenisation_stale_prox_and_partner() -> None:
    """Hand values: a likely behaviour token scored 6 nats lower is re-tokenised; a stale sequence whose prox equals
    old everywhere was not recomputed; the partner is the column closer to old."""
    new = torch.tensor([-0.1, -6.1, -0.2, -0.3, -1.0, -1.0])
    old = torch.tensor([-0.1, -0.1, -0.2, -0.3, -1.5, -1.2])
    prox = torch.tensor([-0.5, -6.0, -0.6, -0.3, -1.5, -1.2])
    lag = torch.tensor([0, 0, 0, 0, 1, 1])
    state = pairs_state()
    pairs_update(state, new_logp=new, old_logp=old, prox_logp=prox, lag=lag, cu_seqlens=_cu(2, 2, 2),
                 block=torch.tensor([0, 1, 2]), rows=torch.tensor([7, 8, 9]))
    out = pairs_compute(state)
    assert out["diag/pair_partner"] == "new_logp" and out["diag/pair_scope"] == "lag 0"
    assert out["diag/pair_n_tokens"] == 4
    assert out["diag/retok_n_seq"] == 1 and out["diag/retok_n_tokens"] == 1
    assert out["diag/retok_seq_frac"]["value"] == 0.5  # of the two sequences with lag-0 tokens
    assert [r["row"] for r in out["diag/retok_top"]] == [7]
    assert out["diag/prox_equal_old_seq_frac"]["value"] == 1.0 and out["diag/prox_equal_old_n_stale"] == 1
    # mean exp|d| over the four lag-0 tokens: |d| = 0, 6, 0, 0
    assert out["diag/pair_mult_prob_error"]["value"] == pytest.approx((3 + math.exp(6.0)) / 4, rel=1e-6)
    assert out["diag/pair_tail_frac"]["value"] == 0.25


# -- zeros and mask coverage -------------------------------------------------------------------------------------------
def test_zeros_hand_values() -> None:
    new = torch.tensor([0.0, -2, -1, -0.5, 0, 0, -3, -2, -1, -1.5, -2])
    old = torch.tensor([0.0, 0, -1.1, -0.4, 0, 0, 0, -2.1, -1, -1.4, -2.2])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    versions = torch.tensor([-1, -1, 0, 0, 0, 0, -1, 0, 0, 0, 0])
    state = zeros_state()
    zeros_update(state, loss_mask=mask, cu_seqlens=_cu(6, 5), columns={"new_logp": new, "old_logp": old},
                 versions=versions)
    out = zeros_compute(state)
    assert out["diag/zero_frac/new_logp"] == 2 / 8  # the trailing run of sequence 0
    assert out["diag/zero_frac/old_logp"] == 3 / 8
    assert out["diag/old_zero_new_nonzero_frac"] == 1 / 8  # sequence 1's prompt token: old 0, new −3
    assert out["diag/trailing_zero_seq_frac"] == 0.5 and out["diag/trailing_zero_tokens"] == 2
    assert out["diag/mask_hole_frac"] == 1 / 8  # token 8: masked between valid tokens
    assert out["diag/prompt_in_loss_frac"] == 1 / 8
    assert out["diag/generated_masked_frac"] == 1 / 8
    assert out["diag/mask_hole_generated_frac"] == 1 / 8
    assert out["diag/mask_suspect_seq_frac"] == 1.0
    # suspicious tokens: sequence 0 its 2-token zero run; sequence 1 its prompt token (in the loss, engine 0) and
    # its generated token out of the loss
    assert [(r["row"], r["score"]) for r in out["diag/mask_top"]] == [(0, 2.0), (1, 2.0)]


# -- equality ----------------------------------------------------------------------------------------------------------
def test_equality_hand_values() -> None:
    state = equality_state()
    equality_update(state, columns={"new": torch.tensor([-1.0, -2, 0]), "old": torch.tensor([-1.0, -2.5, 0]),
                                    "ref": torch.tensor([-1.0, -2, 0]), "prox": None})
    out = equality_compute(state)
    assert out == {"diag/equal_frac/new_old": 1 / 3, "diag/equal_frac/new_ref": 2 / 3,
                   "diag/equal_frac/old_ref": 1 / 3}


# -- duplicates --------------------------------------------------------------------------------------------------------
def test_sequence_hash_and_duplicates() -> None:
    x = torch.tensor([-1.0, -2, -3, -1, -2, -3, -1, -2, -3.0000002, -2, -1, -3])
    cu = _cu(3, 3, 3, 3)
    keys = sequence_hash([x], cu).tolist()
    assert keys[0] == keys[1] and len(set(keys)) == 3  # equal content, a one-ulp change, the same values reordered
    assert all(0 <= k < 2.0**53 and k == int(k) for k in keys)
    state = duplicates_state()
    duplicates_update(state, cu_seqlens=cu[:3], columns=[x[:6]], seq_id=torch.tensor([5, 5]),
                      step=torch.tensor([0, 0]), file_index=1, rows=torch.tensor([7, 9]))
    duplicates_update(state, cu_seqlens=_cu(3, 3), columns=[x[6:]], seq_id=torch.tensor([5, 6]),
                      step=torch.tensor([1, 1]), file_index=2, rows=torch.tensor([0, 1]))
    out = duplicates_compute(state)
    assert out["diag/dup_content_extra"] == 1 and out["diag/dup_content_frac"] == 0.25
    assert out["diag/dup_id_extra"] == 1 and out["diag/dup_id_frac"] == 0.25  # (0, 5) twice; (1, 5) is another step
    assert out["diag/dup_where"] == [{"count": 2, "file": 1, "row": 7, "other_file": 1, "other_row": 9}]


# -- groups ------------------------------------------------------------------------------------------------------------
def _group_batch(scale: str = "std", flip: int | None = None, shift: int | None = None, var_groups: int = 0):
    patterns = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    rewards, adv = [], []
    for g, p in enumerate(patterns):
        r = torch.tensor(p, dtype=torch.float64)
        centred = r - r.mean()
        a = centred / (r.std() + 1e-6) if scale == "std" else centred
        if g < var_groups:
            a = centred / (r.var() + 1e-6)
        if flip == g:
            a = -a
        if shift == g:
            a = a + 0.5
        rewards.append(r)
        adv.append(a)
    r = torch.cat(rewards)
    a = torch.cat(adv)
    lengths = torch.arange(len(r)) % 3 + 1
    tokens = a.repeat_interleave(lengths)
    return {"rewards": r, "advantages": tokens, "loss_mask": torch.ones(tokens.numel(), dtype=torch.bool),
            "cu_seqlens": _cu(*lengths.tolist()), "group_id": torch.arange(len(patterns)).repeat_interleave(4)}


def test_groups_hand_values() -> None:
    def run(**kw: Any) -> dict[str, Any]:
        state = groups_state()
        groups_update(state, **_group_batch(**kw), step=None)
        return groups_compute(state)

    healthy = run()
    assert healthy["diag/groups_n"] == 7 and healthy["diag/groups_spread_n"] == 6
    assert healthy["diag/adv_sign_flip_frac"] == 0 and healthy["diag/adv_uncentred_frac"] == 0
    assert healthy["diag/adv_scale_exponent"] == pytest.approx(-1.0, abs=1e-4)
    assert healthy["diag/adv_scale_outlier_frac"] == 0
    assert healthy["diag/adv_group_std_mean"] == pytest.approx(math.sqrt(3 / 4), rel=1e-5)  # pop. sd of A, n = 4
    assert run(scale="none")["diag/adv_scale_exponent"] == pytest.approx(0.0, abs=1e-9)
    flipped = run(flip=1)
    assert flipped["diag/adv_sign_flip_frac"] == 1 / 6
    assert flipped["diag/adv_where"] == [{"step": 0, "group_id": 1, "problem": "sign"}]
    assert run(shift=2)["diag/adv_uncentred_frac"] == 1 / 7
    assert run(var_groups=2)["diag/adv_scale_outlier_frac"] == 2 / 6  # 2 of the 6 spread groups off the std model


# -- by step -----------------------------------------------------------------------------------------------------------
def test_by_step_hand_values() -> None:
    state = by_step_state()
    by_step_update(
        state, step=torch.tensor([3, 1]), new_logp=torch.tensor([-1.0, -2, -1, -1, -1, -1, -3]),
        cu_seqlens=_cu(2, 5), old_logp=torch.tensor([-1.5, -2, -1.25, -1.25, -1.25, -1.25, -3]),
        entropy=torch.tensor([1.0, 2, 0, 0, 0, 0, 1]), lag=torch.tensor([0, 1, 0, 0, 0, 0, -1]),
        eos=torch.tensor([1, 0]), advantages=torch.tensor([1.0, 1, -1, -1, -1, -1, -1]),
        base_logp=torch.tensor([-1.5, -2, -1, -1, -1, -1, -2.5]),
    )
    rows = by_step_compute(state)["diag/by_step"]
    assert [r["step"] for r in rows] == [1, 3]
    s1, s3 = rows
    assert s3["abs_diff_mean"] == 0.25 and s3["lag0_abs_diff_mean"] == 0.5 and s3["lag0_n_tokens"] == 1
    assert s3["entropy_mean"] == 1.5 and s3["neg_logp_mean"] == 1.5 and s3["no_eos_frac"] == 0.0
    assert s3["lag_mean"] == 0.5 and s3["lag_max"] == 1
    assert s3["clip_frac"] == 0.5  # r = e^0.5 > 1.2 with A > 0 on the first token
    assert s3["lag0_seq_max"] is None  # fewer than 4 lag-0 tokens
    assert s1["lag0_seq_max"] == pytest.approx(0.25) and s1["no_eos_frac"] == 1.0
    assert s1["lag_mean"] == 0.0 and s1["lag_max"] == 0  # the lag −1 token is not generated
    assert s1["clip_frac"] == pytest.approx(1 / 5)  # r = e^−0.5 < 0.8 with A < 0 on the last token


# -- lags and the proximal approximation ------------------------------------------------------------------------------
def test_lags_hand_values() -> None:
    new = torch.tensor([-1.0, -1.0, -2.0, -1.0, -3.0])
    old = torch.tensor([-1.05, -1.5, -1.0, -2.0, -1.0])
    lag = torch.tensor([0, 1, 2, 3, -1])
    # prox: lag 1 exactly old (α = 0); lag 2 the midpoint + 0.005; lag 3 the 2/3 point + 0.05; lag 0 anything
    prox = torch.tensor([-1.0, -1.5, -1.5 + 0.005, -2.0 + (2 / 3) * 1.0 + 0.05, 0.0], dtype=torch.float64)
    state = lags_state()
    lags_update(state, new_logp=new, old_logp=old, lag=lag, cu_seqlens=_cu(2, 3), prox_logp=prox)
    out = lags_compute(state)
    assert out["diag/lag0_n_tokens"] == 1 and out["diag/lag0_abs_diff_mean"] == pytest.approx(0.05, rel=1e-6)
    assert out["diag/lag_max"] == 3
    errors = {r["lag"]: r["prox_loglinear_error"] for r in out["diag/by_lag"]}
    assert errors[1] == pytest.approx(0.0, abs=1e-7)
    assert errors[2] == pytest.approx(0.005, rel=1e-5) and errors[3] == pytest.approx(0.05, rel=1e-5)
    assert out["diag/prox_loglinear_safe_lag"] == 2 and out["diag/prox_beyond_safe_frac"] == pytest.approx(1 / 3)
    assert out["diag/lag0_top"][0]["row"] == 0 and out["diag/lag0_big_seq_frac"] == 0.0


# -- batching ----------------------------------------------------------------------------------------------------------
def test_figures_do_not_depend_on_batching(tmp_path: Path) -> None:
    cfg = fault_config("mask_prompt", 0.3, steps=3, prompts_per_step=8, duplicate=True, shift=1, lags=(0, 1))
    simulate(cfg, tmp_path)
    small = diag_figures(tmp_path, batch_tokens=300)
    large = diag_figures(tmp_path, batch_tokens=1 << 20)
    assert small["diag/dup_id_extra"] > 0 and small["diag/shift_seq_late_frac"] > 0
    _close(small, large)


# -- detectors on hand-made figures ------------------------------------------------------------------------------------
_BIG = {"n_valid_tokens": 100_000, "n_sequences": 4000}


def test_a_strong_effect_in_a_small_dump_is_an_error() -> None:
    """No size cap: 20 of 40 sequences preferring the shift is conclusive (Wilson interval 0.35–0.65)."""
    fig = {"n_valid_tokens": 2000, "n_sequences": 40, "diag/shift_seq_late_frac": 0.5,
           "diag/shift_seq_early_frac": 0.0, "diag/shift_n_seq": 40}
    (finding,) = detect(fig)
    assert (finding.code, finding.severity) == ("GRP101", "error")
    ev = finding.evidence["diag/shift_seq_late_frac"]
    # Wilson's interval for 20/40, by hand: centre (0.5 + 1.96²/80)/(1 + 1.96²/40) = 0.5, half-width
    # 1.96·√(0.25/40 + 1.96²/6400)/(1 + 1.96²/40) = 1.96·0.082766/1.09604 = 0.14801
    assert ev["low"] == pytest.approx(0.5 - 0.14801, abs=1e-5) and ev["high"] == pytest.approx(0.5 + 0.14801, abs=1e-5)
    assert ev["threshold"] == 0.02


def test_few_flagged_sequences_are_inconclusive() -> None:
    """2 of 100 sequences: the estimate reaches the warning threshold, the interval (0.6 %–7 %) does not."""
    fig = {**_BIG, "diag/shift_seq_late_frac": 0.02, "diag/shift_seq_early_frac": 0.0, "diag/shift_n_seq": 100}
    (finding,) = detect(fig)
    assert finding.code == "GRP101" and finding.severity == "inconclusive"
    assert "would settle it" in finding.notes[0]


def test_an_interval_straddling_the_threshold_is_inconclusive() -> None:
    est = {"value": 0.9, "low": 0.7, "high": 1.0}
    common = {**_BIG, "diag/pair_d_likely": {"value": 0.05, "low": 0.04, "high": 0.06},
              "diag/pair_d_unlikely": {"value": 0.2, "low": 0.1, "high": 0.3}}
    (finding,) = detect({**common, "diag/pair_onesided": est})
    assert (finding.code, finding.severity) == ("GRP103", "inconclusive")
    (finding,) = detect({**common, "diag/pair_onesided": {"value": 0.9, "low": 0.85, "high": 0.95}})
    assert finding.severity == "warning"
    (finding,) = detect({**common, "diag/pair_onesided": {"value": 0.99, "low": 0.96, "high": 1.0}})
    assert finding.severity == "error"
    # a tilt sinks the unlikely tokens: no truncation however one-sided the likely ones are
    tilt = {**common, "diag/pair_d_unlikely": {"value": -0.3, "low": -0.4, "high": -0.2}}
    assert detect({**tilt, "diag/pair_onesided": {"value": 0.99, "low": 0.96, "high": 1.0}}) == []


def _pairs(ratio: float, low: float, high: float, b1: tuple[float, float, float],
           b2: tuple[float, float, float]) -> dict[str, object]:
    def est(v: tuple[float, float, float]) -> dict[str, float]:
        return {"value": v[0], "low": v[1], "high": v[2]}

    return {**_BIG, "diag/temperature_ratio": {"value": ratio, "low": low, "high": high},
            "diag/pair_slope_old_on_new": est(b1), "diag/pair_slope_new_on_old_inverse": est(b2)}


def test_temperature_needs_the_tilt_in_both_directions() -> None:
    """Noise attenuates one slope below 1 and inflates the other above it: no temperature, whatever the ratio."""
    (f,) = detect(_pairs(0.70, 0.69, 0.71, (1.40, 1.38, 1.42), (1.45, 1.43, 1.47)))
    assert (f.code, f.severity) == ("GRP102", "error")
    assert f.evidence["diag/temperature_ratio"]["value"] == 0.70 and "0.70×" in f.title
    assert detect(_pairs(0.80, 0.75, 0.85, (0.68, 0.6, 0.76), (1.4, 1.3, 1.5))) == []
    (f,) = detect(_pairs(0.93, 0.90, 0.96, (1.07, 1.05, 1.09), (1.08, 1.06, 1.10)))
    # |ln 0.93| = 0.073 is past ln 1.05 = 0.049, but the interval of |ln r|, [|ln 0.96|, |ln 0.90|] =
    # [0.041, 0.105], reaches back below it
    assert f.severity == "inconclusive"
    (f,) = detect(_pairs(0.90, 0.88, 0.92, (1.10, 1.08, 1.12), (1.12, 1.10, 1.14)))
    assert f.severity == "warning"  # [0.083, 0.128]: past ln 1.05, not past ln 1.15 = 0.140


def test_thresholds_and_evidence() -> None:
    (f,) = detect({**_BIG, "groups/zero_std_frac": 0.6})
    assert (f.code, f.category, f.severity) == ("GRP304", "no-signal", "warning")
    assert f.evidence == {"groups/zero_std_frac": {"value": 0.6, "low": 0.6, "high": 0.6, "threshold": 0.5}}
    assert detect({**_BIG, "groups/zero_std_frac": 0.2}) == []
    (f,) = detect({**_BIG, "seq/no_eos_frac": 0.6})
    assert (f.code, f.severity) == ("GRP402", "error") and "max_completion_length" in f.fix
    (f,) = detect({**_BIG, "staleness/hist": [{"lag": 0, "n_tokens": 80}, {"lag": 6, "n_tokens": 20}]},
                  config=DetectConfig(max_staleness=4))
    assert (f.code, f.severity) == ("GRP204", "warning") and f.where == {"lags": [6]}
    assert detect({**_BIG, "staleness/hist": [{"lag": 0, "n_tokens": 80}, {"lag": 6, "n_tokens": 20}]},
                  config=DetectConfig(max_staleness=8)) == []


def test_weight_sync_reads_group_by_step_figures() -> None:
    steps = [{"key": {"step": s}, "metrics": {"by_staleness": [{"lag": 0, "n_tokens": 500,
                                                                 "abs_diff/mean": 0.01 + 0.01 * s}],
                                              "staleness/theta_mean": 1.5}} for s in range(6)]
    (f,) = detect(_BIG, steps)
    assert (f.code, f.category, f.severity) == ("GRP201", "weight-sync", "error")
    assert f.where["steps"][0] == 5
    flat = [{"step": s, "by_staleness": [{"lag": 0, "n_tokens": 500, "abs_diff/mean": 0.01}]} for s in range(6)]
    assert detect(_BIG, flat) == []


def test_findings_are_sorted_and_serialisable() -> None:
    fig = {**_BIG, "groups/zero_std_frac": 0.9, "seq/no_eos_frac": 0.3, "diag/adv_sign_flip_frac": 0.01,
           "diag/groups_spread_n": 100, "diag/groups_n": 110}
    findings = detect(fig)
    assert [(f.code, f.severity) for f in findings] == [("GRP304", "error"), ("GRP402", "warning"),
                                                         ("GRP301", "info")]
    assert all(f.category in CATEGORIES and f.code in CODES and f.title and f.fix for f in findings)
    assert json.loads(json.dumps([f.to_dict() for f in findings]))[0]["code"] == "GRP304"


def test_mismatch_and_its_tail() -> None:
    """A mismatch conclusive past 1.1 is an error, and the weight tail it causes is explained by it."""
    fig = {**_BIG, "diag/pair_scope": "lag 0",
           "diag/pair_mult_prob_error": {"value": 1.15, "low": 1.12, "high": 1.18},
           "diag/pair_tail_frac": {"value": 0.08, "low": 0.06, "high": 0.1}}
    found = {f.code: f for f in detect(fig)}
    assert found["GRP202"].severity == "error"
    assert found["GRP203"].severity == "info" and found["GRP203"].notes[0].startswith("explained by GRP202")
    (f,) = detect({**fig, "diag/pair_scope": "all tokens", "diag/pair_tail_frac": {"value": 0, "low": 0, "high": 0}})
    assert (f.code, f.severity) == ("GRP202", "info") and "staleness" in f.notes[0]


def test_by_step_lag_table_and_policy_drift() -> None:
    new = torch.tensor([-1.0] * 10)
    old = torch.tensor([-1.125] * 4 + [-1.375] * 4 + [-1.5] * 2)  # |Δ| 0.125 (A), 0.375 (B), 0.5 (C)
    lag = torch.tensor([1] * 8 + [0] * 2)
    state = by_step_state()
    by_step_update(state, step=torch.tensor([4, 4, 4]), new_logp=new, cu_seqlens=_cu(4, 4, 2), old_logp=old,
                   lag=lag, prox_logp=new - 0.25)
    half = by_step_state()
    by_step_update(half, step=torch.tensor([4]), new_logp=new[8:], cu_seqlens=_cu(2), old_logp=old[8:],
                   lag=lag[8:], prox_logp=new[8:] - 0.25)
    rest = by_step_state()
    by_step_update(rest, step=torch.tensor([4, 4]), new_logp=new[:8], cu_seqlens=_cu(4, 4), old_logp=old[:8],
                   lag=lag[:8], prox_logp=new[:8] - 0.25)
    for s in (state, half.merge(rest)):
        out = by_step_compute(s)
        assert out["diag/by_step"][0]["prox_abs_diff_mean"] == 0.25
        assert out["diag/by_step_lag"] == [
            {"step": 4, "lag": 0, "n_tokens": 2, "abs_diff_mean": 0.5, "seq_max": None},  # C: < 4 tokens
            {"step": 4, "lag": 1, "n_tokens": 8, "abs_diff_mean": 0.25, "seq_max": 0.375},
        ]


def test_every_code_has_a_regular_docs_section() -> None:
    """``grpo-cli explain CODE`` prints the section of docs/findings.md: one per code, in the regular structure."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "findings.md").read_text(encoding="utf-8")
    sections = {s.split()[0]: s for s in text.split("\n## ")[1:] if s.startswith("GRP")}
    assert sorted(sections) == sorted(CODES)
    parts = ("**Category**:", "**Severity**:", "### What it means", "### Why it matters", "### How it is detected",
             "### How to fix")
    for code, (category, _) in CODES.items():
        section = sections[code]
        positions = [section.find(p) for p in parts]
        assert min(positions) >= 0 and positions == sorted(positions), code
        assert f"**Category**: `{category}`" in section, code
