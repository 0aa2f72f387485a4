"""Issue 4's off-policy diagnostics as metric groups for ``analyze`` (the math is in ``grpo_cli.core``).

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
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig

__all__ = [
    "DecoupledGroup",
    "DistributionGroup",
    "ImportanceGroup",
    "KLFamiliesGroup",
    "SequenceGroup",
    "StalenessGroup",
    "offpolicy_groups",
]

_NEEDS_OLD = "needs an 'old_logp' column"


def _base(valid: TokenBatch) -> torch.Tensor | None:
    return valid.prox_logp if valid.prox_logp is not None else valid.old_logp


class KLFamiliesGroup(MetricGroup):
    """``kl/k1``, ``kl/k2``, ``kl/abs_diff_*`` and ``kl_ref/*``. ``kl/k3`` is the GRPOMetric family's
    (``PolicyGroup``). ``--kl-clamp`` clamps the per-token ``kl_ref/*`` estimates only: the KL *loss* is what
    peers clamp (verl ``kl_penalty`` for ``low_var_kl``, AReaL ``KLEstimator``); the train/rollout figures ``kl/*``
    are never clamped (verl's ``rollout_corr/k3_kl`` is not)."""

    name = "kl_families"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "ref_logp"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "old_logp" not in columns:
            out.update(dict.fromkeys(["kl/k1", "kl/k2", "kl/abs_diff_mean", "kl/abs_diff_max"], _NEEDS_OLD))
        if "ref_logp" not in columns:
            out.update(dict.fromkeys(("kl_ref/k1", "kl_ref/k2", "kl_ref/k3"), "needs a 'ref_logp' column"))
        return out

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return kl_families_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        kl_families_update(
            state, new_logp=valid.new_logp, old_logp=valid.old_logp, temperature=config.temperature
        )
        kl_families_update(
            state, new_logp=valid.new_logp, ref_logp=valid.ref_logp, temperature=config.temperature,
            clamp=config.kl_clamp,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        out = kl_families_compute(state)
        out.pop("kl/k3", None)  # PolicyGroup's (the same value: both are the unclamped k3 of new − old)
        return out


_BEHAVE_KEYS = ("behave/imp_weight_mean", "behave/imp_weight_min", "behave/imp_weight_max", "behave/approx_kl")
_M2PO_KEYS = ("m2po/masked_fraction", "m2po/m2_mean", "m2po/exact")


class DecoupledGroup(MetricGroup):
    """Decoupled-PPO behaviour weights (§2): ``behave/*``, ``rs/filtered_fraction`` (AReaL rejection sampling, the
    ``--rs-*`` options) and ``m2po/*`` (``--m2-threshold``), when the dump has ``prox_logp`` and ``old_logp``."""

    name = "decoupled"

    def columns(self) -> frozenset[str]:
        return frozenset({"old_logp", "prox_logp"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        if not {"old_logp", "prox_logp"} <= columns:
            reason = "needs 'prox_logp' and 'old_logp' columns (decoupled PPO)"
            return dict.fromkeys((*_BEHAVE_KEYS, "rs/filtered_fraction", *_M2PO_KEYS), reason)
        out: dict[str, str] = {}
        if config.rejection_sampling() is None:
            out["rs/filtered_fraction"] = "rejection sampling is off (set an --rs-* option)"
        if config.m2_threshold is None:
            out.update(dict.fromkeys(_M2PO_KEYS, "M2PO is off (set --m2-threshold)"))
        return out

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


_IS_KEYS = (
    "is/mean", "is/std", "is/min", "is/max", "is/ess", "is/frac_high", "is/frac_low", "is/chi2_token", "is/chi2_seq",
    "ppl/old", "ppl/log_diff_mean", "ppl/log_diff_abs_mean", "ppl/ratio", "prob/pearson", "spikes/n_ratio_gt_1e3",
)  # fmt: skip


class ImportanceGroup(MetricGroup):
    """Importance-weight health (§3): ``is/*``, ``ppl/*``, ``prob/pearson`` (verl's rollout-correction metrics with
    w = exp(new − old), ``--is-threshold``) and ``spikes/n_ratio_gt_1e3`` (§7)."""

    name = "importance"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        return {} if "old_logp" in columns else dict.fromkeys(_IS_KEYS, _NEEDS_OLD)

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


_RATIO_KEYS = tuple(f"ratio/{k}" for k in (*DEFAULT_QUANTILES, "mean", "min", "std", "hist"))
_ABS_DIFF_KEYS = tuple(f"abs_diff/{k}" for k in (*DEFAULT_QUANTILES, "mean", "min", "max", "std", "hist"))


class DistributionGroup(MetricGroup):
    """Distributions (§4) of the PPO ratio (base = prox_logp if present, else old_logp) and of |new − old|:
    exact moments and extrema, quantiles from fixed-edge histograms (``quantile_rel_error`` in the JSON config)."""

    name = "distributions"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if not {"old_logp", "prox_logp"} & columns:
            out.update(dict.fromkeys(_RATIO_KEYS, "needs 'old_logp' or 'prox_logp'"))
        if "old_logp" not in columns:
            out.update(dict.fromkeys(_ABS_DIFF_KEYS, _NEEDS_OLD))
        return out

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return distributions_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        distributions_update(
            state,
            new_logp=valid.new_logp,
            old_logp=valid.old_logp,
            ratio_base_logp=_base(valid),
            temperature=config.temperature,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return distributions_compute(state)


_STALENESS_KEYS = (
    "staleness/n_tokens", "staleness/theta_mean", "staleness/theta_min", "staleness/theta_max",
    "staleness/proximal_mean", "staleness/proximal_min", "staleness/proximal_max", "staleness/hist", "by_staleness",
)  # fmt: skip
_SANITY_KEYS = ("sanity/n_on_policy_tokens", "sanity/on_policy_ratio_dev")


class StalenessGroup(MetricGroup):
    """Staleness (§5) and the on-policy ratio check (§7): needs ``versions`` and a current version (the
    ``current_version`` column, else ``--current-version``)."""

    name = "staleness"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "versions", "current_version", "advantages"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        reason = None
        if "versions" not in columns:
            reason = "needs a 'versions' column"
        elif "current_version" not in columns and config.current_version is None:
            reason = "needs a 'current_version' column or --current-version"
        if reason is not None:
            return dict.fromkeys((*_STALENESS_KEYS, *_SANITY_KEYS), reason)
        return {} if "old_logp" in columns else dict.fromkeys(_SANITY_KEYS, _NEEDS_OLD)

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
            ratio_base_logp=_base(valid),
            advantages=valid.advantages,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            temperature=config.temperature,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return staleness_compute(state)


_ADV_KEYS = ("adv/mean", "adv/std", "adv/pos_frac", "adv/neg_frac", "adv/zero_frac")


class SequenceGroup(MetricGroup):
    """Sequences and groups (§6): ``adv/*``, ``seq/len_*``, ``reward/*``, ``groups/*``."""

    name = "sequences"

    def columns(self) -> frozenset[str]:
        return frozenset({"advantages", "rewards", "group_id"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "advantages" not in columns:
            out.update(dict.fromkeys(_ADV_KEYS, "needs an 'advantages' column"))
        if "rewards" not in columns:
            out.update(dict.fromkeys(("reward/mean", "reward/std"), "needs a 'rewards' column"))
        if not {"rewards", "group_id"} <= columns:
            out.update(dict.fromkeys(("groups/n", "groups/zero_std_frac"), "needs 'group_id' and 'rewards' columns"))
        return out

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
        return sequence_stats_compute(state)  # type: ignore[arg-type]


def offpolicy_groups() -> list[MetricGroup]:
    """Issue 4's groups, in report order (after ``PolicyGroup``: :class:`KLFamiliesGroup` may replace ``kl/k3``)."""
    return [
        KLFamiliesGroup(),
        DecoupledGroup(),
        ImportanceGroup(),
        DistributionGroup(),
        StalenessGroup(),
        SequenceGroup(),
    ]
