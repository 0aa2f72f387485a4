"""Findings: what is wrong with a run, where, and how to fix it — figures turned into diagnostics, as a linter does.

:func:`diagnose` applies the detectors (:mod:`grpo_cli.findings.detect`: documented thresholds, confidence caps,
causes before effects) to a streaming run's figures and its findings-only evidence (``diag/*``,
:mod:`grpo_cli.metrics.diagnosis`); :func:`select` filters findings by code or category (``--select``/``--ignore``,
as ruff's); :func:`explain` is the text of one code (``grpo-cli explain CODE``, its section of
``docs/findings.md``), rendered from its declaration in :mod:`grpo_cli.findings.catalog`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.findings.catalog import RULES
from grpo_cli.findings.detect import CATEGORIES, CODES, SEVERITIES, DetectConfig, Finding, detect, detector_inputs

__all__ = [
    "CATEGORIES",
    "CODES",
    "SEVERITIES",
    "DetectConfig",
    "Finding",
    "detect",
    "detector_inputs",
    "diagnose",
    "explain",
    "select",
    "selected_codes",
    "severity_counts",
    "verdict",
]


def diagnose(
    metrics: Mapping[str, Any], evidence: Mapping[str, Any], config: DetectConfig | None = None
) -> list[dict[str, Any]]:
    """The findings of a run (as JSON-ready dicts, most severe first) from its figures and ``diag/*`` evidence."""
    return [finding.to_dict() for finding in detect({**metrics, **evidence}, None, config)]


def _matches(finding: Mapping[str, Any], patterns: Iterable[str]) -> bool:
    return any(finding["code"].startswith(p) or finding["category"] == p for p in patterns)


def check_patterns(patterns: Sequence[str], option: str) -> None:
    """Refuse (exit 2) a ``--select``/``--ignore`` entry that names no code (or code prefix) and no category."""
    unknown = [p for p in patterns if p not in CATEGORIES and not any(code.startswith(p) for code in CODES)]
    if unknown:
        raise UsageError(f"{option}: unknown {', '.join(unknown)} (codes {', '.join(CODES)}; categories "
                         f"{', '.join(CATEGORIES)})")


def select(
    findings: Sequence[Mapping[str, Any]], include: Sequence[str] | None = None, exclude: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``findings`` whose code (or code prefix, ``GRP1``) or category is in ``include`` (all when ``None``) and not
    in ``exclude``."""
    return [dict(f) for f in findings
            if (include is None or _matches(f, include)) and not _matches(f, exclude)]


def selected_codes(include: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """The codes whose findings :func:`select` keeps for these ``include``/``exclude`` patterns."""
    return [code for code, (category, _) in CODES.items()
            if select([{"code": code, "category": category}], include, exclude)]


def severity_counts(findings: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """``{"error": n, "warning": n, "inconclusive": n, "info": n}``."""
    return {severity: sum(f["severity"] == severity for f in findings) for severity in reversed(SEVERITIES)}


def verdict(findings: Sequence[Mapping[str, Any]], n_tokens: int) -> str:
    """One line: ``2 problems, 1 warning, 1 inconclusive in 1.2 M tokens`` (``no problem found in …`` only when
    nothing reaches a warning and nothing is inconclusive)."""
    counts = severity_counts(findings)
    size = f"{n_tokens / 1e6:.1f} M tokens" if n_tokens >= 100_000 else f"{n_tokens:,} tokens"
    parts = []
    for severity, word in (("error", "problem"), ("warning", "warning"), ("inconclusive", "inconclusive")):
        n = counts[severity]
        if n:
            parts.append(f"{n} {word}{'s' if n != 1 and severity != 'inconclusive' else ''}")
    if not parts:
        note = f" ({counts['info']} note{'s' if counts['info'] != 1 else ''})" if counts["info"] else ""
        return f"no problem found in {size}{note}"
    if parts == [f"{counts['inconclusive']} inconclusive"]:
        return f"no conclusive problem, {parts[0]} in {size}: more data would settle it"
    return f"{', '.join(parts)} in {size}"


def explain(code: str) -> str:
    """The documentation of ``code``: its section of ``docs/findings.md`` (what it means, why it matters, how it is
    detected, how to fix it), rendered from its :class:`~grpo_cli.findings.catalog.Rule`. Raises
    :class:`UsageError` for an unknown code."""
    code = code.upper()
    if code not in CODES:
        raise UsageError(f"unknown finding code '{code}' (known: {', '.join(CODES)})")
    return RULES[code].markdown()
