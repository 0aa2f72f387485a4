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
from grpo_cli.core.peer_figures import verl_rs_options, verl_rs_thresholds
from grpo_cli.core.peer_verl_rollout import (
    verl_count_specs,
    verl_counts,
    verl_is_figures,
    verl_is_specs,
    verl_is_sums,
    verl_log_ratio_terms,
    verl_offpolicy_figures,
    verl_offpolicy_specs,
    verl_offpolicy_sums,
)
from grpo_cli.core.peer_verl_rs import verl_rs_figures, verl_rs_specs, verl_rs_sums
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


def _verl_specs(p: str, bounds: dict[str, tuple[float | None, float]]) -> dict[str, StateSpec]:
    specs = {**verl_count_specs(), **verl_is_specs(), **verl_offpolicy_specs(), **verl_rs_specs(bounds)}
    return {p + k: spec for k, spec in specs.items()}


def _verl_update(state: MetricState, p: str, train: Tensor, rollout: Tensor, cu: Tensor, config: AnalyzeConfig,
                 bounds: dict[str, tuple[float | None, float]]) -> None:
    """Fold verl's IS, off-policy and rejection-sampling sums of one batch (valid tokens, packed; float64) into
    ``state`` (prefix ``p``). The weights follow ``--rollout-is`` and ``--rollout-is-threshold`` (TIS at C, or
    IcePop's [lower, C]); ``--convention verl<=0.7`` takes the statistics of the raw weights."""
    t, r = f64(train), f64(rollout)
    (c, lower), truncate = config.verl_is_bounds(), config.convention != "verl<=0.7"
    log_terms = verl_log_ratio_terms(t, r, cu)
    _, is_sums = verl_is_sums(log_terms, cu, level=config.rollout_is, threshold=c, threshold_lower=lower,
                              truncate=truncate)
    upd = {**verl_counts(t.numel(), cu), **is_sums, **verl_offpolicy_sums(t, r, cu, log_terms)}
    if bounds:
        upd.update(verl_rs_sums(t, r, cu, bounds)[1])
    state.update(**{p + k: v for k, v in upd.items()})


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
        specs = {**_verl_specs("d_", bounds), **_verl_specs("b_", bounds)}
        specs.update({k: total() for k in (*_PEARSON_SUMS, "score")})
        specs.update(pn=count(), n_scored=count(), score_max=maximum(), score_min=minimum())
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if config.peer() != "verl":
            return
        bounds, cu = _rs_bounds(config), valid.cu_seqlens
        if valid.old_logp is not None:
            pairs = [("b_", valid.new_logp)] + ([("d_", valid.prox_logp)] if valid.prox_logp is not None else [])
            for prefix, train in pairs:
                _verl_update(state, prefix, train, valid.old_logp, cu, config, bounds)
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
        icepop = config.verl_is_bounds()[1] is not None
        for prefix, (ours, _, _, _) in (("d_", _VERL_SETS["decoupled"]), ("b_", _VERL_SETS["bypass"])):
            figures = verl_is_figures(state, level=config.rollout_is, icepop=icepop, prefix=prefix)
            oob = figures.pop("rollout_is_oob_ratio", None)  # reported after the off-policy figures
            figures.update(verl_offpolicy_figures(state, prefix=prefix))
            if oob is not None:
                figures["rollout_is_oob_ratio"] = oob
            if bounds:
                figures.update(verl_rs_figures(state, bounds, prefix=prefix))
            out.update({ours + k: v for k, v in figures.items()})
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
