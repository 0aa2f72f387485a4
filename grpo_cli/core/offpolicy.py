"""Off-policy diagnostics as a functional core: ``*_state`` / ``*_update`` / ``*_compute``.

Inputs are *valid tokens only* (compacted by the loss mask), packed with ``cu_seqlens``. Every figure is computed
from a :class:`~grpo_cli.core.state.MetricState` (int64 counts, float64 sums, min/max, int64 histograms), so it does
not depend on batching, workers or ranks. Log-probs are rescaled to T = 1 exactly as :mod:`policy_stats` does
(``logp ← T·logp``), so these figures sit consistently beside the GRPOMetric family's.

Notation: ``x = new − old`` (training vs behaviour policy, samples from old), ``w = exp(x)`` the per-token
importance weight π_θ/π_old, ``y = ref − new`` (reference vs training, samples from new), ``r = exp(new − base)``
the PPO ratio with ``base = prox`` when present, else ``old``.

- KL families (:func:`kl_families_update`): ``kl/k1 = mean(−x)``, ``kl/k2 = mean(x²/2)``, ``kl/k3 = mean(eˣ − 1 − x)``
  (AReaL ``kl_div_direct/taylor/dual``; Schulman's k1/k2/k3 of KL(π_old ‖ π_θ)) via :func:`kl.kl_estimate`, and
  ``kl_ref/k1 = mean(−y)``, ``kl_ref/k2 = mean(y²/2)``, ``kl_ref/k3 = mean(eʸ − 1 − y)`` (KL(π_θ ‖ π_ref)).
- Decoupled PPO (:func:`behave_update`): the behaviour weight ``exp(prox − old)`` and ``prox − old`` over the tokens
  AReaL's rejection sampling keeps (:func:`rejection.apply_rejection_sampling`, reused as is).
- Importance-weight health (:func:`importance_update`): verl's rollout-correction metrics, see
  ``docs/metrics.md`` for which use truncated weights.
- Distributions (:func:`distributions_update`): ``r`` and ``|x|`` as exact moments plus fixed-edge histograms
  (:mod:`grpo_cli.core.histogram`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.histogram import distribution_compute, distribution_specs, distribution_update
from grpo_cli.core.kl import kl_estimate
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_sum
from grpo_cli.core.policy_stats import rescale_to_unit_temperature
from grpo_cli.core.rejection import RejectionSamplingConfig, apply_rejection_sampling
from grpo_cli.core.state import MetricState, count, maximum, minimum, total

__all__ = [
    "CHI2_SEQ_LOG_CLAMP",
    "KL_FAMILY_KINDS",
    "SPIKE_RATIO",
    "behave_compute",
    "behave_state",
    "behave_update",
    "distributions_compute",
    "distributions_state",
    "distributions_update",
    "importance_compute",
    "importance_state",
    "importance_update",
    "kl_families_compute",
    "kl_families_state",
    "kl_families_update",
    "pearson_from_sums",
    "pearson_sums",
    "working_logp",
]

KL_FAMILY_KINDS = ("k1", "k2", "k3")
SPIKE_RATIO = 1e3
"""``spikes/n_ratio_gt_1e3`` counts tokens with w = exp(new − old) above this (OpenRLHF#931's 5e8 jumps)."""
CHI2_SEQ_LOG_CLAMP = 20.0
"""verl's ``SAFETY_BOUND``: the sequence log-weight is clamped to ±20 before ``exp(2·…)`` in ``is/chi2_seq``."""


def working_logp(logp: Tensor, temperature: float) -> Tensor:
    """Log-probs in the working dtype (16-bit floats via float32), rescaled to T = 1 like ``policy_stats``."""
    if logp.dtype in (torch.float16, torch.bfloat16):
        logp = logp.to(torch.float32)
    return rescale_to_unit_temperature(logp, temperature)


def _f64sum(x: Tensor) -> Tensor:
    return x.sum(dtype=torch.float64)


def _mean(s: MetricState, num: str, den: str) -> float:
    return float(s[num]) / int(s[den])


# -- KL families ------------------------------------------------------------------------------------------------


def kl_families_state(
    device: torch.device | str | None = None, *, old_kinds: tuple[str, ...] = KL_FAMILY_KINDS
) -> MetricState:
    """An empty state for :func:`kl_families_update`.

    Args:
        device: where the state lives.
        old_kinds: the ``kl/*`` estimators to fold (a subset of :data:`KL_FAMILY_KINDS`); the analyze group
            leaves out ``k3``, which ``kl/k3``'s own group (``core.policy_stats``) already reports.
    """
    unknown = sorted(set(old_kinds) - set(KL_FAMILY_KINDS))
    if unknown:
        raise ValueError(f"old_kinds: unknown estimator(s) {unknown}; choose from {KL_FAMILY_KINDS}")
    specs = {"n_old": count(), "sum_abs": total(), "max_abs": maximum(), "n_ref": count()}
    for kind in KL_FAMILY_KINDS:
        if kind in old_kinds:
            specs[f"old_{kind}"] = total()
        specs[f"ref_{kind}"] = total()
    return MetricState(specs, device)


def kl_families_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    temperature: float = 1.0,
    clamp: float | None = None,
) -> None:
    """Fold one batch of valid tokens into ``state``.

    Args:
        state: from :func:`kl_families_state`.
        new_logp: ``[N]`` log π_θ.
        old_logp: ``[N]`` behaviour log-probs (``kl/*``), or ``None``.
        ref_logp: ``[N]`` reference log-probs (``kl_ref/*``), or ``None``.
        temperature: sampling temperature (log-probs are rescaled by it).
        clamp: clamp every per-token estimate to ``[−clamp, clamp]`` (``--kl-clamp``); ``|x|`` is never clamped.
    """
    new = working_logp(new_logp, temperature)
    n = new.numel()
    if n == 0:
        return
    if old_logp is not None:
        old = working_logp(old_logp, temperature)
        # kl_estimate(a, b) works on delta = a − b: with delta = old − new = −x, k1 = −x, k2 = x²/2 and
        # k3 = e^(−delta) − 1 + delta = eˣ − 1 − x (the same bits as policy_stats' expm1(x) − x).
        sums = {f"old_{k}": _f64sum(kl_estimate(old, new, k, clamp)) for k in KL_FAMILY_KINDS if f"old_{k}" in state}
        abs_diff = (new - old).abs()
        state.update(n_old=torch.tensor(n), sum_abs=_f64sum(abs_diff), max_abs=abs_diff.max(), **sums)
    if ref_logp is not None:
        ref = working_logp(ref_logp, temperature)
        # delta = new − ref = −y: k1 = −y, k2 = y²/2, k3 = eʸ − 1 − y.
        sums = {f"ref_{k}": _f64sum(kl_estimate(new, ref, k, clamp)) for k in KL_FAMILY_KINDS}
        state.update(n_ref=torch.tensor(n), **sums)


def kl_families_compute(state: MetricState) -> dict[str, Any]:
    """``kl/k1``, ``kl/k2``, ``kl/k3``, ``kl/abs_diff_mean``, ``kl/abs_diff_max`` and ``kl_ref/k1..k3`` as far as
    their inputs were seen."""
    out: dict[str, Any] = {}
    if int(state["n_old"]) > 0:
        out.update({f"kl/{k}": _mean(state, f"old_{k}", "n_old") for k in KL_FAMILY_KINDS if f"old_{k}" in state})
        out["kl/abs_diff_mean"] = _mean(state, "sum_abs", "n_old")
        out["kl/abs_diff_max"] = float(state["max_abs"])
    if int(state["n_ref"]) > 0:
        out.update({f"kl_ref/{k}": _mean(state, f"ref_{k}", "n_ref") for k in KL_FAMILY_KINDS})
    return out


# -- decoupled PPO: behaviour weights and rejection sampling ------------------------------------------------------


def behave_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`behave_update`."""
    specs = {
        "n_kept": count(),
        "sum_w": total(),
        "min_w": minimum(),
        "max_w": maximum(),
        "sum_kl": total(),
        "n_rs": count(),
        "n_filtered": count(),
    }
    return MetricState(specs, device)


def behave_update(
    state: MetricState,
    *,
    prox_logp: Tensor,
    old_logp: Tensor,
    cu_seqlens: Tensor,
    temperature: float = 1.0,
    rejection: RejectionSamplingConfig | None = None,
) -> None:
    """Fold one batch of valid tokens: AReaL's ``behave_imp_weight`` / ``behave_approx_kl`` statistics.

    Without ``rejection`` the weight is ``exp(prox − old)`` on every token. With it, ``(mask, weight)`` come from
    :func:`~grpo_cli.core.rejection.apply_rejection_sampling` (token or sequence level; for the sequence-level
    ratio metric the weight is the sequence's geometric mean, for ``clamp`` the truncated weight) and the
    statistics run over the kept tokens, as AReaL logs them over ``behave_mask``.

    Args:
        state: from :func:`behave_state`.
        prox_logp, old_logp: ``[N]`` proximal and behaviour log-probs of the valid tokens.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens (sequence-level rejection needs them).
        temperature: sampling temperature (log-probs are rescaled by it).
        rejection: AReaL's rejection-sampling configuration, or ``None``.
    """
    prox = working_logp(prox_logp, temperature)
    old = working_logp(old_logp, temperature)
    n = prox.numel()
    if n == 0:
        return
    delta = prox - old  # AReaL behave_approx_kl = ℓp − ℓb
    if rejection is None:
        weight = torch.exp(delta)
    else:
        everything = torch.ones(n, dtype=torch.bool, device=prox.device)
        keep, weight, fraction = apply_rejection_sampling(prox, old, everything, cu_seqlens, rejection)
        # fraction = filtered / n exactly as a Python float, so rounding fraction·n recovers the integer count.
        state.update(n_rs=torch.tensor(n), n_filtered=torch.tensor(round(fraction * n)))
        weight, delta = weight[keep], delta[keep]
    state.update(n_kept=torch.tensor(weight.numel()))
    if weight.numel():
        state.update(sum_w=_f64sum(weight), min_w=weight.min(), max_w=weight.max(), sum_kl=_f64sum(delta))


def behave_compute(state: MetricState) -> dict[str, Any]:
    """``behave/imp_weight_mean|min|max``, ``behave/approx_kl`` (over kept tokens) and ``rs/filtered_fraction``."""
    out: dict[str, Any] = {}
    if int(state["n_kept"]) > 0:
        out["behave/imp_weight_mean"] = _mean(state, "sum_w", "n_kept")
        out["behave/imp_weight_min"] = float(state["min_w"])
        out["behave/imp_weight_max"] = float(state["max_w"])
        out["behave/approx_kl"] = _mean(state, "sum_kl", "n_kept")
    if int(state["n_rs"]) > 0:
        out["rs/filtered_fraction"] = int(state["n_filtered"]) / int(state["n_rs"])
    return out


# -- importance-weight health (verl rollout-correction metrics) ---------------------------------------------------


def pearson_sums(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Σa, Σb, Σa², Σb², Σab)`` of paired values, the sums :func:`pearson_from_sums` reads: ``prob/pearson`` and
    verl's ``training/rollout_actor_probs_pearson_corr`` (the ``--names verl`` group) stream them."""
    return a.sum(), b.sum(), (a * a).sum(), (b * b).sum(), (a * b).sum()


def pearson_from_sums(n: int, sa: float, sb: float, saa: float, sbb: float, sab: float) -> float | None:
    """Pearson correlation of ``n`` pairs from :func:`pearson_sums` (population moments); ``None`` when either
    variance is not positive.

    Example:
        >>> pearson_from_sums(3, 6.0, 12.0, 14.0, 56.0, 28.0)  # a = [1, 2, 3], b = 2a
        1.0
    """
    ea, eb = sa / n, sb / n
    var_a, var_b = saa / n - ea * ea, sbb / n - eb * eb
    if var_a > 0 and var_b > 0:
        return (sab / n - ea * eb) / math.sqrt(var_a * var_b)
    return None


def importance_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`importance_update`."""
    specs = {
        # token weights w: n, Σ(w − 1), Σ(w − 1)² (shifted by 1: no cancellation near w ≈ 1), extrema, tails
        "n": count(),
        "w_s1": total(),
        "w_s2": total(),
        "w_min": minimum(),
        "w_max": maximum(),
        "n_high": count(),
        "n_low": count(),
        "n_spike": count(),
        # truncated weights w̃ = clamp(w, 1/C, C), shifted by 1
        "wt_s1": total(),
        "wt_s2": total(),
        # per non-empty sequence
        "n_seq": count(),
        "n_seq_old": count(),
        "chi2_seq": total(),
        "ppl_new": total(),
        "ppl_old": total(),
        "log_diff": total(),
        "abs_log_diff": total(),
        "ppl_ratio": total(),
        # Pearson correlation of token probabilities a = e^new, b = e^old
        "pa": total(),
        "pb": total(),
        "paa": total(),
        "pbb": total(),
        "pab": total(),
    }
    return MetricState(specs, device)


def importance_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    cu_seqlens: Tensor,
    old_logp: Tensor | None = None,
    threshold: float = 2.0,
    temperature: float = 1.0,
) -> None:
    """Fold one batch of valid tokens into ``state`` (see :func:`importance_compute` for the figures).

    Args:
        state: from :func:`importance_state`.
        new_logp: ``[N]`` log π_θ.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens (empty sequences allowed, and skipped).
        old_logp: ``[N]`` behaviour log-probs; without them only ``ppl/new`` is available.
        threshold: verl's ``rollout_is_threshold`` C (``--is-threshold``).
        temperature: sampling temperature (log-probs are rescaled by it).
    """
    new = working_logp(new_logp, temperature)
    old = None if old_logp is None else working_logp(old_logp, temperature)
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    non_empty = lengths > 0
    n_tok = lengths[non_empty].to(torch.float64)
    n = new.numel()
    # Per-sequence float64 sums of new (and old, log w): segmented sums of contiguous runs, column by column (the
    # bits of an index_add_ over the stacked columns, without building the [N, 3] float64 copy).
    columns = [new] if old is None else [new, old, new - old]
    seq_sums = torch.stack([segment_sum(c, cu_seqlens, torch.float64) for c in columns], dim=1)
    seq_sums = seq_sums[non_empty]
    mean_new = seq_sums[:, 0] / n_tok
    # verl compute_offpolicy_metrics: training_ppl = batch mean of per-sequence exp(−mean log-prob).
    state.update(n_seq=non_empty.sum(), ppl_new=_f64sum(torch.exp(-mean_new)))
    if old is None or n == 0:
        return
    log_w = new - old
    w = torch.exp(log_w)
    centred = w.to(torch.float64) - 1
    truncated = w.clamp(1 / threshold, threshold).to(torch.float64) - 1
    state.update(
        n=torch.tensor(n),
        w_s1=centred.sum(),
        w_s2=(centred * centred).sum(),
        w_min=w.min(),
        w_max=w.max(),
        # Compared in w's dtype against the bounds rounded to it, as verl compares its float32 weights.
        n_high=(w > threshold).sum(),
        n_low=(w < 1 / threshold).sum(),
        n_spike=(w > SPIKE_RATIO).sum(),
        wt_s1=truncated.sum(),
        wt_s2=(truncated * truncated).sum(),
    )
    seq_log_w = seq_sums[:, 2]
    mean_old = seq_sums[:, 1] / n_tok
    log_diff = mean_old - mean_new  # verl log_ppl_diff = mean lp_rollout − mean lp_training = log(ppl_θ / ppl_old)
    bound = CHI2_SEQ_LOG_CLAMP
    state.update(
        n_seq_old=non_empty.sum(),
        chi2_seq=_f64sum(torch.expm1(2 * seq_log_w.clamp(-bound, bound))),
        ppl_old=_f64sum(torch.exp(-mean_old)),
        log_diff=_f64sum(log_diff),
        abs_log_diff=_f64sum(log_diff.abs()),
        ppl_ratio=_f64sum(torch.exp(log_diff)),
    )
    sums = pearson_sums(torch.exp(new).to(torch.float64), torch.exp(old).to(torch.float64))
    state.update(**dict(zip(("pa", "pb", "paa", "pbb", "pab"), sums)))


def importance_compute(state: MetricState) -> dict[str, Any]:
    """The figures, with μ₁ = mean(w − 1), μ₂ = mean((w − 1)²) and the same for the truncated w̃:

    - ``is/mean`` = 1 + μ₁, ``is/min``, ``is/max`` (raw w, before any truncation)
    - ``is/std`` = sqrt(μ̃₂ − μ̃₁²) and ``is/ess`` = mean(w̃)² / mean(w̃²) = (1 + μ̃₁)² / (1 + 2μ̃₁ + μ̃₂)
      = 1 / mean((w̃ / mean w̃)²), over w̃ = clamp(w, 1/C, C) as verl's ``rollout_is_std`` /
      ``rollout_is_eff_sample_size``
    - ``is/frac_high`` = mean[w > C], ``is/frac_low`` = mean[w < 1/C]
    - ``is/chi2_token`` = mean(w²) − 1 = μ₂ + 2μ₁ (raw w)
    - ``is/chi2_seq`` = mean over non-empty sequences of exp(2·clamp(Σ_t log w, ±20)) − 1
    - ``ppl/new``, ``ppl/old`` = mean over non-empty sequences of exp(−mean_t logp); with
      Δ_s = mean_t old − mean_t new: ``ppl/log_diff_mean`` = mean Δ_s, ``ppl/log_diff_abs_mean`` = mean |Δ_s|,
      ``ppl/ratio`` = mean exp(Δ_s)
    - ``prob/pearson``: Pearson correlation of e^new and e^old over tokens (absent when either is constant)
    - ``spikes/n_ratio_gt_1e3`` = count[w > 1e3]
    """
    s = state
    out: dict[str, Any] = {}
    if int(s["n_seq"]) > 0:
        out["ppl/new"] = _mean(s, "ppl_new", "n_seq")
    n = int(s["n"])
    if n == 0:
        return out
    m1, m2 = float(s["w_s1"]) / n, float(s["w_s2"]) / n
    t1, t2 = float(s["wt_s1"]) / n, float(s["wt_s2"]) / n
    out.update(
        {
            "is/mean": 1 + m1,
            "is/std": math.sqrt(max(t2 - t1 * t1, 0.0)),
            "is/min": float(s["w_min"]),
            "is/max": float(s["w_max"]),
            "is/ess": (1 + t1) ** 2 / (1 + 2 * t1 + t2),
            "is/frac_high": int(s["n_high"]) / n,
            "is/frac_low": int(s["n_low"]) / n,
            "is/chi2_token": m2 + 2 * m1,
            "spikes/n_ratio_gt_1e3": int(s["n_spike"]),
        }
    )
    if int(s["n_seq_old"]) > 0:
        out["is/chi2_seq"] = _mean(s, "chi2_seq", "n_seq_old")
        out["ppl/old"] = _mean(s, "ppl_old", "n_seq_old")
        out["ppl/log_diff_mean"] = _mean(s, "log_diff", "n_seq_old")
        out["ppl/log_diff_abs_mean"] = _mean(s, "abs_log_diff", "n_seq_old")
        out["ppl/ratio"] = _mean(s, "ppl_ratio", "n_seq_old")
    pearson = pearson_from_sums(n, *(float(s[k]) for k in ("pa", "pb", "paa", "pbb", "pab")))
    if pearson is not None:
        out["prob/pearson"] = pearson
    return out


# -- distributions ----------------------------------------------------------------------------------------------


def distributions_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`distributions_update` (two distributions: ``ratio`` and ``abs_diff``)."""
    return MetricState({**distribution_specs("ratio"), **distribution_specs("abs_diff")}, device)


def distributions_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor | None = None,
    ratio_base_logp: Tensor | None = None,
    temperature: float = 1.0,
) -> None:
    """Fold the PPO ratio ``r = exp(new − base)`` (base = ``ratio_base_logp``, default ``old_logp``) and
    ``|new − old|`` of one batch of valid tokens into their distributions."""
    new = working_logp(new_logp, temperature)
    base = old_logp if ratio_base_logp is None else ratio_base_logp
    if base is not None:
        ratio = torch.exp(new - working_logp(base, temperature))  # as policy_stats' ratio/max
        distribution_update(state, "ratio", ratio, shift=1.0)
    if old_logp is not None:
        distribution_update(state, "abs_diff", (new - working_logp(old_logp, temperature)).abs())


def distributions_compute(state: MetricState) -> dict[str, Any]:
    """``ratio/{p001,p01,p50,p99,p999,mean,min,std,hist}`` (``ratio/max`` is the GRPOMetric family's) and
    ``abs_diff/{p001,...,p999,mean,min,max,std,hist}``."""
    out: dict[str, Any] = {}
    ratio = distribution_compute(state, "ratio", shift=1.0)
    ratio.pop("max", None)
    out.update({f"ratio/{k}": v for k, v in ratio.items()})
    out.update({f"abs_diff/{k}": v for k, v in distribution_compute(state, "abs_diff").items()})
    return out
