"""Streaming comparison of AReaL's proximal approximations with the recomputed truth (``compare-prox``).

A functional core in the ``*_state`` / ``*_update`` / ``*_compute`` pattern of :mod:`grpo_cli.core.policy_stats`:
:func:`prox_compare_update` folds one batch of whole sequences into a :class:`~grpo_cli.core.state.MetricState`
(int64 counts, float64 sums, maxima, fixed-edge histograms), and :func:`prox_compare_compute` turns the merged
state into figures. Every entry merges by sum/max/min, so the figures do not depend on how the dump was split
into batches, workers or ranks (the p99 is read from a histogram, within :data:`P99_REL_ERROR_BOUND`).

Per token, with ℓp* the recomputed truth, ℓp̂ an approximation (:func:`~grpo_cli.core.prox.
compute_prox_logp_approximations`), the per-token errors of :func:`~grpo_cli.core.prox.prox_approximation_errors`
(AReaL ``compute_logp/<method>/*``), and what the error does to the update, which AReaL does not report:

- *clip flip*: the PPO clip decision of :func:`~grpo_cli.core.ppo.ppo_actor_loss_terms` (``clip_mask`` and,
  with ``c_clip``, ``dual_clip_mask``) differs between ℓp̂ and ℓp*;
- *behaviour-weight flip*: the rejection-sampling outcome of :func:`~grpo_cli.core.rejection.
  apply_rejection_sampling` differs: the token is dropped with one and kept with the other (``action="mask"``),
  or its weight is truncated with one and not the other (``action="clamp"``);
- ``loss/ppo``: AReaL's decoupled PPO loss Σ L / N0 with ℓp̂ instead of ℓp*, streamed as an exact float64
  numerator and an int64 denominator.

Error figures are over *compared* tokens: ``loss_mask`` ∧ ``versions ≥ 0`` (valid generated tokens); the loss is
over the whole loss mask, as the trainer computes it. The staleness lag of a token is k = v_θ − v_b (AReaL's
``sample_staleness_theta``); α = (k − 1)/k for k ≥ 1.

Example:
    >>> import torch
    >>> state = prox_compare_state(("rollout",), max_lag=4)
    >>> prox_compare_update(state, new_logp=torch.tensor([-1.0, -1.0]), old_logp=torch.tensor([-2.0, -2.0]),
    ...                     prox_logp=torch.tensor([-1.5, -1.9]), versions=torch.tensor([3, 4]),
    ...                     current_version=5, cu_seqlens=torch.tensor([0, 2]))
    >>> out = prox_compare_compute(state, tolerance=0.2)
    >>> round(out["prox/rollout/abs_error_mean"], 6), out["prox/rollout/max_safe_lag"]  # (0.5 + 0.1) / 2; lag 1 ok
    (0.3, 1)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core._loss_common import fill_outside
from grpo_cli.core.histogram import N_BINS, QUANTILE_REL_ERROR, ZERO, histogram_counts, histogram_quantiles
from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.prox import (
    PROX_APPROX_METHODS,
    PROX_ERROR_KEYS,
    REL_ERROR_EPS,
    broadcast_current_version,
    compute_prox_logp_approximations,
    prox_approximation_errors,
)
from grpo_cli.core.rejection import RejectionSamplingConfig, apply_rejection_sampling
from grpo_cli.core.staleness import MAX_LAG as STALENESS_MAX_LAG
from grpo_cli.core.staleness import lag_bin_sums, lag_bins
from grpo_cli.core.state import MetricState, count, maximum, total

__all__ = [
    "DEFAULT_MAX_LAG",
    "ProxCompareBatch",
    "DEFAULT_TOLERANCE",
    "LOSS_FIGURES",
    "P99_REL_ERROR_BOUND",
    "PROX_COMPARE_FIGURES",
    "REJECTION_FIGURES",
    "max_safe_lag",
    "prox_compare_compute",
    "prox_compare_fold",
    "prox_compare_prepare",
    "prox_compare_state",
    "prox_compare_update",
    "rejection_changes",
]

DEFAULT_MAX_LAG = STALENESS_MAX_LAG
"""Lags 0..``max_lag`` − 1 get a ``by_staleness`` row each, as in ``analyze``'s ``by_staleness``
(:data:`grpo_cli.core.staleness.MAX_LAG`); lags ≥ ``max_lag`` share one overflow row and negative lags
(v_b > v_θ) another. The state holds ``max_lag + 2`` bins per method whatever the dump."""

DEFAULT_TOLERANCE = 0.01
"""Default bound on a lag's ``abs_error_mean`` for ``max_safe_lag`` (nats of log-probability)."""

P99_REL_ERROR_BOUND: float = QUANTILE_REL_ERROR
"""Relative error bound of ``abs_error_p99``: the shared fixed-edge histogram's
(:data:`grpo_cli.core.histogram.QUANTILE_REL_ERROR`, ≈ 0.39 %) for a p99 in [2^−64, 2^64); an exact 0 is exact."""

PROX_COMPARE_FIGURES: tuple[str, ...] = (
    "abs_error_mean",
    "abs_error_max",
    "abs_error_p99",
    "rel_error_mean",
    "rmse",
    "behave_imp_weight_abs_error_mean",
    "behave_imp_weight_rel_error_mean",
    "importance_weight_abs_error_mean",
    "importance_weight_rel_error_mean",
    "clip_flip_frac",
    "behave_weight_flip_frac",
    "loss_ppo",
    "loss_abs_error",
    "loss_rel_error",
    "by_staleness",
    "max_safe_lag",
)
"""Per-method figures of :func:`prox_compare_compute`, reported as ``prox/<method>/<figure>``."""

# Figures that need the PPO loss (advantages) or rejection sampling; the rest need only the log-probs.
LOSS_FIGURES: tuple[str, ...] = ("clip_flip_frac", "loss_ppo", "loss_abs_error", "loss_rel_error")
REJECTION_FIGURES: tuple[str, ...] = ("behave_weight_flip_frac",)

# Sums of the per-token errors that are reported as means (AReaL's stats_tracker ``avg``).
_MEAN_KEYS = tuple(k for k in PROX_ERROR_KEYS if k != "squared_error")

# A clamp upper bound that never binds on a finite float32 weight: clamping to it reproduces the untruncated
# weight, so a token is truncated exactly where the configured clamp changes its weight.
_FREE_UPPER = float(torch.finfo(torch.float32).max)


def prox_compare_state(
    methods: Iterable[str] | None = None,
    *,
    max_lag: int = DEFAULT_MAX_LAG,
    device: torch.device | str | None = None,
) -> MetricState:
    """An empty state for :func:`prox_compare_update` (counts int64, sums float64).

    Args:
        methods: approximation methods to compare (default all of
            :data:`~grpo_cli.core.prox.PROX_APPROX_METHODS`).
        max_lag: lags 0..``max_lag`` − 1 get a ``by_staleness`` row each (>= 1).
        device: where the state lives (the batches' device).
    """
    names = _methods(methods)
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 1:
        raise ValueError(f"max_lag must be an int >= 1, got {max_lag!r}")
    n_lag = max_lag + 2  # lags 0..max_lag − 1 | ≥ max_lag (overflow) | < 0 (negative)
    specs = {
        "n_tokens": count(),  # compared tokens: loss_mask ∧ versions ≥ 0
        "n_valid": count(),  # N0: loss-mask tokens (the loss denominator)
        "n_clip_tokens": count(),  # compared tokens whose clip decision was evaluated (advantages present)
        "n_rs_tokens": count(),  # compared tokens whose rejection outcome was evaluated
        "n_loss": count(),  # N0 of the batches whose loss was evaluated
        "loss_truth": total(),
        "lag_max": maximum(),
        "lag/n": count((n_lag,)),
        "lag/n_clip": count((n_lag,)),
    }
    for m in names:
        specs.update({f"{m}/{key}": total() for key in PROX_ERROR_KEYS})
        specs.update(
            {
                f"{m}/abs_error_max": maximum(),
                f"{m}/abs_error_hist": count((N_BINS,)),
                f"{m}/clip_flips": count(),
                f"{m}/behave_flips": count(),
                f"{m}/loss": total(),
                f"{m}/lag/abs_error": total((n_lag,)),
                f"{m}/lag/squared_error": total((n_lag,)),
                f"{m}/lag/clip_flips": count((n_lag,)),
            }
        )
    return MetricState(specs, device)


def _methods(methods: Iterable[str] | None) -> tuple[str, ...]:
    names = PROX_APPROX_METHODS if methods is None else ((methods,) if isinstance(methods, str) else tuple(methods))
    bad = [m for m in names if m not in PROX_APPROX_METHODS]
    if bad or not names:
        raise ValueError(f"unknown proximal approximation method(s) {bad or names!r}; valid: {PROX_APPROX_METHODS}")
    return tuple(dict.fromkeys(names))


def _state_methods(state: MetricState) -> tuple[str, ...]:
    return tuple(m for m in PROX_APPROX_METHODS if f"{m}/abs_error" in state)


def rejection_changes(
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor | None,
    config: RejectionSamplingConfig,
) -> Tensor:
    """Tokens whose behaviour weight rejection sampling changes: AReaL's ``filtered_fraction`` numerator per token.

    ``action="mask"``: valid tokens that :func:`~grpo_cli.core.rejection.apply_rejection_sampling` drops.
    ``action="clamp"``: valid tokens whose weight the clamp changes, found by comparing with the same call under a
    bound that never binds (so the untruncated weight is AReaL's own, token or sequence level).

    Returns:
        A bool tensor shaped like ``loss_mask``.

    Example:
        >>> cfg = RejectionSamplingConfig(upper=2.0)  # token level, mask, ratio
        >>> rejection_changes(torch.tensor([0.0, 1.0]), torch.zeros(2), torch.tensor([True, True]), None, cfg)
        tensor([False,  True])
    """
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    kept, weight, _ = apply_rejection_sampling(proximal_logprobs, old_logprobs, mask, cu_seqlens, config)
    if config.action == "mask":
        return mask & ~kept
    with warnings.catch_warnings():  # re-validation repeats the token-level agg warning the user already saw
        warnings.simplefilter("ignore", UserWarning)
        free = replace(config, upper=_FREE_UPPER, lower=None)
    _, untruncated, _ = apply_rejection_sampling(proximal_logprobs, old_logprobs, mask, cu_seqlens, free)
    return mask & (weight != untruncated)


def _flatten_inputs(
    tensors: dict[str, Tensor | None], current_version: int | Tensor, cu_seqlens: Tensor | None
) -> tuple[dict[str, Tensor | None], int | Tensor, Tensor]:
    """Padded ``[B, T]`` → packed ``[B·T]`` with row offsets; packed input needs ``cu_seqlens``."""
    new = tensors["new_logp"]
    assert new is not None
    if new.ndim == 2:
        b, t = new.shape
        cu = torch.arange(b + 1, dtype=torch.int64, device=new.device) * t
        flat = {k: (None if v is None else v.reshape(-1)) for k, v in tensors.items()}
        if isinstance(current_version, Tensor) and current_version.ndim == 2:
            current_version = current_version.reshape(-1)
        return flat, current_version, cu
    if new.ndim != 1:
        raise ValueError(f"expected packed [N] or padded [B, T] tensors, got shape {tuple(new.shape)}")
    if cu_seqlens is None:
        raise ValueError("packed 1-D input needs cu_seqlens (pass torch.tensor([0, N]) for a single sequence)")
    return tensors, current_version, cu_seqlens.to(device=new.device, dtype=torch.int64)


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    if values.numel() == 0:
        return torch.full((), -math.inf, dtype=torch.float64, device=values.device)
    return fill_outside(mask, values.to(torch.float64), -math.inf).amax()


def _bin_counts(bins: Tensor, mask: Tensor, n_bins: int) -> Tensor:
    """Tokens per bin over ``mask`` (an unweighted integer ``bincount``: deterministic on every device).

    Tokens outside ``mask`` are counted in a spare bin ``n_bins`` that is then dropped, which avoids compacting
    ``bins`` (a boolean index costs a full search of the mask)."""
    return torch.bincount(bins.masked_fill(~mask, n_bins), minlength=n_bins + 1)[:n_bins]


def _bin_sums(bins: Tensor, values: Tensor, present: list[int], n_bins: int) -> Tensor:
    """Float64 Σ ``values`` per bin (``values`` already 0 outside the compared tokens, ``present``: the bins with
    compared tokens), with :func:`grpo_cli.core.staleness.lag_bin_sums` (segmented sums over runs of equal lag, no
    atomics); a 0 outside the mask adds nothing to its run."""
    return lag_bin_sums(bins, present, [values], n_bins)[0]


def _without_zeros(counts: Tensor, n_zeros: Tensor | int) -> Tensor:
    counts = counts.clone()
    counts[ZERO] -= n_zeros
    return counts


@dataclass(frozen=True)
class ProxCompareBatch:
    """What every method's comparison shares on one batch (:func:`prox_compare_prepare`): the flattened inputs,
    lags and their bins, the compared tokens, every method's approximation, and the truth's loss terms and
    rejection outcome.

    Computing it once lets :func:`prox_compare_fold` be called per method (``compare-prox`` runs one metric
    group per method, in threads) without repeating it; the fields are read-only.
    """

    new: Tensor
    old: Tensor
    truth: Tensor
    approximations: dict[str, Tensor]
    valid: Tensor
    compared: Tensor
    cu_seqlens: Tensor
    n_compared: Tensor
    lag_max: Tensor
    lag_bin: Tensor
    lag_counts: Tensor
    present: list[int]
    n_outside: Tensor
    rejection_sampling: RejectionSamplingConfig | None
    changed_truth: Tensor | None
    advantages: Tensor | None
    eps_clip: float
    loss_kwargs: dict[str, Any]
    loss_truth: tuple[Tensor, Tensor, dict[str, Any]] | None


def prox_compare_prepare(
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    prox_logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    cu_seqlens: Tensor | None = None,
    loss_mask: Tensor | None = None,
    advantages: Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    max_lag: int = DEFAULT_MAX_LAG,
    methods: Iterable[str] | None = None,
) -> ProxCompareBatch:
    """The part of :func:`prox_compare_update` that every method shares (same arguments, plus the state's
    ``max_lag`` and the ``methods`` whose approximations to compute: default all)."""
    tensors, current_version, cu = _flatten_inputs(
        {"new_logp": new_logp, "old_logp": old_logp, "prox_logp": prox_logp, "versions": versions,
         "loss_mask": loss_mask, "advantages": advantages},
        current_version,
        cu_seqlens,
    )
    new, old, truth, ver = (tensors[k] for k in ("new_logp", "old_logp", "prox_logp", "versions"))
    assert new is not None and old is not None and truth is not None and ver is not None
    raw_mask, adv = tensors["loss_mask"], tensors["advantages"]
    if raw_mask is None:
        valid = torch.ones(new.shape, dtype=torch.bool, device=new.device)
    else:
        valid = raw_mask if raw_mask.dtype == torch.bool else raw_mask != 0

    # v_θ per token, once: a length-B tensor is per sequence, anything else goes to broadcast_current_version as is.
    per_sequence = isinstance(current_version, Tensor) and current_version.ndim == 1 and (
        current_version.numel() == cu.numel() - 1
    )
    v_theta = broadcast_current_version(current_version, ver, cu_seqlens=cu if per_sequence else None)
    # Lag k = v_θ − v_b (AReaL's sample_staleness_theta); bins as grpo_cli.core.staleness: k for 0 ≤ k < max_lag,
    # max_lag for k ≥ max_lag, max_lag + 1 for k < 0.
    lag = v_theta - ver
    if lag.is_floating_point():  # fractional versions: the bin of ⌊k⌋
        lag = torch.floor(torch.nan_to_num(lag, nan=-1.0))
    lag = lag.to(torch.int64)
    lag_bin = lag_bins(lag, max_lag)
    compared = valid & (ver >= 0)
    n_compared = compared.sum()
    lag_counts = _bin_counts(lag_bin, compared, max_lag + 2)
    changed_truth = None
    if rejection_sampling is not None:
        changed_truth = rejection_changes(truth, old, valid, cu, rejection_sampling)
    loss_kwargs: dict[str, Any] = {
        "eps_clip_higher": eps_clip_higher,
        "c_clip": c_clip,
        "rejection_sampling": rejection_sampling,
        "importance_sampling_level": importance_sampling_level,
        "cu_seqlens": cu,
    }
    loss_truth = None
    if adv is not None:
        loss_truth = ppo_actor_loss_terms(new, truth, old, adv, eps_clip, valid, **loss_kwargs)
    return ProxCompareBatch(
        new=new, old=old, truth=truth, valid=valid, compared=compared,
        approximations=compute_prox_logp_approximations(old, new, ver, v_theta, _methods(methods)),
        cu_seqlens=cu, n_compared=n_compared, lag_max=_masked_max(lag, compared), lag_bin=lag_bin,
        lag_counts=lag_counts, present=torch.nonzero(lag_counts).flatten().tolist(),
        n_outside=new.numel() - n_compared,  # tokens whose errors are 0 (prox_approximation_errors' contract)
        rejection_sampling=rejection_sampling, changed_truth=changed_truth, advantages=adv, eps_clip=eps_clip,
        loss_kwargs=loss_kwargs, loss_truth=loss_truth,
    )


def prox_compare_fold(state: MetricState, batch: ProxCompareBatch) -> None:
    """Fold a prepared batch into ``state``: the shared counts and the figures of the state's methods."""
    methods = _state_methods(state)
    n_lag = state["lag/n"].shape[0]
    if batch.lag_counts.shape[0] != n_lag:
        prepared = batch.lag_counts.shape[0] - 2
        raise ValueError(f"the batch was prepared with max_lag {prepared}, the state has {n_lag - 2}")
    compared, lag_bin, present, n_compared = batch.compared, batch.lag_bin, batch.present, batch.n_compared
    new, old, truth, valid, cu = batch.new, batch.old, batch.truth, batch.valid, batch.cu_seqlens
    state.update(n_tokens=n_compared, n_valid=valid.sum(), lag_max=batch.lag_max, **{"lag/n": batch.lag_counts})

    missing = [m for m in methods if m not in batch.approximations]
    if missing:
        raise ValueError(f"the batch was prepared without the approximations of {missing}")
    approximations = batch.approximations
    for m in methods:
        errors = prox_approximation_errors(approximations[m], truth, old, new, compared)  # 0 outside `compared`
        abs_error = errors["abs_error"]
        state.update(
            **{f"{m}/{key}": errors[key].sum(dtype=torch.float64) for key in PROX_ERROR_KEYS},
            **{
                f"{m}/abs_error_max": _masked_max(abs_error, compared),
                # the shared fixed-edge histogram (grpo_cli.core.histogram) of the compared tokens' |d|: every
                # other token holds an exact 0, so it is counted out of the zero bin instead of compacting |d|
                f"{m}/abs_error_hist": _without_zeros(histogram_counts(abs_error), batch.n_outside),
                f"{m}/lag/abs_error": _bin_sums(lag_bin, abs_error, present, n_lag),
                f"{m}/lag/squared_error": _bin_sums(lag_bin, errors["squared_error"], present, n_lag),
            },
        )

    if batch.rejection_sampling is not None:
        assert batch.changed_truth is not None
        state.update(n_rs_tokens=n_compared)
        for m in methods:
            changed = rejection_changes(approximations[m], old, valid, cu, batch.rejection_sampling)
            state.update(**{f"{m}/behave_flips": ((changed != batch.changed_truth) & compared).sum()})

    if batch.loss_truth is None:
        return
    adv = batch.advantages
    assert adv is not None
    num_truth, n0, stats_truth = batch.loss_truth
    state.update(
        n_loss=n0.to(torch.int64),
        loss_truth=num_truth,
        n_clip_tokens=n_compared,
        **{"lag/n_clip": batch.lag_counts},
    )
    for m in methods:
        num, _, stats = ppo_actor_loss_terms(
            new, approximations[m], old, adv, batch.eps_clip, valid, **batch.loss_kwargs
        )
        # The clip decision is the pair (clip, dual clip): a token moving between them also changes its gradient.
        flips = (stats["clip_mask"] != stats_truth["clip_mask"]) | (
            stats["dual_clip_mask"] != stats_truth["dual_clip_mask"]
        )
        flips = flips & compared
        state.update(
            **{
                f"{m}/loss": num,
                f"{m}/clip_flips": flips.sum(),
                f"{m}/lag/clip_flips": _bin_counts(lag_bin, flips, n_lag),
            }
        )


def prox_compare_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    prox_logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    cu_seqlens: Tensor | None = None,
    loss_mask: Tensor | None = None,
    advantages: Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`prox_compare_state`.
        new_logp: ℓθ, packed ``[N]`` (with ``cu_seqlens``) or padded ``[B, T]``.
        old_logp: ℓb (behaviour, inference engine).
        prox_logp: ℓp*, the recomputed proximal log-probs (the truth).
        versions: per-token behaviour versions v_b (< 0 for prompt tokens).
        current_version: v_θ: an ``int``, a per-sequence ``[B]`` tensor or a per-token tensor.
        cu_seqlens: ``[B + 1]`` sequence offsets of packed input (ignored for padded input).
        loss_mask: tokens in the loss (bool or 0/1); ``None`` means all. Other positions may hold garbage.
        advantages: per-token advantages; without them the loss and clip figures are not evaluated.
        eps_clip, eps_clip_higher, c_clip, importance_sampling_level: as :func:`~grpo_cli.core.ppo.
            ppo_actor_loss`.
        rejection_sampling: AReaL's rejection sampling; ``None`` (off) leaves the behaviour-weight flips and the
            loss's behaviour weight out, as AReaL does.
    """
    prepared = prox_compare_prepare(
        new_logp=new_logp, old_logp=old_logp, prox_logp=prox_logp, versions=versions,
        current_version=current_version, cu_seqlens=cu_seqlens, loss_mask=loss_mask, advantages=advantages,
        eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip, rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level, max_lag=state["lag/n"].shape[0] - 2,
        methods=_state_methods(state),
    )
    prox_compare_fold(state, prepared)


def max_safe_lag(rows: Sequence[Mapping[str, Any]], tolerance: float) -> int | None:
    """The largest lag k ≥ 1 such that every observed lag in [1, k] has ``abs_error_mean`` ≤ ``tolerance``.

    ``rows`` are ``by_staleness`` rows (lags ascending, then the overflow row, then the negative-lag row). Lags
    ≤ 0 (v_b ≥ v_θ: the token is no older than the current policy, where AReaL sets α = 0) are outside the
    interpolation's premise and ignored. The scan stops at the first lag whose error exceeds the tolerance (NaN
    counts as exceeding); an overflow row that passes extends the verdict to its ``lag_max``, the largest
    observed lag. ``None`` when the smallest observed lag ≥ 1 already fails, or no lag ≥ 1 was observed.

    Example:
        >>> rows = [{"lag": 0, "abs_error_mean": 0.5}, {"lag": 1, "abs_error_mean": 0.0},
        ...         {"lag": 2, "abs_error_mean": 0.02}, {"lag": 3, "abs_error_mean": 0.0}]
        >>> max_safe_lag(rows, 0.01)
        1
    """
    safe: int | None = None
    for row in rows:
        if row.get("underflow") or row["lag"] < 1:
            continue
        if not row["abs_error_mean"] <= tolerance:
            break
        safe = int(row["lag_max"]) if row.get("overflow") else int(row["lag"])
    return safe


def _lag_row(b: int, max_lag: int, observed_max: float) -> dict[str, Any]:
    """The lag label of bin ``b``, as :mod:`grpo_cli.core.staleness` labels its ``by_staleness`` rows."""
    if b == max_lag:
        return {"lag": max_lag, "overflow": True, "lag_max": int(observed_max)}
    if b == max_lag + 1:
        return {"lag": -1, "underflow": True}
    return {"lag": b}


def prox_compare_compute(state: MetricState, *, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Figures from a (merged) state; keys that the data cannot support are absent, never 0.

    Returns ``n_valid_tokens`` (loss-mask tokens), ``prox/n_tokens`` (compared tokens), ``prox/loss_ppo`` (the
    loss with the truth) and, per method m, ``prox/m/<figure>`` for each of :data:`PROX_COMPARE_FIGURES`:

    - ``abs_error_mean``, ``rel_error_mean`` and the four weight errors: Σ per-token error / n (float64);
    - ``abs_error_max``: exact; ``abs_error_p99``: the lower (nearest-rank) 0.99-quantile from the
      histogram, within :data:`P99_REL_ERROR_BOUND`;
    - ``rmse`` = √(Σ d² / n);
    - ``clip_flip_frac`` = clip flips / n, ``behave_weight_flip_frac`` = rejection-outcome flips / n;
    - ``loss_ppo`` = Σ L(ℓp̂) / N0; ``loss_abs_error`` = |loss(ℓp̂) − loss(ℓp*)|; ``loss_rel_error`` = that
      over (|loss(ℓp*)| + 1e−8), AReaL's relative-error convention;
    - ``by_staleness``: rows {lag, n_tokens, abs_error_mean, rmse, clip_flip_frac} for each lag bin with
      tokens, labelled as ``analyze``'s ``by_staleness`` (the overflow row adds ``overflow: true`` and the
      largest observed lag as ``lag_max``; negative lags are ``{"lag": -1, "underflow": true}``);
    - ``max_safe_lag``: :func:`max_safe_lag` of those rows.
    """
    if not (isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and tolerance >= 0):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    # Any: tolist() of a 0-d entry is a number, of the lag tables a list
    host: dict[str, Any] = {name: state[name].tolist() for name in state if not name.endswith("abs_error_hist")}
    n = int(host["n_tokens"])
    out: dict[str, Any] = {"n_valid_tokens": int(host["n_valid"]), "prox/n_tokens": n}
    n_loss = int(host["n_loss"])
    loss_truth = host["loss_truth"] / max(n_loss, 1)
    if n_loss > 0:
        out["prox/loss_ppo"] = loss_truth
    n_lag = len(host["lag/n"])
    max_lag = n_lag - 2
    order = [*range(max_lag + 1), max_lag + 1]  # lags ascending, overflow, negative (as analyze)
    n_clip, n_rs = int(host["n_clip_tokens"]), int(host["n_rs_tokens"])
    for m in _state_methods(state):
        p = f"prox/{m}/"
        if n > 0:
            for key in _MEAN_KEYS:
                out[f"{p}{key}_mean"] = host[f"{m}/{key}"] / n
            vmax = host[f"{m}/abs_error_max"]
            out[f"{p}abs_error_max"] = vmax
            (out[f"{p}abs_error_p99"],) = histogram_quantiles(state[f"{m}/abs_error_hist"], [0.99], vmin=0.0,
                                                              vmax=vmax)
            out[f"{p}rmse"] = math.sqrt(host[f"{m}/squared_error"] / n)
        if n_clip > 0:
            out[f"{p}clip_flip_frac"] = host[f"{m}/clip_flips"] / n_clip
        if n_rs > 0:
            out[f"{p}behave_weight_flip_frac"] = host[f"{m}/behave_flips"] / n_rs
        if n_loss > 0:
            loss = host[f"{m}/loss"] / n_loss
            out[f"{p}loss_ppo"] = loss
            out[f"{p}loss_abs_error"] = abs(loss - loss_truth)
            out[f"{p}loss_rel_error"] = abs(loss - loss_truth) / (abs(loss_truth) + REL_ERROR_EPS)
        if n == 0:
            continue
        rows = []
        for b in order:
            k = int(host["lag/n"][b])
            if k == 0:
                continue
            row: dict[str, Any] = {
                **_lag_row(b, max_lag, host["lag_max"]),
                "n_tokens": k,
                "abs_error_mean": host[f"{m}/lag/abs_error"][b] / k,
                "rmse": math.sqrt(host[f"{m}/lag/squared_error"][b] / k),
            }
            k_clip = int(host["lag/n_clip"][b])
            if k_clip > 0:
                row["clip_flip_frac"] = host[f"{m}/lag/clip_flips"][b] / k_clip
            rows.append(row)
        out[f"{p}by_staleness"] = rows
        out[f"{p}max_safe_lag"] = max_safe_lag(rows, tolerance)
    return out
