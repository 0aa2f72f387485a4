"""``grpo-cli diff BASE NEW``: every figure of two runs side by side, with the change and whether it is beyond noise.

Each run is streamed once through the same metric groups as ``analyze``, split into *blocks* on the way (one state
set per block, :class:`~grpo_cli.engine.group.Accumulator`): its steps when the dump has a ``step`` column (at
least :data:`MIN_STEP_BLOCKS` of them), else :attr:`DiffConfig.blocks` hash blocks of its prompt groups
(:func:`~grpo_cli.engine.blocks.block_keys`). Because states merge exactly, the figures without one block come from
merging the others, and the delete-a-block jackknife (Efron & Stein 1981; Efron 1982) gives every scalar figure a
variance from that same pass (:func:`~grpo_cli.engine.blocks.jackknife_variances`). The change ``new − base`` is
then bounded by ``change ± z·√(var_base + var_new)`` (the runs are independent), and it is *significant* when that
interval excludes 0. docs/diff.md states the method and its assumptions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from grpo_cli.core.state import MetricState
from grpo_cli.engine.blocks import DEFAULT_BLOCKS, jackknife_variances, merge_contiguous
from grpo_cli.engine.config import check_finite
from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.parallel import accumulate
from grpo_cli.engine.run import AnalysisResult, finalize
from grpo_cli.errors import UsageError
from grpo_cli.findings import DetectConfig, diagnose
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups
from grpo_cli.metrics.diagnosis import diagnosis_groups

__all__ = [
    "DEFAULT_Z",
    "MAX_STEP_BLOCKS",
    "MIN_STEP_BLOCKS",
    "NON_SMOOTH",
    "Change",
    "DiffConfig",
    "DiffResult",
    "FigureChange",
    "RunFigures",
    "change_interval",
    "diff",
    "diff_results",
    "findings_only_in",
    "measure",
    "relative_change",
    "t_critical",
]

DEFAULT_Z = 3.0
"""Half-width of the change's interval in standard errors: 3 keeps a run compared with its own re-run (another seed)
quiet across the ~100 figures diffed at once, where 1.96 would flag a few by chance."""

MIN_STEP_BLOCKS = 5
"""Fewer distinct steps than this: the jackknife uses hash blocks instead (too few degrees of freedom)."""

NON_SMOOTH = ("quantile", "max", "min")
"""Figure reductions (:attr:`~grpo_cli.engine.figures.Figure.reduce`) the jackknife gives no interval for: its
variance of extremes and quantiles is inconsistent (Efron 1982 §3.4), so their changes are shown, never flagged."""

MAX_STEP_BLOCKS = 100
"""More steps than this are merged into this many contiguous runs of steps for the jackknife (its cost is one
``compute`` of every group per block); the per-step series keep every step."""


@dataclass
class DiffConfig(AnalyzeConfig):
    """``analyze``'s options (they apply to both runs) plus the interval's.

    Attributes:
        z: half-width of the change's interval in jackknife standard errors.
        blocks: hash blocks per run when it has no (or too few) steps.
        hash_blocks: set by :func:`measure` on the config it streams with (the engine's runner splits by hash
            block when it is > 0); never set it yourself.
    """

    z: float = DEFAULT_Z
    blocks: int = DEFAULT_BLOCKS
    hash_blocks: int = 0

    def validate(self) -> None:
        super().validate()
        check_finite(self.z, "--z", above=0)
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 2:
            raise UsageError(f"--blocks must be an integer >= 2, got {self.blocks}")

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.pop("hash_blocks", None)
        out.pop("group_by", None)
        return out


@dataclass
class RunFigures:
    """One run's figures, their jackknife variances and (split by step) its per-step figures."""

    label: str
    result: AnalysisResult
    variances: dict[str, float]
    blocking: str
    """``"step"`` or ``"hash"``: what the jackknife's blocks are."""
    n_blocks: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    """``[{"key": step, "metrics": {...}}, ...]`` when split by step (else empty)."""
    no_interval: dict[str, str] = field(default_factory=dict)
    """Scalar figures without a variance, each with why (:data:`NON_SMOOTH` reductions)."""

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "inputs": self.result.inputs, "blocking": self.blocking,
                "n_blocks": self.n_blocks}


@dataclass
class FigureChange:
    """One figure in both runs: ``change = new − base`` with its interval ``[low, high]``."""

    key: str
    base: float
    new: float
    change: float
    low: float | None
    high: float | None
    significant: bool
    z_score: float | None
    """``|change| / se`` (``None`` without an interval: no variance, or none spread across blocks)."""
    rel_change: float | None = None
    note: str | None = None
    """Why there is no interval, when there is none."""
    critical: float | None = None
    """The multiplier of the standard error the interval used (``z`` widened for few blocks)."""

    @property
    def beyond(self) -> float:
        """``|change|`` in interval half-widths (``> 1``: significant; 0 without an interval)."""
        if self.z_score is None or not self.critical:
            return 0.0
        return self.z_score / self.critical

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "base": self.base, "new": self.new, "change": self.change, "low": self.low,
                "high": self.high, "significant": self.significant, "z_score": self.z_score,
                "critical": self.critical, "rel_change": self.rel_change, "note": self.note}


@dataclass
class DiffResult:
    """Both runs and every figure's change, ranked (significant first, then by how far beyond noise)."""

    base: RunFigures
    new: RunFigures
    figures: list[FigureChange]
    only_in: dict[str, list[str]]
    """Scalar figures one run reports and the other does not: ``{"base": [...], "new": [...]}``."""
    findings: list[dict[str, Any]]
    """Findings present in one run and not the other (:func:`findings_only_in`), when the results carry any."""
    config: dict[str, Any]
    z: float

    @property
    def significant(self) -> list[FigureChange]:
        return [f for f in self.figures if f.significant]

    def series(self) -> list[dict[str, Any]]:
        """Per-step values of every compared figure in both runs (empty unless both were split by step)."""
        if not (self.base.steps and self.new.steps):
            return []
        steps = sorted({g["key"] for g in self.base.steps} | {g["key"] for g in self.new.steps})
        base = {g["key"]: g["metrics"] for g in self.base.steps}
        new = {g["key"]: g["metrics"] for g in self.new.steps}

        def column(run: Mapping[Any, Mapping[str, Any]], key: str) -> list[float | None]:
            return [_scalar(run.get(step, {}).get(key)) for step in steps]

        return [{"key": f.key, "steps": steps, "base": column(base, f.key), "new": column(new, f.key)}
                for f in self.figures]


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class Change(NamedTuple):
    """``new − base`` with its interval (:func:`change_interval`)."""

    change: float
    low: float | None
    high: float | None
    significant: bool
    z_score: float | None
    """``|change| / se``: the change in standard errors (``None`` without an interval)."""
    critical: float | None
    """The multiplier of ``se`` the interval used (Student's t equivalent of ``z``)."""


def t_critical(z: float, dof: float) -> float:
    """Student's t quantile with ``dof`` degrees of freedom at the normal's ``Φ(z)``: the multiplier that keeps
    a ``±z`` interval's coverage when the standard error comes from few blocks.

    Cornish-Fisher expansion (Abramowitz & Stegun 1964, 26.7.5): within 1 % of the exact quantile at ``z = 3``
    for ``dof ≥ 4`` (tests/test_diff.py); its error grows for larger ``z`` with few degrees of freedom. ``inf``
    degrees of freedom give ``z``.

    Example:
        >>> round(t_critical(3.0, math.inf), 6), round(t_critical(3.0, 19), 2)
        (3.0, 3.45)
    """
    if math.isinf(dof):
        return z
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3 + g4 / dof**4


def relative_change(base: float, new: float) -> tuple[float, float | None]:
    """``(new − base, (new − base) / |base|)``, the relative change ``None`` when ``base`` is 0: the change
    ``diff`` reports and ``check --baseline`` records for a rule (one definition for both).

    Example:
        >>> relative_change(2.0, 3.0), relative_change(0.0, 1.0)
        ((1.0, 0.5), (1.0, None))
    """
    change = new - base
    return change, (change / abs(base) if base != 0.0 else None)


def change_interval(
    base: float,
    new: float,
    var_base: float | None,
    var_new: float | None,
    z: float = DEFAULT_Z,
    *,
    dof_base: float = math.inf,
    dof_new: float = math.inf,
) -> Change:
    """``new − base`` and its interval ``change ± t·se``, ``se = √(var_base + var_new)`` (the runs are independent).

    ``dof_*`` are the variances' degrees of freedom (a jackknife over K blocks: K − 1); the change's follow
    Welch–Satterthwaite (Welch 1947) and ``t = t_critical(z, dof)``, so a few blocks widen the interval instead of
    flagging noise. Without a variance for either run there is no interval (``low``/``high``/``z_score`` ``None``,
    not significant), nor when neither run's figure spreads across blocks (a constant, or a quantile on one
    histogram bin). ``check --baseline`` and ``diff`` share it.

    Example:
        >>> change_interval(1.0, 1.5, 0.01, 0.0, z=3.0)
        Change(change=0.5, low=0.2, high=0.8, significant=True, z_score=5.0, critical=3.0)
    """
    change, _ = relative_change(base, new)
    if var_base is None or var_new is None:
        return Change(change, None, None, False, None, None)
    var_base, var_new = max(var_base, 0.0), max(var_new, 0.0)
    se = math.sqrt(var_base + var_new)
    if se == 0.0:
        # No spread across blocks in either run: a constant, or a figure that moves in steps (a quantile read off
        # a histogram's bins) where the jackknife says nothing (Efron 1982 §3.4). No interval, never flagged.
        return Change(change, None, None, False, None, None)
    spread = var_base**2 / dof_base + var_new**2 / dof_new
    dof = (var_base + var_new) ** 2 / spread if spread > 0 else math.inf
    critical = t_critical(z, dof)
    low, high = change - critical * se, change + critical * se
    return Change(change, round(low, 15), round(high, 15), low > 0.0 or high < 0.0, abs(change) / se, critical)


def _finding_id(finding: Mapping[str, Any]) -> tuple[str, str]:
    return str(finding.get("code", "")), str(finding.get("category", ""))


def findings_only_in(
    base: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The findings present in one run and not the other, base's first, each with ``"only_in": "base"|"new"``.

    A finding is identified by its ``code`` and ``category`` (its ``title`` and ``severity`` may carry the run's
    numbers, so they do not make two findings different). Order within a run is kept.

    Example:
        >>> a = [{"code": "K1", "category": "kl", "severity": "warning", "title": "KL high"}]
        >>> b = [{"code": "C2", "category": "clip", "severity": "error", "title": "clipping"}]
        >>> [(f["code"], f["only_in"]) for f in findings_only_in(a, b)]
        [('K1', 'base'), ('C2', 'new')]
    """
    in_base = {_finding_id(f) for f in base}
    in_new = {_finding_id(f) for f in new}
    out = [{**f, "only_in": "base"} for f in base if _finding_id(f) not in in_new]
    out += [{**f, "only_in": "new"} for f in new if _finding_id(f) not in in_base]
    return out


def _block_states(acc_by_key: Mapping[int, list[MetricState]], blocking: str) -> list[list[MetricState]]:
    blocks = [acc_by_key[key] for key in sorted(acc_by_key)]
    return merge_contiguous(blocks, MAX_STEP_BLOCKS) if blocking == "step" else [list(b) for b in blocks]


def measure(
    dataset: RolloutDataset,
    config: DiffConfig,
    label: str,
    *,
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> RunFigures:
    """Stream one run once, split into jackknife blocks, and return its figures with their variances."""
    groups = default_groups() if groups is None else list(groups)
    blocking = "step" if "step" in dataset.columns else "hash"
    run_config = replace(config, group_by="step" if blocking == "step" else None,
                         hash_blocks=0 if blocking == "step" else config.blocks)
    # The findings-only groups run over the whole run (never per block): the findings are compared, not jackknifed.
    streamed = [*groups, *diagnosis_groups()]
    acc = accumulate(dataset, run_config, streamed, workers=workers, progress=progress)
    if blocking == "step" and len(acc.by_key) < MIN_STEP_BLOCKS:
        # Too few steps to estimate a spread from: a second pass split by hash block (small runs only).
        blocking = "hash"
        run_config = replace(config, group_by=None, hash_blocks=config.blocks)
        acc = accumulate(dataset, run_config, streamed, workers=workers)
    result = finalize(dataset, run_config, streamed, acc)
    result.findings = diagnose(result.metrics, result.evidence, DetectConfig())
    steps = result.groups if blocking == "step" else []
    result.groups = []
    blocks = _block_states(acc.by_key, blocking)
    reduce = {figure.key: figure.reduce for group in groups for figure in group.figures}
    keys = [key for key, value in result.metrics.items() if _scalar(value) is not None]
    no_interval = {key: f"{reduce[key]}: the jackknife gives no interval for extremes and quantiles"
                   for key in keys if reduce.get(key) in NON_SMOOTH}
    variances = jackknife_variances(groups, run_config, blocks, [k for k in keys if k not in no_interval])
    return RunFigures(label, result, variances, blocking, len(blocks), steps, no_interval)


def diff_results(base: RunFigures, new: RunFigures, config: DiffConfig) -> DiffResult:
    """Every scalar figure both runs report, with its change and interval, ranked by how far beyond noise."""
    base_keys = {k for k, v in base.result.metrics.items() if _scalar(v) is not None}
    new_keys = {k for k, v in new.result.metrics.items() if _scalar(v) is not None}
    figures: list[FigureChange] = []
    for key in base.result.metrics:
        if key not in base_keys or key not in new_keys:
            continue
        b, n = float(base.result.metrics[key]), float(new.result.metrics[key])
        c = change_interval(b, n, base.variances.get(key), new.variances.get(key), config.z,
                            dof_base=base.n_blocks - 1, dof_new=new.n_blocks - 1)
        _, rel = relative_change(b, n)
        note = base.no_interval.get(key) or new.no_interval.get(key)
        if note is None and c.low is None:
            note = ("no spread across blocks in either run" if key in base.variances and key in new.variances
                    else "a leave-one-block-out value was not finite")
        figures.append(FigureChange(key, b, n, c.change, c.low, c.high, c.significant, c.z_score, rel, note,
                                    c.critical))
    # Ranked by how far beyond noise: the change in interval half-widths (> 1 is significant).
    figures.sort(key=lambda f: (not f.significant, f.z_score is None, -f.beyond, f.key))
    only_in = {"base": sorted(base_keys - new_keys), "new": sorted(new_keys - base_keys)}
    findings: list[dict[str, Any]] = []
    base_findings = getattr(base.result, "findings", None)
    new_findings = getattr(new.result, "findings", None)
    if base_findings is not None or new_findings is not None:
        findings = findings_only_in(base_findings or [], new_findings or [])
    return DiffResult(base, new, figures, only_in, findings, config.to_json(), config.z)


def diff(
    base: RolloutDataset,
    new: RolloutDataset,
    config: DiffConfig,
    *,
    labels: tuple[str, str] = ("base", "new"),
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> DiffResult:
    """Both runs measured with the same options (:func:`measure`) and compared (:func:`diff_results`).

    Example:
        >>> from grpo_cli.io.reader import RolloutDataset
        >>> result = diff(RolloutDataset(["a.parquet"]), RolloutDataset(["b.parquet"]), DiffConfig())  # doctest: +SKIP
        >>> [f.key for f in result.significant]  # doctest: +SKIP
        ['kl/abs_diff_mean', ...]
    """
    config.validate()
    measured = [measure(dataset, config, label, groups=groups, progress=progress, workers=workers)
                for dataset, label in zip((base, new), labels)]
    return diff_results(measured[0], measured[1], config)


