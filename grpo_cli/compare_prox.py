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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from grpo_cli.analysis import AnalysisResult, CountsGroup, finalize
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.prox import PROX_APPROX_METHODS
from grpo_cli.core.prox_compare import (
    DEFAULT_MAX_LAG,
    DEFAULT_TOLERANCE,
    LOSS_FIGURES,
    P99_REL_ERROR_BOUND,
    PROX_COMPARE_FIGURES,
    REJECTION_FIGURES,
    ProxCompareBatch,
    prox_compare_compute,
    prox_compare_fold,
    prox_compare_prepare,
    prox_compare_state,
)
from grpo_cli.core.state import MetricState
from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset
from grpo_cli.io.validate import OnInvalid, ValidationGroup
from grpo_cli.options import PPOOptions, check_finite
from grpo_cli.parallel import accumulate

__all__ = [
    "MAX_MAX_LAG",
    "CompareProxConfig",
    "CompareProxResult",
    "ProxCompareGroup",
    "check_columns",
    "compare_prox",
    "compare_prox_groups",
    "expected_keys",
    "lag_label",
    "recommendation",
]

MAX_MAX_LAG = 4096
"""Upper limit of ``--max-lag`` (the state holds max_lag + 2 bins per method)."""

# Why each column is needed: the text of the exit-2 error when a dump lacks it.
_REQUIRED: dict[str, str] = {
    "prox_logp": "the recomputed proximal log-probs are the truth every approximation is measured against "
    "(dump them with AReaL's prox_logp_method=metrics or recompute)",
    "old_logp": "every approximation starts from the behaviour log-probs ℓb",
    "versions": "the interpolation weight α and the staleness lag need each token's behaviour version",
}


@dataclass
class CompareProxConfig(PPOOptions):
    """Every option that changes a ``compare-prox`` figure (reported in the JSON ``config``).

    Besides :class:`~grpo_cli.options.PPOOptions` (AReaL's ``eps_clip``, ``eps_clip_higher``, ``c_clip``,
    ``importance_sampling_level`` and ``RejectionSamplingConfig``, used for ``loss_*``, ``clip_flip_frac`` and
    ``behave_weight_flip_frac``):

    Attributes:
        methods: approximations to compare (AReaL's ``loglinear``, ``linear``, ``rollout``).
        tolerance: the bound on a lag's ``abs_error_mean`` for ``max_safe_lag``.
        current_version: v_θ for dumps without a ``current_version`` column (the column wins when present).
        max_lag: lags 0..max_lag − 1 get a ``by_staleness`` row each; larger lags share one.
        on_invalid: ``--on-invalid`` (``error`` or ``skip``), as ``analyze``.
        batch_tokens, device: how the pass runs (they change no figure).
    """

    methods: tuple[str, ...] = PROX_APPROX_METHODS
    tolerance: float = DEFAULT_TOLERANCE
    current_version: int | None = None
    max_lag: int = DEFAULT_MAX_LAG
    on_invalid: str = "error"
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"
    # The rest of grpo_cli.analysis.StreamOptions, which the streaming pass reads: compare-prox has no --group-by.
    group_by: ClassVar[str | None] = None
    max_groups: ClassVar[int] = 0

    def validate(self) -> None:
        """Raise :class:`~grpo_cli.errors.UsageError` (exit 2) naming the bad option."""
        self.validate_ppo()
        methods = tuple(self.methods)
        bad = [m for m in methods if m not in PROX_APPROX_METHODS]
        if bad or not methods:
            raise UsageError(f"--method: unknown {bad or methods}; valid: {', '.join(PROX_APPROX_METHODS)}, all")
        check_finite(self.tolerance, "--tolerance", minimum=0)
        if self.current_version is not None and (
            isinstance(self.current_version, bool) or not isinstance(self.current_version, int)
        ):
            raise UsageError(f"--current-version must be an integer, got {self.current_version!r}")
        max_lag = self.max_lag
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or not 1 <= max_lag <= MAX_MAX_LAG:
            raise UsageError(f"--max-lag must be an integer in [1, {MAX_MAX_LAG}], got {max_lag!r}")
        if self.on_invalid not in tuple(OnInvalid):
            raise UsageError(f"--on-invalid must be 'error' or 'skip', got '{self.on_invalid}'")
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be >= 1, got {self.batch_tokens}")

    def to_json(self) -> dict[str, Any]:
        out = self.ppo_json(asdict(self))
        out.pop("device")  # where and how it ran does not change a figure
        out.pop("batch_tokens")
        out["methods"] = list(self.methods)
        out["p99_rel_error"] = P99_REL_ERROR_BOUND
        return out


class ProxCompareGroup:
    """The ``prox/*`` figures (:mod:`grpo_cli.core.prox_compare`) as a metric group of the streaming pass.

    ``methods`` restricts the group to some of ``--method``'s approximations (default: all of them).
    :func:`compare_prox_groups` makes one group per method, so the metric threads compare the methods in
    parallel; the method-independent work on a batch (:func:`~grpo_cli.core.prox_compare.prox_compare_prepare`)
    is done once and shared (:meth:`~grpo_cli.core.batch.TokenBatch.memoised`), and every group reports the same
    shared figures (``prox/n_tokens``, ``prox/loss_ppo``).
    """

    def __init__(self, methods: Sequence[str] | None = None) -> None:
        self.methods = None if methods is None else tuple(methods)
        self.name = "prox" if self.methods is None else f"prox/{'+'.join(self.methods)}"

    def _methods(self, config: CompareProxConfig) -> tuple[str, ...]:
        return tuple(config.methods) if self.methods is None else tuple(self.methods)

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "versions", "advantages", "current_version"})

    def omitted(self, columns: frozenset[str], config: CompareProxConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "advantages" not in columns:
            out["prox/loss_ppo"] = "needs an 'advantages' column (the PPO loss and its clip decisions use A)"
            for m in self._methods(config):
                out.update(dict.fromkeys((f"prox/{m}/{f}" for f in LOSS_FIGURES), out["prox/loss_ppo"]))
        if config.rejection_sampling() is None:
            reason = "rejection sampling is off (set --rs-upper, --rs-metric, ... to enable it)"
            for m in self._methods(config):
                out.update(dict.fromkeys((f"prox/{m}/{f}" for f in REJECTION_FIGURES), reason))
        return out

    def init_state(self, config: CompareProxConfig, device: torch.device | str) -> MetricState:
        return prox_compare_state(self._methods(config), max_lag=config.max_lag, device=device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: CompareProxConfig) -> None:
        if valid.old_logp is None or valid.prox_logp is None or valid.versions is None:
            raise InputError("a batch lacks old_logp, prox_logp or versions (checked before reading)")
        current = valid.current_version if valid.current_version is not None else config.current_version
        if current is None:
            raise InputError("no current version: neither a 'current_version' column nor --current-version")

        def prepare() -> ProxCompareBatch:
            return prox_compare_prepare(
                new_logp=valid.new_logp,
                old_logp=valid.old_logp,
                prox_logp=valid.prox_logp,
                versions=valid.versions,
                current_version=current,
                cu_seqlens=valid.cu_seqlens,
                advantages=valid.advantages,
                eps_clip=config.epsilon,
                eps_clip_higher=config.epsilon_high,
                c_clip=config.c_clip,
                rejection_sampling=config.rejection_sampling(),
                importance_sampling_level=config.importance_level,
                max_lag=config.max_lag,
                methods=config.methods,
            )

        prox_compare_fold(state, valid.memoised("prox_compare", prepare))

    def compute(self, state: MetricState, config: CompareProxConfig) -> dict[str, Any]:
        return prox_compare_compute(state, tolerance=config.tolerance)


@dataclass
class CompareProxResult(AnalysisResult):
    """:class:`~grpo_cli.analysis.AnalysisResult` plus one max-safe-lag sentence per method."""

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


def expected_keys(config: CompareProxConfig) -> list[str]:
    """Every key a run with ``config`` can report (in report order)."""
    return ["prox/loss_ppo"] + [f"prox/{m}/{f}" for m in config.methods for f in PROX_COMPARE_FIGURES]


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


def compare_prox_groups(methods: Sequence[str] | None = None) -> list[Any]:
    """The metric groups of a ``compare-prox`` pass, in report order (validation and counts as ``analyze``): one
    :class:`ProxCompareGroup` per method of ``methods``, or one for every method of the config (default)."""
    prox = [ProxCompareGroup()] if methods is None else [ProxCompareGroup((m,)) for m in methods]
    return [ValidationGroup(), CountsGroup(), *prox]


def compare_prox(
    dataset: RolloutDataset,
    config: CompareProxConfig,
    *,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> CompareProxResult:
    """Stream ``dataset`` once and compare each configured approximation with the recomputed ``prox_logp``.

    The pass is ``analyze``'s (:func:`grpo_cli.parallel.accumulate` / :func:`~grpo_cli.analysis.finalize`:
    input validation, ``--on-invalid``, exact merging) with the groups of :func:`compare_prox_groups`.

    Raises:
        UsageError: a bad option (exit 2).
        InputError: a missing column, invalid or empty data (exit 2), naming the column and why it is needed.
    """
    config.validate()
    check_columns(dataset, config)
    groups = compare_prox_groups(config.methods)
    # --workers processes or torchrun ranks, merged exactly (grpo_cli.parallel).
    acc = accumulate(dataset, config, groups, workers=workers, progress=progress)  # type: ignore[arg-type]
    base = finalize(dataset, config, groups, acc)  # type: ignore[arg-type]
    metrics, omitted = base.metrics, base.omitted
    for key in expected_keys(config):
        if key not in metrics and key not in omitted:
            omitted[key] = "no valid generated tokens (loss_mask = 1 and versions >= 0)"
    result_config = dict(base.config)
    result_config["current_version_source"] = (
        "column" if "current_version" in dataset.columns else "--current-version"
    )
    return CompareProxResult(
        metrics=metrics,
        omitted=omitted,
        inputs=base.inputs,
        config=result_config,
        columns=base.columns,
        recommendations={m: recommendation(metrics, m, config.tolerance) for m in config.methods},
    )
