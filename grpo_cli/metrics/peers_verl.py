"""verl's peer-exact figures (``--names verl``): :class:`VerlPeerGroup`. See :mod:`grpo_cli.metrics.peers`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.offpolicy import pearson_from_sums, pearson_sums
from grpo_cli.core.packing import lengths_from_cu_seqlens
from grpo_cli.core.peer_figures import VERL_SAFETY_BOUND, verl_rs_options, verl_rs_thresholds
from grpo_cli.core.peer_verl_rollout import (
    verl_is_terms,
    verl_log_ratio_terms,
    verl_offpolicy_terms,
    verl_rs_terms,
)
from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total
from grpo_cli.engine.figures import Figure, Requirement, column
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics._peers_common import (
    DECOUPLED,
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
    "rollout_is_ratio_fraction_high": "fraction of tokens with raw w > C (--rollout-is-threshold, default "
                                      "--is-threshold; of sequences under --rollout-is sequence)",
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
_PEARSON_SUMS = ("px", "py", "pxx", "pyy", "pxy")
_VERL_SCORE = "verl/critic/score/"


# verl's rejection sampling (``compute_rollout_rejection_mask``, ``compute_rs_metrics``): per option, the keys
# rollout_rs_<option>_<stat>; k1 options also log seq_fraction_low.
_RS_STATS = {
    "mean": "token mean of the option's statistic (a sequence option's value on each of its tokens)",
    "max": "largest statistic (over valid tokens; over sequences with a valid token for sequence options)",
    "min": "smallest statistic (likewise)",
    "std": "std of the statistic clamped to [lower, upper] (k1: log bounds; others [0, upper]), token-weighted",
    "fraction_high": "fraction above the upper bound (tokens, or sequences for sequence options)",
    "fraction_low": "fraction below the lower bound (k1 options; 0 for the others)",
    "seq_mean": "mean over sequences with a valid token of the per-sequence statistic (token options: its mean)",
    "seq_std": "unbiased std of the per-sequence statistic",
    "seq_max": "largest per-sequence statistic",
    "seq_min": "smallest per-sequence statistic",
    "seq_max_deviation": "largest |per-sequence statistic|",
    "seq_fraction_high": "sequences whose statistic is above the upper bound",
    "masked_fraction": "valid tokens this option rejects",
    "seq_masked_fraction": "sequences with a valid token that hold a token this option rejects",
}
_RS_K1_ONLY = {"seq_fraction_low": "sequences whose statistic is below the lower bound"}
_RS_TOTALS = {
    "rollout_rs_masked_fraction": "valid tokens any --rollout-rs option rejects",
    "rollout_rs_seq_masked_fraction": "sequences (all of them) holding a rejected valid token",
}


def _rs_bounds(config: Any) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}`` of ``--rollout-rs``/``--rollout-rs-threshold`` (empty when off or invalid)."""
    if getattr(config, "rollout_rs", None) is None or getattr(config, "rollout_rs_threshold", None) is None:
        return {}
    try:
        return verl_rs_thresholds(verl_rs_options(config.rollout_rs), config.rollout_rs_threshold)
    except (TypeError, ValueError):
        return {}  # validate() reports it


def _rs_enabled(option: str | None) -> Callable[[Any], bool]:
    def enabled(config: Any) -> bool:
        bounds = _rs_bounds(config) if getattr(config, "names", None) == "verl" else {}
        return bool(bounds) and (option is None or option in bounds)

    return enabled


def _icepop(config: Any) -> bool:
    return getattr(config, "names", None) == "verl" and config.verl_is_bounds()[1] is not None


def _rs_figures(ours: str, theirs: str, need: Requirement, train: str) -> list[Figure]:
    out: list[Figure] = []
    for option in VERL_RS_OPTIONS:
        stats = {**_RS_STATS, **(_RS_K1_ONLY if option.endswith("k1") else {})}
        for stat, meaning in stats.items():
            key = f"rollout_rs_{option}_{stat}"
            out.append(Figure(ours + key, f"{meaning}; {train}, rollout = old_logp", section="verl", needs=(need,),
                              enabled=_rs_enabled(option), reduce="mean", peers={"verl": theirs + key}))
    for key, meaning in _RS_TOTALS.items():
        out.append(Figure(ours + key, f"{meaning}; {train}", section="verl", needs=(need,), enabled=_rs_enabled(None),
                          reduce="fraction", peers={"verl": theirs + key}))
    return out


def _rs_specs(p: str, bounds: dict[str, tuple[float | None, float]]) -> dict[str, StateSpec]:
    specs: dict[str, StateSpec] = {f"{p}rows_ne": count(), f"{p}rs_masked": count(), f"{p}rs_seq_masked": count()}
    for option in bounds:
        q = f"{p}rs_{option}_"
        specs.update({q + k: total() for k in ("sum", "c", "c2", "seq", "seq2")})
        specs.update({q + k: count() for k in ("hi", "lo", "seq_hi", "seq_lo", "masked", "seq_masked")})
        specs.update({q + k: maximum() for k in ("max", "seq_max", "seq_dev")})
        specs.update({q + k: minimum() for k in ("min", "seq_min")})
    return specs


def _rs_update(state: MetricState, p: str, train: Tensor, rollout: Tensor, cu: Tensor,
               bounds: dict[str, tuple[float | None, float]]) -> None:
    """Fold verl's rejection-sampling sums of one batch (the statistics of :func:`verl_rs_terms`)."""
    options, keep_all, rejected_all = verl_rs_terms(f64(train), f64(rollout), cu, bounds)
    has = lengths_from_cu_seqlens(cu).to(keep_all.device) > 0
    zero = torch.zeros((), dtype=torch.int64, device=keep_all.device)
    upd: dict[str, Tensor] = {"rows_ne": has.sum()}
    for option, t in options.items():
        k1 = option.endswith("k1")
        lo_t, hi_t, stat = t.low, t.high, t.stat
        sv = t.seq[has]
        extreme = stat if option.startswith("token") else sv
        clamped = stat.clamp(min=lo_t, max=hi_t)
        q = f"rs_{option}_"
        upd.update({
            q + "sum": stat.sum(), q + "c": clamped.sum(), q + "c2": (clamped * clamped).sum(),
            q + "hi": (extreme > hi_t).sum(), q + "lo": (extreme < lo_t).sum() if k1 else zero,
            q + "seq": sv.sum(), q + "seq2": (sv * sv).sum(), q + "seq_hi": (sv > hi_t).sum(),
            q + "seq_lo": (sv < lo_t).sum() if k1 else zero, q + "masked": (~t.keep).sum(),
            q + "seq_masked": t.rejected.sum(),
        })
        if extreme.numel():
            upd.update({q + "max": extreme.max(), q + "min": extreme.min()})
        if sv.numel():
            upd.update({q + "seq_max": sv.max(), q + "seq_min": sv.min(), q + "seq_dev": sv.abs().max()})
    upd["rs_masked"] = (~keep_all).sum()
    upd["rs_seq_masked"] = rejected_all.sum()
    state.update(**{p + k: v for k, v in upd.items()})


def _rs_compute(state: MetricState, p: str, bounds: dict[str, tuple[float | None, float]]) -> dict[str, float]:
    n, rows, ne = int(state[p + "n"]), int(state[p + "rows"]), int(state[p + "rows_ne"])
    if n == 0 or ne == 0:  # verl raises on a batch without valid tokens
        return {}
    out: dict[str, float] = {}
    for option in bounds:
        q, key = f"{p}rs_{option}_", f"rollout_rs_{option}_"
        frac_den = n if option.startswith("token") else ne
        c_mean = float(state[q + "c"]) / n
        s_mean = float(state[q + "seq"]) / ne
        s_var = (float(state[q + "seq2"]) - ne * s_mean * s_mean) / (ne - 1) if ne > 1 else 0.0
        out.update({
            key + "mean": float(state[q + "sum"]) / n,
            key + "max": float(state[q + "max"]),
            key + "min": float(state[q + "min"]),
            key + "fraction_high": int(state[q + "hi"]) / frac_den,
            key + "fraction_low": int(state[q + "lo"]) / frac_den,
            key + "std": math.sqrt(max(float(state[q + "c2"]) / n - c_mean * c_mean, 0.0)) if n > 1 else 0.0,
            key + "seq_mean": s_mean,
            key + "seq_std": math.sqrt(max(s_var, 0.0)),
            key + "seq_max": float(state[q + "seq_max"]),
            key + "seq_min": float(state[q + "seq_min"]),
            key + "seq_max_deviation": float(state[q + "seq_dev"]),
            key + "seq_fraction_high": int(state[q + "seq_hi"]) / ne,
            key + "masked_fraction": int(state[q + "masked"]) / n,
            key + "seq_masked_fraction": int(state[q + "seq_masked"]) / ne,
        })
        if option.endswith("k1"):
            out[key + "seq_fraction_low"] = int(state[q + "seq_lo"]) / ne
    out["rollout_rs_masked_fraction"] = int(state[p + "rs_masked"]) / n
    out["rollout_rs_seq_masked_fraction"] = int(state[p + "rs_seq_masked"]) / rows
    return out



def _verl_figures() -> tuple[Figure, ...]:
    out: list[Figure] = []
    enabled = under("verl")
    for ours, theirs, need, train in _VERL_SETS.values():
        for name, meaning in (*_VERL_IS.items(), *_VERL_OFF.items()):
            out.append(Figure(ours + name, f"{meaning}; {train}, rollout = old_logp", section="verl",
                              needs=(need,), enabled=enabled, peers={"verl": theirs + name}))
        out.append(Figure(ours + "rollout_is_oob_ratio", f"fraction of tokens with raw w outside [L, U] "
                          f"(IcePop, --rollout-is-threshold L_U); {train}", section="verl", needs=(need,),
                          enabled=_icepop, reduce="fraction", peers={"verl": theirs + "rollout_is_oob_ratio"}))
        out.extend(_rs_figures(ours, theirs, need, train))
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
    specs.update({f"{p}{c}": count() for c in ("n", "n_high", "n_low", "n_oob", "rows", "rows_high", "rows_low")})
    specs.update({f"{p}{m}": maximum() for m in ("w_max", "r_max", "dev_max", "diff_max", "lr_max")})
    specs.update({f"{p}{m}": minimum() for m in ("w_min", "r_min", "diff_min", "lr_min")})
    return specs


def _verl_update(state: MetricState, p: str, train: Tensor, rollout: Tensor, cu: Tensor, c: float,
                 truncate: bool = True, *, level: str = "token", lower: float | None = None) -> None:
    """Fold verl's IS and off-policy sums of one batch (valid tokens, packed) into ``state`` (prefix ``p``).

    ``level``: verl's ``rollout_is`` (``"sequence"``: every token of a sequence has the weight exp(clamp(Σ ℓ, ±20)),
    the ``ratio_fraction_*``, ``max`` and ``min`` then come from the per-sequence log-sums over all sequences).
    ``lower``: IcePop's lower bound (weights outside [lower, C] become 0); ``None`` truncates at C (TIS).
    ``truncate``: verl 0.8 and later take the IS statistics of the processed weights; ``False`` is verl 0.7 and
    earlier (mean, extrema and per-sequence figures of the raw w, std and ESS of clamp(w, lower or 1/C, C))."""
    t, r = f64(train), f64(rollout)
    log_terms = verl_log_ratio_terms(t, r, cu)
    weights = verl_is_terms(log_terms, cu, level=level, threshold=c, threshold_lower=lower, truncate=truncate)
    off = verl_offpolicy_terms(t, r, cu, log_terms)
    w, v, row_w = weights["stat"], weights["spread"], weights["seq_mean"]
    n_rows = row_w.numel()
    diff = off["log_ppl_diff"]
    upd: dict[str, Tensor] = {
        "n": torch.tensor(t.numel()), "w": w.sum(), "v": v.sum(), "v2": (v * v).sum(),
        "n_high": weights["high"].sum(), "n_low": weights["low"].sum(),
        "rows": torch.tensor(n_rows), "r": row_w.sum(), "r2": (row_w * row_w).sum(),
        "rows_high": weights["seq_high"].sum(), "rows_low": weights["seq_low"].sum(),
        "ppl_t": off["training_ppl"].sum(), "lppl_t": off["training_log_ppl"].sum(), "kl": off["kl"].sum(),
        "k3": off["k3_kl"].sum(), "ppl_r": off["rollout_ppl"].sum(), "lppl_r": off["rollout_log_ppl"].sum(),
        "diff": diff.sum(), "adiff": off["log_ppl_abs_diff"].sum(), "pplratio": off["ppl_ratio"].sum(),
        "rho2": off["chi2_token"].sum(), "chi2seq": off["chi2_seq"].sum(),
    }
    if "oob" in weights:  # IcePop
        upd["n_oob"] = weights["oob"].sum()
    if level == "token" and t.numel():  # at sequence level the extremes come from the log-sums
        upd.update(w_max=w.max(), w_min=w.min())
    if n_rows:
        upd.update(r_max=row_w.max(), r_min=row_w.min(), dev_max=weights["seq_deviation"].max(), diff_max=diff.max(),
                   diff_min=diff.min())
        if level == "sequence":
            row_log = weights["seq_log_ratio"]
            upd.update(lr_max=row_log.max(), lr_min=row_log.min())
    state.update(**{p + k: v for k, v in upd.items()})


def _verl_compute(state: MetricState, p: str, config: AnalyzeConfig) -> dict[str, float]:
    n, rows = int(state[p + "n"]), int(state[p + "rows"])
    if n == 0 or rows == 0:  # verl raises on a batch without valid tokens
        return {}
    sequence = config.rollout_is == "sequence"
    mean = float(state[p + "w"]) / n
    v_mean, v_sq = float(state[p + "v"]) / n, float(state[p + "v2"]) / n
    r_mean = float(state[p + "r"]) / rows
    r_var = (float(state[p + "r2"]) - rows * r_mean * r_mean) / (rows - 1) if rows > 1 else 0.0
    if sequence:  # verl: exp of the extreme log-sums (the max capped at exp(20)), fractions over sequences
        is_max = math.exp(min(float(state[p + "lr_max"]), VERL_SAFETY_BOUND))
        is_min = math.exp(float(state[p + "lr_min"]))
    else:
        is_max, is_min = float(state[p + "w_max"]), float(state[p + "w_min"])
    frac_den = rows if sequence else n
    out = {
        "rollout_is_mean": mean,
        "rollout_is_max": is_max,
        "rollout_is_min": is_min,
        "rollout_is_std": math.sqrt(max(v_sq - v_mean * v_mean, 0.0)) if n > 1 else 0.0,
        "rollout_is_eff_sample_size": (v_mean + 1e-8) ** 2 / v_sq if v_sq > 0 else math.nan,
        "rollout_is_ratio_fraction_high": int(state[p + "n_high"]) / frac_den,
        "rollout_is_ratio_fraction_low": int(state[p + "n_low"]) / frac_den,
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
    if config.verl_is_bounds()[1] is not None:
        out["rollout_is_oob_ratio"] = int(state[p + "n_oob"]) / n
    return out


class VerlPeerGroup(MetricGroup):
    """verl's rollout-correction figures (``--names verl``): ``rollout_corr/*`` from verl's recomputed old
    log-probs (our ``prox_logp``) against the rollout's (our ``old_logp``), ``actor/rollout_corr/*`` (bypass mode:
    the current policy, our ``new_logp``, against the rollout), the Pearson figure and ``critic/score/*``.

    The importance weights follow verl's ``rollout_is`` (``--rollout-is``, default token level) and
    ``rollout_is_threshold`` (``--rollout-is-threshold``: truncation (TIS) at C, default ``--is-threshold``, or
    IcePop ``L_U``); verl 0.8 and later take the statistics of the processed weights (w = [4, 0.25, 1], C = 2:
    mean 1.083, max 2, ESS 0.695), ``--convention verl<=0.7`` those of the raw weights (1.75, 4, 0.778). With
    ``--rollout-rs``/``--rollout-rs-threshold`` (verl's ``rollout_rs``) the rejection-sampling figures
    ``rollout_rs_*`` are computed too. verl logs all of them per training batch (``--group-by step``).
    """

    name = "verl"
    figures = _verl_figures()

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "rewards"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        if config.peer() != "verl":
            return MetricState({}, device)
        bounds = _rs_bounds(config)
        specs = {**_verl_specs("d_"), **_verl_specs("b_"), **_rs_specs("d_", bounds), **_rs_specs("b_", bounds)}
        specs.update({k: total() for k in (*_PEARSON_SUMS, "score")})
        specs.update(pn=count(), n_scored=count(), score_max=maximum(), score_min=minimum())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "verl":
            return
        (c, lower), truncate = config.verl_is_bounds(), config.convention != "verl<=0.7"
        bounds, cu = _rs_bounds(config), valid.cu_seqlens
        if valid.old_logp is not None:
            pairs = [("b_", valid.new_logp)] + ([("d_", valid.prox_logp)] if valid.prox_logp is not None else [])
            for prefix, train in pairs:
                _verl_update(state, prefix, train, valid.old_logp, cu, c, truncate, level=config.rollout_is,
                             lower=lower)
                if bounds:
                    _rs_update(state, prefix, train, valid.old_logp, cu, bounds)
            if valid.prox_logp is not None:
                sums = pearson_sums(torch.exp(f64(valid.prox_logp)), torch.exp(f64(valid.old_logp)))
                state.update(**dict(zip(_PEARSON_SUMS, sums)), pn=torch.tensor(valid.n_tokens))
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
        bounds = _rs_bounds(config)
        for prefix, (ours, _, _, _) in (("d_", _VERL_SETS["decoupled"]), ("b_", _VERL_SETS["bypass"])):
            out.update({ours + k: v for k, v in _verl_compute(state, prefix, config).items()})
            if bounds:
                out.update({ours + k: v for k, v in _rs_compute(state, prefix, bounds).items()})
        n = int(state["pn"])
        if n > 1:
            pearson = pearson_from_sums(n, *(float(state[k]) for k in _PEARSON_SUMS))
            out[_VERL_PEARSON] = math.nan if pearson is None else pearson
        m = int(state["n_scored"])
        if m:
            out[_VERL_SCORE + "mean"] = float(state["score"]) / m
            out[_VERL_SCORE + "max"] = float(state["score_max"])
            out[_VERL_SCORE + "min"] = float(state["score_min"])
        return out
