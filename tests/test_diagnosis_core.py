"""Tests of the findings statistics (``grpo_cli.core.diagnosis``) and detectors (``grpo_cli.core.diag_findings``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from grpo_cli.core.diagnosis import diagnosis_compute, diagnosis_state, diagnosis_update
from grpo_cli.core.packing import segment_ids
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
    """Every ``diag/*`` figure of a dump, streamed in batches of about ``batch_tokens`` tokens."""
    ds = RolloutDataset([paths] if isinstance(paths, Path) else paths)
    states = diagnosis_state()
    for batch in ds.iter_batches(batch_tokens=batch_tokens):
        diagnosis_update(states, batch)
    return diagnosis_compute(states)
