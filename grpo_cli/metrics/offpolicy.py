"""The off-policy diagnostics as metric groups for ``analyze`` (the math is in ``grpo_cli.core``).

:func:`offpolicy_groups` lists them in report order; each reads the valid-token view of a batch, calls its core
``*_update`` and reports with its core ``*_compute``. Keys whose inputs the dump lacks, or whose option is off, are
listed by :meth:`omitted` with the reason. ``docs/metrics.md`` documents every key.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.histogram import DEFAULT_QUANTILES
from grpo_cli.core.m2po import m2po_stream_compute, m2po_stream_state, m2po_stream_update
from grpo_cli.core.offpolicy import (
    behave_compute,
    behave_state,
    behave_update,
    distributions_compute,
    distributions_state,
    distributions_update,
    importance_compute,
    importance_state,
    importance_update,
    kl_families_compute,
    kl_families_state,
    kl_families_update,
)
from grpo_cli.core.sequences import sequence_stats_compute, sequence_stats_state, sequence_stats_update
from grpo_cli.core.staleness import staleness_compute, staleness_state, staleness_update
from grpo_cli.core.state import MetricState
from grpo_cli.engine.figures import Figure, Requirement, column, columns, option
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.policy import ADV, BASE, OLD

_U = "ppo_actor/update/"  # AReaL's actor statistics
# Labels of the histogram quantiles the core reports (DEFAULT_QUANTILES).
_QUANTILE_LABELS = {"p001": "0.1 %", "p01": "1 %", "p50": "median", "p99": "99 %", "p999": "99.9 %"}

REF = column("ref_logp")
DECOUPLED = columns("old_logp", "prox_logp", reason="needs 'prox_logp' and 'old_logp' columns (decoupled PPO)")
REJECTION_SAMPLING = option(lambda c: c.rejection_sampling() is not None,
                            "rejection sampling is off (set an --rs-* option)")
M2PO = option(lambda c: c.m2_threshold is not None, "M2PO is off (set --m2-threshold)")
LAGS = (column("versions"), Requirement("needs a 'current_version' column or --current-version",
                                        lambda cols, c: "current_version" in cols or c.current_version is not None))
REWARDS = column("rewards")
GROUPS = columns("rewards", "group_id")

__all__ = [
    "DecoupledGroup",
    "DistributionGroup",
    "ImportanceGroup",
    "KLFamiliesGroup",
    "SequenceGroup",
    "StalenessGroup",
    "offpolicy_groups",
]



class KLFamiliesGroup(MetricGroup):
    """``kl/k1``, ``kl/k2``, ``kl/abs_diff_*`` and ``kl_ref/*``. ``kl/k3`` is the GRPOMetric family's
    (``PolicyGroup``). ``--kl-clamp`` clamps the per-token ``kl_ref/*`` estimates only: the KL *loss* is what
    peers clamp (verl ``kl_penalty`` for ``low_var_kl``, AReaL ``KLEstimator``); the train/rollout figures ``kl/*``
    are never clamped (verl's ``rollout_corr/k3_kl`` is not)."""

    name = "kl_families"
    figures = (
        Figure("kl/k1", "mean(−x), x = new − old: k1 estimate of KL(old ‖ new) (AReaL kl_div_direct)", needs=(OLD,),
               peers={}),
        Figure("kl/k2", "mean(x²/2): k2 estimate (AReaL kl_div_taylor)", needs=(OLD,)),
        Figure("kl/abs_diff_mean", "mean |new − old| (slime train_rollout_logprob_abs_diff)", needs=(OLD,),
               peers={"areal": _U + "logp_abs_diff/avg"}),
        Figure("kl/abs_diff_max", "largest |new − old|", needs=(OLD,),
               peers={"areal": _U + "logp_abs_diff/max"}),
        Figure("kl_ref/k1", "mean(−y), y = ref − new: k1 estimate of KL(new ‖ ref)", needs=(REF,)),
        Figure("kl_ref/k2", "mean(y²/2)", needs=(REF,)),
        Figure("kl_ref/k3", "mean(eʸ − 1 − y): k3 estimate of KL(new ‖ ref) (the usual KL penalty)", needs=(REF,),
               peers={"verl": "actor/kl_loss"}),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "ref_logp"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        # kl/k3 is PolicyGroup's (the same unclamped k3 of new − old): not folded twice.
        return kl_families_state(device, old_kinds=("k1", "k2"))

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        kl_families_update(
            state, new_logp=valid.new_logp, old_logp=valid.old_logp, temperature=config.temperature
        )
        kl_families_update(
            state, new_logp=valid.new_logp, ref_logp=valid.ref_logp, temperature=config.temperature,
            clamp=config.kl_clamp,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return kl_families_compute(state)




class DecoupledGroup(MetricGroup):
    """Decoupled-PPO behaviour weights: ``behave/*``, ``rs/filtered_fraction`` (AReaL rejection sampling, the
    ``--rs-*`` options) and ``m2po/*`` (``--m2-threshold``), when the dump has ``prox_logp`` and ``old_logp``."""

    name = "decoupled"
    figures = (
        Figure("behave/imp_weight_mean", "mean exp(prox − old) (AReaL behave_imp_weight)", needs=(DECOUPLED,)),
        Figure("behave/imp_weight_min", "smallest behaviour weight", needs=(DECOUPLED,)),
        Figure("behave/imp_weight_max", "largest behaviour weight", needs=(DECOUPLED,)),
        Figure("behave/approx_kl", "mean(prox − old) (AReaL behave_approx_kl)", needs=(DECOUPLED,)),
        Figure("rs/filtered_fraction", "valid tokens rejected (mask) or truncated (clamp)", reduce="fraction",
               needs=(DECOUPLED, REJECTION_SAMPLING), peers={"areal": _U + "rs_filtered_fraction"}),
        Figure("m2po/masked_fraction", "valid tokens M2PO masks over the whole dump", reduce="fraction",
               needs=(DECOUPLED, M2PO)),
        Figure("m2po/m2_mean", "mean (old − prox)²; M2PO masks nothing while this is below the threshold",
               needs=(DECOUPLED, M2PO)),
        Figure("m2po/exact", "true when the masked count is exact (≤ 8192 tokens masked)", reduce="flag",
               needs=(DECOUPLED, M2PO)),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"old_logp", "prox_logp"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        specs = dict(behave_state().specs)
        if config.m2_threshold is not None:
            specs.update(m2po_stream_state().specs)
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if valid.prox_logp is None or valid.old_logp is None:
            return
        behave_update(
            state,
            prox_logp=valid.prox_logp,
            old_logp=valid.old_logp,
            cu_seqlens=valid.cu_seqlens,
            temperature=config.temperature,
            rejection=config.rejection_sampling(),
        )
        if config.m2_threshold is not None:
            m2po_stream_update(
                state, old_logp=valid.old_logp, prox_logp=valid.prox_logp, temperature=config.temperature
            )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        out = behave_compute(state)
        if config.m2_threshold is not None:
            out.update(m2po_stream_compute(state, config.m2_threshold))
        return out




class ImportanceGroup(MetricGroup):
    """Importance-weight health: ``is/*``, ``ppl/*``, ``prob/pearson`` (verl's rollout-correction metrics with
    w = exp(new − old), ``--is-threshold``) and ``spikes/n_ratio_gt_1e3``."""

    name = "importance"
    figures = (
        Figure("ppl/new", "mean over sequences of exp(−mean new) (verl training_ppl)", reduce="sequence mean"),
        Figure("is/mean", "mean w (1 when the sampler and trainer agree)", needs=(OLD,)),
        Figure("is/std", "std of w clamped to [1/C, C] (verl rollout_is_std)", needs=(OLD,)),
        Figure("is/min", "smallest w", reduce="min", needs=(OLD,)),
        Figure("is/max", "largest w", reduce="max", needs=(OLD,)),
        Figure("is/ess", "effective sample size fraction 1/mean((w̃/mean w̃)²), w̃ = clamp(w, 1/C, C)", needs=(OLD,)),
        Figure("is/frac_high", "fraction with w > C (--is-threshold)", needs=(OLD,)),
        Figure("is/frac_low", "fraction with w < 1/C", needs=(OLD,)),
        Figure("is/chi2_token", "mean(w²) − 1: token-level χ² divergence", needs=(OLD,)),
        Figure("is/chi2_seq", "mean over sequences of exp(2·clamp(Σ log w, ±20)) − 1", reduce="sequence mean",
               needs=(OLD,)),
        Figure("ppl/old", "mean over sequences of exp(−mean old) (verl rollout_ppl)", reduce="sequence mean",
               needs=(OLD,)),
        Figure("ppl/log_diff_mean", "mean over sequences of (mean old − mean new) = log(ppl_new/ppl_old)",
               reduce="sequence mean", needs=(OLD,)),
        Figure("ppl/log_diff_abs_mean", "mean over sequences of |mean old − mean new|", reduce="sequence mean",
               needs=(OLD,)),
        Figure("ppl/ratio", "mean over sequences of ppl_new / ppl_old", reduce="sequence mean", needs=(OLD,)),
        Figure("prob/pearson", "Pearson correlation of token probabilities e^new vs e^old", reduce="correlation",
               needs=(OLD,)),
        Figure("spikes/n_ratio_gt_1e3", "tokens with exp(new − old) > 1e3 (listed first in top_kl)", needs=(OLD,)),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return importance_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        importance_update(
            state,
            new_logp=valid.new_logp,
            cu_seqlens=valid.cu_seqlens,
            old_logp=valid.old_logp,
            threshold=config.is_threshold,
            temperature=config.temperature,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return importance_compute(state)




class DistributionGroup(MetricGroup):
    """Distributions of the PPO ratio (base = prox_logp if present, else old_logp) and of |new − old|:
    exact moments and extrema, quantiles from fixed-edge histograms (``quantile_rel_error`` in the JSON config)."""

    name = "distributions"
    figures = (
        *(Figure(f"ratio/{q}", f"{label} quantile of the PPO ratio (histogram, see config)", needs=(BASE,))
          for q, label in ((q, _QUANTILE_LABELS[q]) for q in DEFAULT_QUANTILES)),
        Figure("ratio/mean", "mean PPO ratio", needs=(BASE,)),
        Figure("ratio/min", "smallest PPO ratio", needs=(BASE,)),
        Figure("ratio/std", "std of the PPO ratio", needs=(BASE,)),
        Figure("ratio/hist", "log-spaced histogram of the PPO ratio (display)", needs=(BASE,)),
        *(Figure(f"abs_diff/{q}", f"{label} quantile of |new − old| (histogram, see config)", needs=(OLD,))
          for q, label in ((q, _QUANTILE_LABELS[q]) for q in DEFAULT_QUANTILES)),
        Figure("abs_diff/mean", "mean |new − old|", needs=(OLD,)),
        Figure("abs_diff/min", "smallest |new − old|", needs=(OLD,)),
        Figure("abs_diff/max", "largest |new − old|", needs=(OLD,)),
        Figure("abs_diff/std", "std of |new − old|", needs=(OLD,)),
        Figure("abs_diff/hist", "log-spaced histogram of |new − old| (display)", needs=(OLD,)),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return distributions_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        distributions_update(
            state,
            new_logp=valid.new_logp,
            old_logp=valid.old_logp,
            ratio_base_logp=valid.ratio_base_logp,
            temperature=config.temperature,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return distributions_compute(state)




class StalenessGroup(MetricGroup):
    """Staleness and the on-policy ratio check: needs ``versions`` and a current version (the
    ``current_version`` column, else ``--current-version``)."""

    name = "staleness"
    figures = (
        Figure("staleness/n_tokens", "valid generated tokens (versions ≥ 0)", needs=LAGS),
        *(Figure(f"staleness/{lag}_{ours}", meaning, needs=LAGS)
          for lag, ours, meaning in (
              ("theta", "mean", "mean lag current − version (token-weighted)"),
              ("theta", "min", "smallest lag"),
              ("theta", "max", "largest lag"),
              ("proximal", "mean", "mean current − 1 − version (lag behind the proximal policy)"),
              ("proximal", "min", "smallest proximal lag"),
              ("proximal", "max", "largest proximal lag"))),
        Figure("staleness/hist", "tokens per lag", needs=LAGS),
        Figure("by_staleness", "per lag: tokens, kl/k3, clip/ratio, is/mean, abs_diff/mean", section="staleness",
               reduce="table", needs=LAGS),
        Figure("sanity/n_on_policy_tokens", "valid tokens sampled by the trainer's own version (lag 0)",
               needs=(*LAGS, OLD)),
        Figure("sanity/on_policy_ratio_dev", "max |exp(new − old) − 1| over lag-0 tokens (≈ 0 if aligned)",
               reduce="max", needs=(*LAGS, OLD)),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "versions", "current_version", "advantages"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return staleness_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        current = valid.current_version if valid.current_version is not None else config.current_version
        if valid.versions is None or current is None:
            return
        staleness_update(
            state,
            new_logp=valid.new_logp,
            versions=valid.versions,
            current_version=current,
            cu_seqlens=valid.cu_seqlens,
            old_logp=valid.old_logp,
            ratio_base_logp=valid.ratio_base_logp,
            advantages=valid.advantages,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            temperature=config.temperature,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return staleness_compute(state)




class SequenceGroup(MetricGroup):
    """Sequences and groups: ``adv/*``, ``seq/len_*``, ``reward/*``, ``groups/*``."""

    name = "sequences"
    figures = (
        Figure("adv/mean", "mean advantage", needs=(ADV,),
               peers={"areal": "ppo_actor/advantages/avg", "verl": "critic/advantages/mean"}),
        Figure("adv/std", "std of the advantages", needs=(ADV,)),
        Figure("adv/pos_frac", "fraction with A > 0", needs=(ADV,)),
        Figure("adv/neg_frac", "fraction with A < 0", needs=(ADV,)),
        Figure("adv/zero_frac", "fraction with A = 0 (no policy-gradient signal)", needs=(ADV,)),
        Figure("reward/mean", "mean reward per sequence", reduce="sequence mean", needs=(REWARDS,),
               peers={"areal": "ppo_actor/task_reward/avg", "trl": "reward"}),
        Figure("reward/std", "std of the rewards", needs=(REWARDS,)),
        Figure("groups/n", "distinct group_id values", needs=(GROUPS,)),
        Figure("groups/zero_std_frac", "groups whose rewards are all equal (no learning signal)", needs=(GROUPS,),
               peers={"trl": "frac_reward_zero_std"}),
        Figure("seq/len_mean", "mean valid (response) tokens per sequence", reduce="sequence mean",
               peers={"verl": "response_length/mean", "trl": "completions/mean_length"}),
        Figure("seq/len_min", "fewest valid tokens in a sequence",
               peers={"verl": "response_length/min", "trl": "completions/min_length"}),
        Figure("seq/len_max", "most valid tokens in a sequence",
               peers={"verl": "response_length/max", "trl": "completions/max_length"}),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"advantages", "rewards", "group_id"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return sequence_stats_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        sequence_stats_update(
            state,  # type: ignore[arg-type]  # a KeyedState, from init_state
            cu_seqlens=valid.cu_seqlens,
            advantages=valid.advantages,
            rewards=valid.rewards,
            group_id=valid.group_id,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return sequence_stats_compute(state)  # type: ignore[arg-type]  # init_state made a KeyedState


def offpolicy_groups() -> list[MetricGroup]:
    """The off-policy groups, in report order (after ``PolicyGroup``)."""
    return [
        KLFamiliesGroup(),
        DecoupledGroup(),
        ImportanceGroup(),
        DistributionGroup(),
        StalenessGroup(),
        SequenceGroup(),
    ]
