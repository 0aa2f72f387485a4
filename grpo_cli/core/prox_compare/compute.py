"""Figures from a merged ``compare-prox`` state (:func:`prox_compare_compute`) and the lag verdict
(:func:`max_safe_lag`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_cli.core.histogram import QUANTILE_REL_ERROR, histogram_quantiles
from grpo_cli.core.prox import PROX_ERROR_KEYS, REL_ERROR_EPS
from grpo_cli.core.prox_compare._common import state_methods
from grpo_cli.core.state import MetricState

__all__ = [
    "DEFAULT_TOLERANCE",
    "LOSS_FIGURES",
    "P99_REL_ERROR_BOUND",
    "PROX_COMPARE_FIGURES",
    "REJECTION_FIGURES",
    "max_safe_lag",
    "prox_compare_compute",
]

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
    for m in state_methods(state):
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
