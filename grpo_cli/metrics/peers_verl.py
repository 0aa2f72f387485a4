"""verl's peer-exact figures (``--names verl``): :class:`VerlPeerGroup`. See :mod:`grpo_cli.metrics.peers`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.peer_figures import VERL_SAFETY_BOUND
from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total
from grpo_cli.engine.figures import Figure, column
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics._peers_common import (
    DECOUPLED,
    F64,
    f64,
    under,
)
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.policy import OLD

__all__ = ["VerlPeerGroup"]


_VERL_IS = {
    "rollout_is_mean": "mean truncated weight w̃ = min(w, C), w = exp(clamp(train − rollout, ±20))",
    "rollout_is_max": "largest w̃ (at most C)",
    "rollout_is_min": "smallest w̃",
    "rollout_is_std": "std of w̃ (0 for one token)",
    "rollout_is_eff_sample_size": "1 / mean((w̃ / (mean w̃ + 1e-8))²)",
    "rollout_is_ratio_fraction_high": "fraction of tokens with raw w > C (--is-threshold)",
    "rollout_is_ratio_fraction_low": "fraction of tokens with raw w < 1/C",
    "rollout_is_seq_mean": "mean over sequences of the per-sequence mean w̃ (an empty sequence counts 0)",
    "rollout_is_seq_std": "unbiased std of the per-sequence mean w̃",
    "rollout_is_seq_max": "largest per-sequence mean w̃",
    "rollout_is_seq_min": "smallest per-sequence mean w̃",
    "rollout_is_seq_max_deviation": "largest |per-sequence mean w̃ − 1|",
    "rollout_is_seq_fraction_high": "fraction of sequences whose mean raw w > C",
    "rollout_is_seq_fraction_low": "fraction of sequences whose mean raw w < 1/C",
}
_VERL_OFF = {
    "training_ppl": "mean over sequences of exp(−mean train log-prob) (empty sequences count exp(0) = 1)",
    "training_log_ppl": "mean over sequences of −mean train log-prob",
    "kl": "token mean of (rollout − train): k1 estimate of KL(rollout ‖ train)",
    "k3_kl": "token mean of e^ℓ − ℓ − 1, ℓ = train − rollout (never clamped)",
    "rollout_ppl": "mean over sequences of exp(−mean rollout log-prob)",
    "rollout_log_ppl": "mean over sequences of −mean rollout log-prob",
    "log_ppl_diff": "mean over sequences of (mean rollout − mean train)",
    "log_ppl_abs_diff": "mean over sequences of |mean rollout − mean train|",
    "log_ppl_diff_max": "largest per-sequence (mean rollout − mean train)",
    "log_ppl_diff_min": "smallest per-sequence (mean rollout − mean train)",
    "ppl_ratio": "mean over sequences of exp(mean rollout − mean train)",
    "chi2_token": "token mean of exp(2·clamp(ℓ, ±20)) − 1",
    "chi2_seq": "mean over sequences of exp(2·clamp(Σ ℓ, ±20)) − 1",
}
_VERL_SETS = {
    # (grpo-cli prefix, verl prefix, requirement, what "train" is)
    "decoupled": ("verl/rollout_corr/", "rollout_corr/", DECOUPLED,
                  "train = prox_logp (verl's recomputed old_log_prob)"),
    "bypass": ("verl/actor/rollout_corr/", "actor/rollout_corr/", OLD, "train = new_logp (verl's bypass mode)"),
}
_VERL_PEARSON = "verl/rollout_actor_probs_pearson_corr"
_VERL_SCORE = "verl/critic/score/"


def _verl_figures() -> tuple[Figure, ...]:
    out: list[Figure] = []
    enabled = under("verl")
    for ours, theirs, need, train in _VERL_SETS.values():
        for name, meaning in (*_VERL_IS.items(), *_VERL_OFF.items()):
            out.append(Figure(ours + name, f"{meaning}; {train}, rollout = old_logp", section="verl",
                              needs=(need,), enabled=enabled, peers={"verl": theirs + name}))
    out.append(Figure(_VERL_PEARSON, "Pearson correlation of e^prox (verl's old_log_prob) vs e^old (rollout)",
                      section="verl", reduce="correlation", needs=(DECOUPLED,), enabled=enabled,
                      peers={"verl": "training/rollout_actor_probs_pearson_corr"}))
    for stat, meaning in (("mean", "mean reward over sequences with a valid token (zero-length responses left out)"),
                          ("max", "largest reward over sequences with a valid token"),
                          ("min", "smallest reward over sequences with a valid token")):
        out.append(Figure(_VERL_SCORE + stat, meaning, section="verl", needs=(column("rewards"),), enabled=enabled,
                          peers={"verl": f"critic/score/{stat}"}))
    return tuple(out)


def _verl_specs(p: str) -> dict[str, StateSpec]:
    sums = ("w", "v", "v2", "r", "r2", "ppl_t", "lppl_t", "kl", "k3", "ppl_r", "lppl_r", "diff", "adiff", "pplratio",
            "rho2", "chi2seq")
    specs: dict[str, StateSpec] = {f"{p}{s}": total() for s in sums}
    specs.update({f"{p}{c}": count() for c in ("n", "n_high", "n_low", "rows", "rows_high", "rows_low")})
    specs.update({f"{p}{m}": maximum() for m in ("w_max", "r_max", "dev_max", "diff_max")})
    specs.update({f"{p}{m}": minimum() for m in ("w_min", "r_min", "diff_min")})
    return specs


def _verl_update(state: MetricState, p: str, train: Tensor, rollout: Tensor, cu: Tensor, c: float,
                 truncate: bool = True) -> None:
    """Fold verl's IS and off-policy sums of one batch (valid tokens, packed) into ``state`` (prefix ``p``).

    ``truncate``: verl 0.8 and later take the IS statistics of the truncated weights min(w, C); ``False`` is verl
    0.7 and earlier (mean, extrema and per-sequence figures of the raw w, std and ESS of clamp(w, 1/C, C))."""
    t, r = f64(train), f64(rollout)
    lengths = lengths_from_cu_seqlens(cu).to(t.device)
    n_rows = lengths.numel()
    denom = lengths.to(F64).clamp(min=1.0)
    log_ratio = t - r
    raw = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    w = raw.clamp(max=c) if truncate else raw
    v = w if truncate else raw.clamp(min=1.0 / c, max=c)
    row_w = segment_sum(w, cu, F64) / denom
    row_raw = segment_sum(raw, cu, F64) / denom
    mu_t = segment_sum(t, cu, F64) / denom
    mu_r = segment_sum(r, cu, F64) / denom
    diff = mu_r - mu_t
    seq_log = segment_sum(log_ratio, cu, F64).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    upd: dict[str, Tensor] = {
        "n": torch.tensor(t.numel()), "w": w.sum(), "v": v.sum(), "v2": (v * v).sum(),
        "n_high": (raw > c).sum(), "n_low": (raw < 1.0 / c).sum(),
        "rows": torch.tensor(n_rows), "r": row_w.sum(), "r2": (row_w * row_w).sum(),
        "rows_high": (row_raw > c).sum(), "rows_low": (row_raw < 1.0 / c).sum(),
        "ppl_t": torch.exp(-mu_t).sum(), "lppl_t": (-mu_t).sum(), "kl": (-log_ratio).sum(),
        "k3": (torch.expm1(log_ratio) - log_ratio).sum(), "ppl_r": torch.exp(-mu_r).sum(), "lppl_r": (-mu_r).sum(),
        "diff": diff.sum(), "adiff": diff.abs().sum(), "pplratio": torch.exp(diff).sum(),
        "rho2": (raw * raw).sum(), "chi2seq": torch.exp(2.0 * seq_log).sum(),
    }
    if t.numel():
        upd.update(w_max=w.max(), w_min=w.min())
    if n_rows:
        upd.update(r_max=row_w.max(), r_min=row_w.min(), dev_max=(row_w - 1.0).abs().max(), diff_max=diff.max(),
                   diff_min=diff.min())
    state.update(**{p + k: v for k, v in upd.items()})


def _verl_compute(state: MetricState, p: str, c: float) -> dict[str, float]:
    n, rows = int(state[p + "n"]), int(state[p + "rows"])
    if n == 0 or rows == 0:  # verl raises on a batch without valid tokens
        return {}
    mean = float(state[p + "w"]) / n
    v_mean, v_sq = float(state[p + "v"]) / n, float(state[p + "v2"]) / n
    r_mean = float(state[p + "r"]) / rows
    r_var = (float(state[p + "r2"]) - rows * r_mean * r_mean) / (rows - 1) if rows > 1 else 0.0
    return {
        "rollout_is_mean": mean,
        "rollout_is_max": float(state[p + "w_max"]),
        "rollout_is_min": float(state[p + "w_min"]),
        "rollout_is_std": math.sqrt(max(v_sq - v_mean * v_mean, 0.0)) if n > 1 else 0.0,
        "rollout_is_eff_sample_size": (v_mean + 1e-8) ** 2 / v_sq if v_sq > 0 else math.nan,
        "rollout_is_ratio_fraction_high": int(state[p + "n_high"]) / n,
        "rollout_is_ratio_fraction_low": int(state[p + "n_low"]) / n,
        "rollout_is_seq_mean": r_mean,
        "rollout_is_seq_std": math.sqrt(max(r_var, 0.0)),
        "rollout_is_seq_max": float(state[p + "r_max"]),
        "rollout_is_seq_min": float(state[p + "r_min"]),
        "rollout_is_seq_max_deviation": float(state[p + "dev_max"]),
        "rollout_is_seq_fraction_high": int(state[p + "rows_high"]) / rows,
        "rollout_is_seq_fraction_low": int(state[p + "rows_low"]) / rows,
        "training_ppl": float(state[p + "ppl_t"]) / rows,
        "training_log_ppl": float(state[p + "lppl_t"]) / rows,
        "kl": float(state[p + "kl"]) / n,
        "k3_kl": float(state[p + "k3"]) / n,
        "rollout_ppl": float(state[p + "ppl_r"]) / rows,
        "rollout_log_ppl": float(state[p + "lppl_r"]) / rows,
        "log_ppl_diff": float(state[p + "diff"]) / rows,
        "log_ppl_abs_diff": float(state[p + "adiff"]) / rows,
        "log_ppl_diff_max": float(state[p + "diff_max"]),
        "log_ppl_diff_min": float(state[p + "diff_min"]),
        "ppl_ratio": float(state[p + "pplratio"]) / rows,
        "chi2_token": float(state[p + "rho2"]) / n - 1.0,
        "chi2_seq": float(state[p + "chi2seq"]) / rows - 1.0,
    }


class VerlPeerGroup(MetricGroup):
    """verl's rollout-correction figures (``--names verl``): ``rollout_corr/*`` from verl's recomputed old
    log-probs (our ``prox_logp``) against the rollout's (our ``old_logp``), ``actor/rollout_corr/*`` (bypass mode:
    the current policy, our ``new_logp``, against the rollout), the Pearson figure and ``critic/score/*``.

    The importance weights are token level with verl's truncation (TIS) at C = ``--is-threshold``; verl 0.8 and
    later take the statistics of the truncated weights (w = [4, 0.25, 1], C = 2: mean 1.083, max 2, ESS 0.695),
    ``--convention verl<=0.7`` those of the raw weights (1.75, 4, 0.778).
    """

    name = "verl"
    figures = _verl_figures()

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "rewards"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        if config.peer() != "verl":
            return MetricState({}, device)
        specs = {**_verl_specs("d_"), **_verl_specs("b_")}
        specs.update({k: total() for k in ("px", "py", "pxx", "pyy", "pxy", "score")})
        specs.update(pn=count(), n_scored=count(), score_max=maximum(), score_min=minimum())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "verl":
            return
        c, truncate = config.is_threshold, config.convention != "verl<=0.7"
        if valid.old_logp is not None:
            _verl_update(state, "b_", valid.new_logp, valid.old_logp, valid.cu_seqlens, c, truncate)
            if valid.prox_logp is not None:
                _verl_update(state, "d_", valid.prox_logp, valid.old_logp, valid.cu_seqlens, c, truncate)
                x, y = torch.exp(f64(valid.prox_logp)), torch.exp(f64(valid.old_logp))
                state.update(px=x.sum(), py=y.sum(), pxx=(x * x).sum(), pyy=(y * y).sum(), pxy=(x * y).sum(),
                             pn=torch.tensor(x.numel()))
        if valid.rewards is not None:
            scored = lengths_from_cu_seqlens(valid.cu_seqlens).to(valid.rewards.device) > 0
            s = f64(valid.rewards[scored])
            state.update(score=s.sum(), n_scored=torch.tensor(s.numel()))
            if s.numel():
                state.update(score_max=s.max(), score_min=s.min())

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        if config.peer() != "verl":
            return {}
        out: dict[str, Any] = {}
        for prefix, (ours, _, _, _) in (("d_", _VERL_SETS["decoupled"]), ("b_", _VERL_SETS["bypass"])):
            out.update({ours + k: v for k, v in _verl_compute(state, prefix, config.is_threshold).items()})
        n = int(state["pn"])
        if n > 1:
            mx, my = float(state["px"]) / n, float(state["py"]) / n
            cov = float(state["pxy"]) / n - mx * my
            vx, vy = float(state["pxx"]) / n - mx * mx, float(state["pyy"]) / n - my * my
            out[_VERL_PEARSON] = cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan
        m = int(state["n_scored"])
        if m:
            out[_VERL_SCORE + "mean"] = float(state["score"]) / m
            out[_VERL_SCORE + "max"] = float(state["score_max"])
            out[_VERL_SCORE + "min"] = float(state["score_min"])
        return out
