"""``compare-prox``'s figures: AReaL's proximal approximations against the recomputed ``prox_logp`` (the math is
:mod:`grpo_cli.core.prox_compare`), as metric groups of the streaming run, and the options that change them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, cast

import torch

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
from grpo_cli.engine.config import DEFAULT_BATCH_TOKENS, PPOOptions, StreamConfig, check_finite, validate_stream
from grpo_cli.engine.figures import Figure, PeerName, Requirement, option, square
from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.validate import ValidationGroup
from grpo_cli.errors import InputError, UsageError
from grpo_cli.metrics.policy import CountsGroup

__all__ = [
    "MAX_MAX_LAG",
    "PROX_FIGURE_MEANINGS",
    "CompareProxConfig",
    "ProxCompareGroup",
    "compare_prox_groups",
    "expected_keys",
]

PROX_FIGURE_MEANINGS: dict[str, str] = {
    "abs_error_mean": "mean |ℓp* − ℓp̂| over valid generated tokens (nats)",
    "abs_error_max": "largest |ℓp* − ℓp̂|",
    "abs_error_p99": "99th percentile of |ℓp* − ℓp̂| (log-spaced histogram, ±0.58 % relative)",
    "rel_error_mean": "mean |ℓp* − ℓp̂| / (|ℓp*| + 1e−8), a fraction (AReaL compute_logp/<m>/rel_error)",
    "rmse": "√ mean (ℓp* − ℓp̂)²",
    "behave_imp_weight_abs_error_mean": "mean |w* − ŵ|, w = exp(ℓp − ℓb) = π_prox/π_behave",
    "behave_imp_weight_rel_error_mean": "mean |w* − ŵ| / (|w*| + 1e−8)",
    "importance_weight_abs_error_mean": "mean |r* − r̂|, r = exp(ℓθ − ℓp), the PPO ratio",
    "importance_weight_rel_error_mean": "mean |r* − r̂| / (|r*| + 1e−8)",
    "clip_flip_frac": "tokens whose PPO clip decision (clip or dual clip) differs from the truth's",
    "behave_weight_flip_frac": "tokens whose rejection-sampling outcome (dropped/truncated) differs",
    "loss_ppo": "AReaL's loss/ppo computed with ℓp̂ instead of ℓp*",
    "loss_abs_error": "|loss/ppo(ℓp̂) − loss/ppo(ℓp*)|",
    "loss_rel_error": "|loss/ppo(ℓp̂) − loss/ppo(ℓp*)| / (|loss/ppo(ℓp*)| + 1e−8)",
    "by_staleness": "per lag k = v_θ − v_b: n_tokens, abs_error_mean, rmse, clip_flip_frac",
    "max_safe_lag": "largest lag k ≥ 1 with abs_error_mean ≤ --tolerance at every lag in [1, k]",
}
"""What each per-method figure ``prox/<method>/<figure>`` means (also the compare-prox table's explanations)."""

_LOSS_NEEDS = (Requirement("needs an 'advantages' column (the PPO loss and its clip decisions use A)",
                           lambda cols, _: "advantages" in cols),)
_RS_NEEDS = (option(lambda c: c.rejection_sampling() is not None,
                    "rejection sampling is off (set --rs-upper, --rs-metric, ... to enable it)"),)
# AReaL's names for the compare-prox figures (prox_logp_method=metrics): compute_logp/<method>/<stat>.
_AREAL = {"abs_error_mean": "abs_error/avg", "abs_error_max": "abs_error/max", "rel_error_mean": "rel_error/avg",
          "behave_imp_weight_abs_error_mean": "behave_imp_weight_abs_error/avg",
          "behave_imp_weight_rel_error_mean": "behave_imp_weight_rel_error/avg",
          "importance_weight_abs_error_mean": "importance_weight_abs_error/avg",
          "importance_weight_rel_error_mean": "importance_weight_rel_error/avg"}


def method_figures(method: str) -> tuple[Figure, ...]:
    """The declared ``prox/<method>/*`` figures."""
    out = []
    for name in PROX_COMPARE_FIGURES:
        needs = _LOSS_NEEDS if name in LOSS_FIGURES else _RS_NEEDS if name in REJECTION_FIGURES else ()
        peers: dict[str, PeerName | str] = {}
        if name in _AREAL:
            peers["areal"] = f"ppo_actor/update/compute_logp/{method}/{_AREAL[name]}"
        elif name == "rmse":
            peers["areal"] = square(f"ppo_actor/update/compute_logp/{method}/squared_error/avg")
        reduce = "table" if name == "by_staleness" else "lag" if name == "max_safe_lag" else None
        out.append(Figure(f"prox/{method}/{name}", f"{method}: {PROX_FIGURE_MEANINGS[name]}", section="prox",
                          needs=needs, reduce=reduce, peers=peers))
    return tuple(out)


SHARED_FIGURES = (
    Figure("prox/n_tokens", "valid generated tokens compared (loss_mask = 1, versions ≥ 0)"),
    Figure("prox/loss_ppo", "AReaL's loss/ppo with the recomputed prox_logp (the truth)", reduce="ratio of sums",
           needs=_LOSS_NEEDS),
)
"""The figures every method shares (reported once, by the first group of a pass)."""

MAX_MAX_LAG = 4096
"""Upper limit of ``--max-lag`` (the state holds max_lag + 2 bins per method)."""

@dataclass
class CompareProxConfig(PPOOptions):
    """Every option that changes a ``compare-prox`` figure (reported in the JSON ``config``).

    Besides :class:`~grpo_cli.engine.config.PPOOptions` (AReaL's ``eps_clip``, ``eps_clip_higher``, ``c_clip``,
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
    # The rest of grpo_cli.engine.config.StreamConfig, which the streaming pass reads: compare-prox has no --group-by.
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
        max_lag = self.max_lag
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or not 1 <= max_lag <= MAX_MAX_LAG:
            raise UsageError(f"--max-lag must be an integer in [1, {MAX_MAX_LAG}], got {max_lag!r}")
        validate_stream(cast(StreamConfig, self))  # group_by/max_groups are read-only ClassVars here

    def to_json(self) -> dict[str, Any]:
        out = self.ppo_json(asdict(self))
        out.pop("device")  # where and how it ran does not change a figure
        out.pop("batch_tokens")
        out["methods"] = list(self.methods)
        out["p99_rel_error"] = P99_REL_ERROR_BOUND
        return out


class ProxCompareGroup(MetricGroup):
    """The ``prox/*`` figures (:mod:`grpo_cli.core.prox_compare`) as a metric group of the streaming pass.

    ``methods`` restricts the group to some of ``--method``'s approximations (default: all of them).
    :func:`compare_prox_groups` makes one group per method, so the metric threads compare the methods in
    parallel; the method-independent work on a batch (:func:`~grpo_cli.core.prox_compare.prox_compare_prepare`)
    is done once and shared (:meth:`~grpo_cli.core.batch.TokenBatch.memoised`). The figures all methods share
    (``prox/n_tokens``, ``prox/loss_ppo``) are reported by the ``shared`` group alone.
    """

    def __init__(self, methods: Sequence[str] | None = None, *, shared: bool = True) -> None:
        self.methods = None if methods is None else tuple(methods)
        self.shared = shared
        self.name = "prox" if self.methods is None else f"prox/{'+'.join(self.methods)}"
        every = PROX_APPROX_METHODS if self.methods is None else self.methods
        per_method = tuple(
            replace(figure, enabled=self._enabled(method)) for method in every for figure in method_figures(method)
        )
        self.figures = (SHARED_FIGURES if shared else ()) + per_method

    def _enabled(self, method: str) -> Callable[[CompareProxConfig], bool]:
        return lambda config: method in self._methods(config)

    def _methods(self, config: CompareProxConfig) -> tuple[str, ...]:
        return tuple(config.methods) if self.methods is None else tuple(self.methods)

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "versions", "advantages", "current_version"})

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
                old_logp=cast(torch.Tensor, valid.old_logp),  # checked above (the closure drops the narrowing)
                prox_logp=cast(torch.Tensor, valid.prox_logp),
                versions=cast(torch.Tensor, valid.versions),
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
        out = prox_compare_compute(state, tolerance=config.tolerance)
        if not self.shared:
            for figure in SHARED_FIGURES:
                out.pop(figure.key, None)
        return out


def expected_keys(config: CompareProxConfig) -> list[str]:
    """Every key a run with ``config`` can report (in report order)."""
    return ["prox/loss_ppo"] + [f"prox/{m}/{f}" for m in config.methods for f in PROX_COMPARE_FIGURES]


def compare_prox_groups(methods: Sequence[str] | None = None) -> list[Any]:
    """The metric groups of a ``compare-prox`` pass, in report order (validation and counts as ``analyze``): one
    :class:`ProxCompareGroup` per method of ``methods``, or one for every method of the config (default)."""
    if methods is None:
        prox = [ProxCompareGroup()]
    else:
        prox = [ProxCompareGroup((m,), shared=i == 0) for i, m in enumerate(methods)]
    return [ValidationGroup(), CountsGroup(), *prox]
