"""``grpo-cli compare-prox``: how good AReaL's proximal approximation is on a dump, and what its error does.

One streaming pass over a :class:`~grpo_cli.io.reader.RolloutDataset` feeds :class:`ProxCompareGroup` (the
core in :mod:`grpo_cli.core.prox_compare`) through ``analyze``'s own pass (validation, counts, exact merging),
so the figures do not depend on ``--batch-tokens``. ``docs/prox.md`` explains the usage and
``docs/metrics.md`` (section "compare-prox") every key.

Example:
    >>> from grpo_cli.io.reader import RolloutDataset
    >>> result = compare_prox(RolloutDataset(["sample_data/rollouts.parquet"]), CompareProxConfig())  # doctest: +SKIP
    >>> result.metrics["prox/loglinear/max_safe_lag"], result.recommendations["loglinear"]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.commands.analyze import ratio_base
from grpo_cli.engine.run import AnalysisResult, run
from grpo_cli.errors import InputError
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics.prox import CompareProxConfig, compare_prox_groups, expected_keys

__all__ = [
    "CompareProxConfig",
    "CompareProxResult",
    "check_columns",
    "compare_prox",
    "expected_keys",
    "lag_label",
    "recommendation",
]

# Why each column is needed: the text of the exit-2 error when a dump lacks it.
_REQUIRED: dict[str, str] = {
    "prox_logp": "the recomputed proximal log-probs are the truth every approximation is measured against "
    "(dump them with AReaL's prox_logp_method=metrics or recompute)",
    "old_logp": "every approximation starts from the behaviour log-probs ℓb",
    "versions": "the interpolation weight α and the staleness lag need each token's behaviour version",
}


@dataclass
class CompareProxResult(AnalysisResult):
    """:class:`~grpo_cli.engine.run.AnalysisResult` plus one max-safe-lag sentence per method."""

    recommendations: dict[str, str] = field(default_factory=dict)


def check_columns(dataset: RolloutDataset, config: CompareProxConfig) -> None:
    """Raise :class:`~grpo_cli.errors.InputError` (exit 2) naming each missing input and why it is needed."""
    missing = {name: why for name, why in _REQUIRED.items() if name not in dataset.columns}
    if "current_version" not in dataset.columns and config.current_version is None:
        missing["current_version"] = (
            "α and the lag need the trainer's version v_θ; add the column or pass --current-version N"
        )
    if not missing:
        return
    hint = " (an existing column under another name can be mapped with --map canonical=actual)"
    text = "; ".join(f"'{name}' is missing: {why}" for name, why in missing.items())
    column = next(iter(missing)) if len(missing) == 1 else None
    message = f"compare-prox cannot run: {text}{hint}"
    if column is not None:
        message = f"compare-prox cannot run without it: {missing[column]}{hint}"
    raise InputError(message, file=str(dataset.files[0]), column=column)


def lag_label(row: Mapping[str, Any]) -> str:
    """A ``by_staleness`` row's lag as text: ``3``, ``64..80`` (overflow, up to the largest seen), ``< 0``."""
    if row.get("underflow"):
        return "< 0"
    if row.get("overflow"):
        return f"{row['lag']}..{row['lag_max']}" if row["lag_max"] != row["lag"] else str(row["lag"])
    return str(row["lag"])


def recommendation(metrics: Mapping[str, Any], method: str, tolerance: float) -> str:
    """One sentence on how stale the data may be for ``method`` (from ``by_staleness`` and ``max_safe_lag``).

    The verdict covers lags ≥ 1 (see :func:`~grpo_cli.core.prox_compare.max_safe_lag`); lags ≤ 0 over the
    tolerance get a note, since no approximation can help there (α = 0: every method returns ℓb).

    Example:
        >>> rows = [{"lag": 1, "n_tokens": 5, "abs_error_mean": 0.0}, {"lag": 2, "n_tokens": 5, "abs_error_mean": 0.05}]
        >>> metrics = {"prox/loglinear/by_staleness": rows, "prox/loglinear/max_safe_lag": 1}
        >>> recommendation(metrics, "loglinear", 0.01)
        'loglinear: safe up to lag 1 (abs_error_mean ≤ 0.01); lag 2 has 0.05'
    """
    all_rows = metrics.get(f"prox/{method}/by_staleness") or []
    stale = [r for r in all_rows if not r.get("underflow") and r["lag"] >= 1]
    fresh = [r for r in all_rows if (r.get("underflow") or r["lag"] < 1) and not r["abs_error_mean"] <= tolerance]
    note = ""
    if fresh:
        worst = max(fresh, key=lambda r: r["abs_error_mean"])
        note = f"; lag {lag_label(worst)} has {worst['abs_error_mean']:.3g} but there α = 0 and every method is ℓb"
    if not stale:
        return f"{method}: no verdict (no valid generated token with lag ≥ 1){note}"
    safe = metrics.get(f"prox/{method}/max_safe_lag")
    failing = next((r for r in stale if not r["abs_error_mean"] <= tolerance), None)
    if failing is None:
        return (
            f"{method}: safe at every observed lag (up to {safe}; abs_error_mean ≤ {tolerance:g}); "
            f"larger lags were not observed{note}"
        )
    where, worst_err = lag_label(failing), f"{failing['abs_error_mean']:.3g}"
    if safe is None:
        return (
            f"{method}: not safe at any observed lag ≥ 1 "
            f"(lag {where} already has abs_error_mean {worst_err} > {tolerance:g}){note}"
        )
    return f"{method}: safe up to lag {safe} (abs_error_mean ≤ {tolerance:g}); lag {where} has {worst_err}{note}"


def compare_prox(
    dataset: RolloutDataset,
    config: CompareProxConfig,
    *,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> CompareProxResult:
    """Stream ``dataset`` once and compare each configured approximation with the recomputed ``prox_logp``.

    The pass is ``analyze``'s (:func:`grpo_cli.engine.run.run`:
    input validation, ``--on-invalid``, exact merging) with the groups of :func:`compare_prox_groups`.

    Raises:
        UsageError: a bad option (exit 2).
        InputError: a missing column, invalid or empty data (exit 2), naming the column and why it is needed.
    """
    config.validate()
    check_columns(dataset, config)
    base = run(dataset, compare_prox_groups(config.methods), config, progress=progress, workers=workers)
    metrics, omitted = base.metrics, base.omitted
    for key in expected_keys(config):
        if key not in metrics and key not in omitted:
            omitted[key] = "no valid generated tokens (loss_mask = 1 and versions >= 0)"
    result_config = dict(base.config)
    result_config["current_version_source"] = (
        "column" if "current_version" in dataset.columns else "--current-version"
    )
    # Which log-prob the PPO ratio r = π_θ / π_base of loss_* and clip_flip_frac is taken against, named as in
    # analyze's config: prox_logp is required here, so the truth's ratio is against the recomputed prox.
    result_config["ratio_base"] = ratio_base(dataset)
    return CompareProxResult(
        metrics=metrics,
        omitted=omitted,
        inputs=base.inputs,
        config=result_config,
        columns=base.columns,
        recommendations={m: recommendation(metrics, m, config.tolerance) for m in config.methods},
    )
