"""What every detector shares: the codes and categories (derived from :mod:`grpo_cli.findings.catalog`),
:class:`DetectConfig`, :class:`Finding`, and the plumbing that reads figures (numbers, per-step series, trends) and
grades and caps severities."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from grpo_cli._intervals import wilson
from grpo_cli.findings.catalog import CATEGORIES as _CATALOG_CATEGORIES
from grpo_cli.findings.catalog import RULES

SEVERITIES = ("info", "inconclusive", "warning", "error")
"""Least to most severe. ``inconclusive``: the statistic's estimate is past the warning threshold but its 95 %
interval reaches back below it — more data would settle it either way; it never fails ``check``."""
CATEGORIES: tuple[str, ...] = _CATALOG_CATEGORIES
"""Every category, in their public order (:data:`grpo_cli.findings.catalog.CATEGORIES`)."""
#: code → (category, short name), in code order, from the declarations (:data:`grpo_cli.findings.catalog.RULES`)
CODES: dict[str, tuple[str, str]] = {code: (rule.category, rule.name) for code, rule in RULES.items()}


@dataclass(frozen=True)
class DetectConfig:
    """What :func:`detect` knows about the run beyond the figures.

    Attributes:
        max_staleness: the largest lag the run's correction is meant for (TRL ``async_grpo`` ``max_staleness``
            defaults to 4; AReaL's ``max_head_offpolicyness`` bounds it at rollout time).
        prox_approximation: ``"loglinear"`` or ``"linear"`` when the run uses AReaL's ``prox_logp_method``
            approximation instead of recomputing, else ``None``.
    """

    max_staleness: int = 4
    prox_approximation: str | None = None


@dataclass(frozen=True)
class Detector:
    """One detector and what it reads, so a command can compute only the inputs of the detectors it runs.

    Attributes:
        run: the detector: figures in, findings out.
        codes: the codes it may report.
        groups: the findings-only groups (``diag/shift``, … of :mod:`grpo_cli.metrics.diagnosis`) whose ``diag/*``
            values it reads.
        keys: the reported figures it reads (keys or key patterns, as ``analyze --select`` takes them); the dump
            counts (``n_valid_tokens``, ``n_sequences``) every run has are not listed.
    """

    run: Callable[[_Ctx], list[Finding]]
    codes: tuple[str, ...]
    groups: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()


@dataclass
class Finding:
    """One diagnostic.

    Attributes:
        code: stable code (``GRP101`` …), declared in :data:`grpo_cli.findings.catalog.RULES`.
        category: one of :data:`CATEGORIES`.
        severity: ``info``, ``warning`` or ``error``.
        title: one line.
        evidence: figure → ``{"value", "low", "high", "threshold"}``: the statistic, its 95 % interval over the
            natural unit (sequences or GRPO groups; ``low == high == value`` for a count or an exact fact) and the
            threshold it is graded against.
        where: steps, lags, groups, and the worst sequences as ``{"file", "row", …}``.
        fix: what to change in the trainer.
        notes: why the severity was capped, if it was.
    """

    code: str
    category: str
    severity: str
    title: str
    evidence: dict[str, dict[str, Any]]
    where: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- helpers ---------------------------------------------------------------------------------------------------------
def _num(fig: Mapping[str, Any], key: str) -> float | None:
    v = fig.get(key)
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)) and math.isfinite(float(v)):
        return float(v)
    return None


def _grade(value: float, warning: float, error: float | None = None, *, below: bool = False) -> str | None:
    """``error``/``warning`` when ``value`` passes the thresholds (from above, or from below with ``below``)."""
    passes: Callable[[float], bool] = (lambda t: value <= t) if below else (lambda t: value >= t)
    if error is not None and passes(error):
        return "error"
    if passes(warning):
        return "warning"
    return None


def _cap(severity: str, notes: list[str], why: str) -> str:
    if severity != "info":
        notes.append(why)
    return "info"


def _graded_fraction(
    frac: float, n: float, warning: float, error: float | None, unit: str
) -> tuple[str, list[str], Estimate]:
    """A fraction of ``n`` units graded by its Wilson interval: (severity, ``info`` when below every threshold;
    notes; the estimate). Two flagged sequences of 64 are a fraction of 3 % with an interval from 1 % to 11 %:
    inconclusive, not a warning."""
    est = _wilson(round(frac * n), int(n))
    severity = _judge(est, warning, error) or "info"
    notes = _settle_notes(severity, est, warning, n, unit)
    return severity, notes, est


def _ev(value: Any, threshold: Any, low: Any = None, high: Any = None, **extra: Any) -> dict[str, Any]:
    """An evidence entry; an exact statistic (a count, a fact of the dump) has ``low == high == value``."""
    return {"value": value, "low": value if low is None else low, "high": value if high is None else high,
            "threshold": threshold, **extra}


@dataclass(frozen=True)
class Estimate:
    """A statistic with its 95 % interval (``low``/``high`` infinite when no spread could be estimated)."""

    value: float
    low: float
    high: float

    def ev(self, threshold: Any, **extra: Any) -> dict[str, Any]:
        return _ev(self.value, threshold, self.low, self.high, **extra)

    def flipped(self) -> Estimate:
        return Estimate(-self.value, -self.high, -self.low)


def _estimate(fig: Mapping[str, Any], key: str) -> Estimate | None:
    """``fig[key]`` as an :class:`Estimate`: a ``{"value", "low", "high"}`` dict, or a plain number taken as exact."""
    v = fig.get(key)
    if isinstance(v, Mapping):
        value = v.get("value")
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            low, high = v.get("low"), v.get("high")
            return Estimate(float(value), -math.inf if low is None else float(low),
                            math.inf if high is None else float(high))
        return None
    n = _num(fig, key)
    return None if n is None else Estimate(n, n, n)


def _judge(est: Estimate, warning: float, error: float | None = None, *, below: bool = False) -> str | None:
    """Severity from evidence: ``error`` when the whole interval is past ``error``, ``warning`` when it is past
    ``warning``, ``inconclusive`` when the estimate is past ``warning`` but the interval reaches back, else
    ``None``. ``below``: the thresholds are passed from above (smaller is worse)."""
    if below:
        return _judge(est.flipped(), -warning, None if error is None else -error)
    if error is not None and est.low >= error:
        return "error"
    if est.low >= warning:
        return "warning"
    if est.value >= warning:
        return "inconclusive"
    return None


def _wilson(k: int, n: int) -> Estimate:
    """A fraction of ``n`` units (sequences, groups) with Wilson's 95 % score interval."""
    low, high = wilson(k, n)
    return Estimate(k / n if n else 0.0, low, high)


def _settle_notes(severity: str | None, est: Estimate, threshold: float, n: float | None, unit: str) -> list[str]:
    """For an ``inconclusive`` finding, the note saying how much more data would make ``est`` conclusive against
    ``threshold`` (nothing for any other severity)."""
    return [_settle(est, threshold, n, unit)] if severity == "inconclusive" else []


def _settle(est: Estimate, threshold: float, n: float | None, unit: str) -> str:
    """How much more data would make an estimate past ``threshold`` conclusive: the interval shrinks as 1/√n."""
    gap, half = abs(est.value - threshold), abs(est.value - (est.low if est.value >= threshold else est.high))
    if not math.isfinite(half) or gap <= 0:
        return "more data would settle it"
    factor = (half / gap) ** 2
    if n:
        return f"about {factor:.1f}× the data (≈ {math.ceil(n * factor):,} {unit}) would settle it"
    return f"about {factor:.1f}× the data would settle it"


def _sequences(rows: Any, limit: int = 5) -> list[dict[str, Any]]:
    out = []
    for r in (rows or [])[:limit]:
        item = {"file": r.get("file"), "row": r.get("row")}
        if r.get("step") is not None:
            item["step"] = r["step"]
        if "score" in r:
            item["score"] = r["score"]
        out.append(item)
    return out


def per_step_rows(per_step: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """``--group-by step`` groups (``{"key": {"step": s} or s, "metrics": {…}}``) or already flat rows with a
    ``step`` key, as flat rows sorted by step."""
    rows = []
    for g in per_step or []:
        if "metrics" in g:
            key = g.get("key")
            step = key.get("step") if isinstance(key, Mapping) else key
            rows.append({"step": step, **g["metrics"]})
        else:
            rows.append(dict(g))
    return sorted((r for r in rows if isinstance(r.get("step"), (int, float))), key=lambda r: r["step"])


def _series(fig: Mapping[str, Any], steps: list[dict[str, Any]], diag_key: str, existing: str | None) -> list[
    tuple[int, float, float]
]:
    """(step, value, weight) from ``diag/by_step`` rows (preferred) or from per-step figures."""
    out: list[tuple[int, float, float]] = []
    for r in fig.get("diag/by_step") or []:
        v = r.get(diag_key)
        if v is not None and math.isfinite(v):
            if diag_key.startswith("lag0"):
                w = r.get("lag0_n_tokens")
            elif diag_key in ("no_eos_frac", "reward_mean"):
                w = r.get("n_sequences")
            else:
                w = r.get("n_tokens", 1)
            out.append((int(r["step"]), float(v), float(w or 1)))
    if out or existing is None:
        return out
    for r in steps:
        if existing == "by_staleness/lag0":
            rows = [b for b in r.get("by_staleness") or [] if b.get("lag") == 0]
            if rows and rows[0].get("abs_diff/mean") is not None:
                out.append((int(r["step"]), float(rows[0]["abs_diff/mean"]), float(rows[0].get("n_tokens", 1))))
        else:
            v = _num(r, existing)
            if v is not None:
                out.append((int(r["step"]), v, float(r.get("n_valid_tokens", 1) or 1)))
    return out


def _halves(series: list[tuple[int, float, float]], part: float = 0.5) -> tuple[float, float] | None:
    """Weighted means of the first and last ``part`` of the steps (at least one step each)."""
    if len(series) < 4:
        return None
    k = max(1, int(len(series) * part))

    def mean(xs: list[tuple[int, float, float]]) -> float:
        w = sum(x[2] for x in xs)
        return sum(x[1] * x[2] for x in xs) / w if w else math.nan

    return mean(series[:k]), mean(series[-k:])



class _Ctx:
    def __init__(self, fig: Mapping[str, Any], steps: list[dict[str, Any]], cfg: DetectConfig) -> None:
        self.fig, self.steps, self.cfg = fig, steps, cfg
        n_tok = _num(fig, "n_valid_tokens")
        n_seq = _num(fig, "n_sequences")
        if n_tok is None:
            n_tok = sum(r.get("n_tokens", 0) for r in fig.get("diag/by_step") or []) or None
        if n_seq is None:
            n_seq = sum(r.get("n_sequences", 0) for r in fig.get("diag/by_step") or []) or None
        self.n_tokens, self.n_sequences = n_tok, n_seq



def _max_sev(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if SEVERITIES.index(a) >= SEVERITIES.index(b) else b



def _trend(series: list[tuple[int, float, float]]) -> tuple[float, float, float] | None:
    """(Spearman rank correlation of value with step, fitted first value, fitted last value) of a per-step series
    (least-squares line over the steps, unweighted), or ``None`` below 4 steps."""
    if len(series) < 4:
        return None
    xs = [float(s) for s, _, _ in series]
    ys = [v for _, v, _ in series]
    n = len(xs)

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(n), key=lambda i: v[i])
        out = [0.0] * n
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    def corr(a: list[float], b: list[float]) -> float:
        ma, mb = sum(a) / n, sum(b) / n
        cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        va = sum((x - ma) ** 2 for x in a)
        vb = sum((y - mb) ** 2 for y in b)
        return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else 0.0

    mx, my = sum(xs) / n, sum(ys) / n
    vx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx if vx > 0 else 0.0
    return corr(ranks(xs), ranks(ys)), my + slope * (xs[0] - mx), my + slope * (xs[-1] - mx)

