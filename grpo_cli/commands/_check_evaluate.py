"""Evaluating ``check``'s rules: the binding limits of a rule (with baseline arithmetic), its value overall or in
its worst ``per`` group, the :class:`RuleResult` and its message; and the built-in detector rules
(:func:`finding_results`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.commands._check_baseline import Baseline
from grpo_cli.commands._check_rules import Rule, Severity, Status, _is_number
from grpo_cli.errors import UsageError
from grpo_cli.findings import CODES, SEVERITIES


def fmt(value: Any) -> str:
    """Numbers as reports show them (``grpo_cli._format.format_value``, without thousands separators)."""
    from grpo_cli._format import format_value

    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return format_value(value)


@dataclass(frozen=True)
class _Limit:
    value: float
    text: str
    derived: bool = False  # from the baseline: the message also shows the resulting number


def _limits(rule: Rule, base: float | None) -> tuple[_Limit | None, _Limit | None, list[str]]:
    """The binding lower and upper limits of ``rule`` and how the baseline-derived ones were formed.

    ``max_rel_increase`` r: (v − b)/|b| ≤ r ⇔ v ≤ b + r·|b|. With b = 0 this is v ≤ 0 (any increase from 0 is
    infinitely large). ``max_abs_change`` c: b − c ≤ v ≤ b + c.
    """
    lows: list[_Limit] = []
    highs: list[_Limit] = []
    notes: list[str] = []
    if rule.min is not None:
        lows.append(_Limit(rule.min, f"min {fmt(rule.min)}"))
    if rule.max is not None:
        highs.append(_Limit(rule.max, f"max {fmt(rule.max)}"))
    if base is not None and rule.max_rel_increase is not None:
        r = rule.max_rel_increase
        text = f"baseline {fmt(base)} {'+' if r >= 0 else '−'}{fmt(abs(r) * 100)}%"
        highs.append(_Limit(base + r * abs(base), text, derived=True))
        notes.append(text)
    if base is not None and rule.max_abs_change is not None:
        c = rule.max_abs_change
        lows.append(_Limit(base - c, f"baseline {fmt(base)} − {fmt(c)}", derived=True))
        highs.append(_Limit(base + c, f"baseline {fmt(base)} + {fmt(c)}", derived=True))
        notes.append(f"baseline {fmt(base)} ± {fmt(c)}")
    low = max(lows, key=lambda limit: limit.value) if lows else None
    high = min(highs, key=lambda limit: limit.value) if highs else None
    return low, high, notes


def _bound_text(low: _Limit | None, high: _Limit | None, notes: list[str]) -> str:
    if low is not None and high is not None:
        text = f"in [{fmt(low.value)}, {fmt(high.value)}]"
    elif high is not None:
        text = f"≤ {fmt(high.value)}"
    else:
        assert low is not None
        text = f"≥ {fmt(low.value)}"
    return f"{text} ({'; '.join(notes)})" if notes else text


def _excess(value: Any, low: _Limit | None, high: _Limit | None,
            noise: tuple[float, float] | None = None) -> float:
    """How far ``value`` lies outside [low, high] (> 0: violated; ≤ 0: inside, by that margin).

    A non-finite or null value violates every rule (no figure grpo-cli reports is healthy at NaN or ±inf, and
    ``null`` means the figure has no value, e.g. ``max_safe_lag`` when no lag is safe): +inf. With ``noise``, the
    value's interval ``(low, high)`` from a dump baseline's jackknife, a limit derived from the baseline is violated
    only when the whole interval lies beyond it: the interval's end nearest the limit is compared instead.
    """
    if value is None:
        return math.inf
    v = float(value)
    if not math.isfinite(v):
        return math.inf
    v_low = noise[1] if noise is not None and low is not None and low.derived else v
    v_high = noise[0] if noise is not None and high is not None and high.derived else v
    below = low.value - v_low if low is not None else -math.inf
    above = v_high - high.value if high is not None else -math.inf
    return max(below, above)


def _describe(metric: str, value: Any, low: _Limit | None, high: _Limit | None) -> str:
    """``metric = v is above max 0.05`` (and ``= limit`` when the limit came from the baseline)."""
    if value is None:
        return f"{metric} has no value (null)"
    v = float(value)
    if math.isnan(v):
        return f"{metric} is NaN"
    if not math.isfinite(v):
        return f"{metric} is {'+' if v > 0 else '-'}inf"
    if low is not None and v < low.value:
        side, limit = "below", low
    else:
        assert high is not None
        side, limit = "above", high
    tail = f" = {fmt(limit.value)}" if limit.derived else ""
    return f"{metric} = {fmt(value)} is {side} {limit.text}{tail}"


def _noise_note(result: RuleResult, baseline: Baseline | None, relative: bool, *, within: bool) -> str:
    """With a dump baseline: the change, its interval and whether it is beyond the bound's noise."""
    if baseline is None or not baseline.from_dump or not relative or result.change is None:
        return ""
    if result.change_low is None or result.change_high is None:
        return (f"; change {fmt(result.change)} has no noise estimate (an extreme, a quantile or a constant): "
                "compared as a fixed margin")
    text = f"; change {fmt(result.change)}, interval [{fmt(result.change_low)}, {fmt(result.change_high)}]"
    return text + (" — past the bound but within noise" if within else "")


@dataclass
class RuleResult:
    """A rule's outcome. With ``per``, ``value``/``group`` are the worst group's (the one furthest outside the
    bound, or nearest to it when all pass) and ``violations`` lists every violating group, worst first."""

    rule: Rule
    status: Status
    value: float | int | None = None
    group: int | None = None
    bound: str = ""
    low: float | None = None
    high: float | None = None
    baseline: float | None = None
    change: float | None = None
    """``value − baseline`` with a baseline, computed as ``diff`` does
    (:func:`~grpo_cli.commands.diff.relative_change`); ``rel_change`` divides it by ``|baseline|``."""
    rel_change: float | None = None
    change_low: float | None = None
    change_high: float | None = None
    """With a dump baseline, the interval of ``change`` (``grpo-cli diff``'s jackknife); ``None`` otherwise."""
    message: str = ""
    n_groups: int | None = None
    violations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def where(self) -> str:
        """``step 82`` with the count of violating groups, or ``""`` without ``per``."""
        if self.rule.per is None or self.group is None:
            return ""
        text = f"{self.rule.per} {self.group}"
        if self.violations:
            return f"{text} ({len(self.violations)}/{self.n_groups} violate)"
        return f"{text} (closest of {self.n_groups})"

    def to_json(self) -> dict[str, Any]:
        rule = self.rule
        return {
            "name": rule.label,
            "metric": rule.metric,
            "severity": rule.severity.value,
            "status": self.status.value,
            "value": self.value,
            "bound": self.bound,
            "limits": {"min": self.low, "max": self.high},
            "bounds": rule.bounds_json(),
            "baseline": self.baseline,
            "change": self.change,
            "rel_change": self.rel_change,
            "change_low": self.change_low,
            "change_high": self.change_high,
            "per": rule.per,
            "group": self.group,
            "n_groups": self.n_groups,
            "violations": self.violations,
            "message": self.message,
            "source": rule.source,
        }


_PLURAL = {"step": "steps", "current_version": "versions", "group_id": "groups", "seq_id": "sequences"}


def _with_hint(rule: Rule, message: str) -> str:
    return f"{message} — {rule.hint}" if rule.hint else message


def evaluate_rule(
    rule: Rule,
    metrics: Mapping[str, Any],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: Baseline | None,
    *,
    omitted: Mapping[str, str] | None = None,
) -> RuleResult:
    """Evaluate one rule against overall ``metrics`` or, with ``rule.per``, against ``groups[rule.per]``
    (``[{"key": k, "metrics": {...}}, ...]`` as :class:`~grpo_cli.engine.run.AnalysisResult.groups`).

    A metric the figures lack gives ``skipped`` for an ``optional`` rule and raises :class:`UsageError` (exit 2)
    otherwise, with the reason from ``omitted``.
    """
    base = baseline.value(rule) if baseline is not None and rule.needs_baseline else None
    if rule.needs_baseline and baseline is None:
        raise UsageError(f"{rule.source} ({rule.metric}): max_rel_increase/max_abs_change need --baseline")
    low, high, notes = _limits(rule, base)
    bound = _bound_text(low, high, notes)
    result = RuleResult(rule, Status.PASS, bound=bound, low=low.value if low else None,
                        high=high.value if high else None, baseline=base)

    if rule.per is None:
        candidates = [(None, metrics[rule.metric])] if rule.metric in metrics else []
    else:
        candidates = [(g["key"], g["metrics"][rule.metric]) for g in groups.get(rule.per, ())
                      if rule.metric in g["metrics"]]
    if not candidates:
        if rule.per is not None and rule.metric in metrics:
            reason = f"it is reported for the whole dump only, not per {rule.per}"
        else:
            reason = (omitted or {}).get(rule.metric, "not reported for this dump")
        if rule.optional:
            result.status = Status.SKIPPED
            subject = rule.metric if rule.per is None else f"{rule.metric} per {rule.per}"
            result.message = f"{subject} not computed: {reason}"
            return result
        raise UsageError(f"{rule.source}: '{rule.metric}' cannot be computed for this dump: {reason}")
    for _, value in candidates:
        if value is not None and not _is_number(value):
            kind = "a list or table" if isinstance(value, (list, dict)) else type(value).__name__
            raise UsageError(f"{rule.source}: '{rule.metric}' is not a number ({kind}); rules need a scalar metric")

    # A dump baseline's interval of the change applies to the overall figure (per-group values have none).
    interval = baseline.intervals.get(rule.metric) if base is not None and baseline and rule.per is None else None
    noise = None
    if interval is not None and _is_number(candidates[0][1]):
        noise = (float(base) + interval[0], float(base) + interval[1])  # type: ignore[arg-type]  # a number here
    excess = [_excess(value, low, high, noise) for _, value in candidates]
    worst = max(range(len(candidates)), key=lambda i: excess[i])  # first of equals: the smallest group key
    result.group, result.value = candidates[worst]
    if base is not None and _is_number(result.value):
        from grpo_cli.commands.diff import relative_change

        result.change, result.rel_change = relative_change(float(base), float(result.value))
        if interval is not None:
            result.change_low, result.change_high = interval
    violated = [i for i in sorted(range(len(candidates)), key=lambda i: -excess[i]) if excess[i] > 0]
    if rule.per is not None:
        result.n_groups = len(candidates)
        result.violations = [{"group": candidates[i][0], "value": candidates[i][1]} for i in violated]
    noise_note = _noise_note(result, baseline, base is not None and rule.per is None,
                             within=not violated and _excess(result.value, low, high) > 0)
    if not violated:
        if rule.per is None:
            result.message = f"{rule.metric} = {fmt(result.value)}, {bound}{noise_note}"
        else:
            plural = _PLURAL.get(rule.per, f"{rule.per} groups")
            result.message = (f"{rule.metric} {bound} in all {len(candidates)} {plural} "
                              f"(closest: {rule.per} {result.group}, {fmt(result.value)})")
        return result

    result.status = Status.FAIL if rule.severity is Severity.ERROR else Status.WARN
    message = _describe(rule.metric, result.value, low, high) + noise_note
    if rule.per is not None:
        shown = ", ".join(str(candidates[i][0]) for i in violated[:8]) + (", …" if len(violated) > 8 else "")
        plural = _PLURAL.get(rule.per, f"{rule.per} groups")
        message = (f"{message} at {rule.per} {result.group}; "
                   f"{len(violated)} of {len(candidates)} {plural} violate: {shown}")
    result.message = _with_hint(rule, message)
    return result



def evaluate_rules(
    rules: Sequence[Rule],
    metrics: Mapping[str, Any],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: Baseline | None,
    omitted: Mapping[str, str],
) -> list[RuleResult]:
    """Evaluate every rule (:func:`evaluate_rule`, never stopping at the first); the problems that make rules
    impossible to evaluate are raised together as one :class:`UsageError` (exit 2). ``check`` and ``report`` both
    evaluate their rules here."""
    results: list[RuleResult] = []
    problems: list[str] = []
    for rule in rules:
        try:
            results.append(evaluate_rule(rule, metrics, groups, baseline, omitted=omitted))
        except UsageError as exc:
            problems.append(str(exc))
    if problems:
        raise UsageError("; ".join(problems))
    return results


_FINDING_STATUS = {"error": Status.FAIL, "warning": Status.WARN}


def finding_results(findings: Sequence[Mapping[str, Any]]) -> list[RuleResult]:
    """One rule per detector code with a finding at ``warning`` or ``error``: it fails on an ``error`` (exit 1) and
    warns on a ``warning``; ``info`` findings stay in the report's ``findings`` without a rule row."""
    results = []
    for code, (category, name) in CODES.items():
        mine = [f for f in findings if f["code"] == code and f["severity"] in _FINDING_STATUS]
        if not mine:
            continue
        worst = max(mine, key=lambda f: SEVERITIES.index(f["severity"]))
        rule = Rule(code, max=0, name=f"{code} {name}", source=f"findings (grpo-cli explain {code})",
                    hint=worst.get("fix"))
        message = f"{code} [{category}] {worst['severity']}: {worst['title']}"
        results.append(RuleResult(rule, _FINDING_STATUS[worst["severity"]], bound=worst["severity"],
                                  message=_with_hint(rule, message)))
    return results
