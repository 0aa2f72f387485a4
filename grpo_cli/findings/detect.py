"""Findings: documented thresholds applied to figure dicts (``grpo-cli``'s metric keys and the ``diag/*`` keys of
:mod:`grpo_cli.core.diagnosis`), in the style of a linter's diagnostics.

:func:`detect` is pure: it reads figures (the overall dict, optionally per-step rows) and returns
:class:`Finding` objects sorted by severity and code. Every threshold is a module constant whose docstring gives the
reason or source; ``docs/findings.md`` has one section per code. Severity follows the evidence: each statistic's
95 % interval against the thresholds (``inconclusive`` when only the estimate is past the warning threshold).

Detectors whose statistic is explained by an earlier, more basic finding (an alignment shift or prompt tokens in the
loss distort every old-vs-new figure) are demoted to ``info`` with a note, so the user fixes the cause first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grpo_cli.findings._base import (
    CATEGORIES,
    CODES,
    SEVERITIES,
    DetectConfig,
    Detector,
    Finding,
    _cap,
    _Ctx,
    per_step_rows,
)
from grpo_cli.findings._inputs import DETECTORS as _INPUTS
from grpo_cli.findings._policy import DETECTORS as _POLICY
from grpo_cli.findings._training import DETECTORS as _TRAINING
from grpo_cli.findings.thresholds import *  # noqa: F403  # every threshold stays importable from here

__all__ = [
    "CATEGORIES",
    "CODES",
    "SEVERITIES",
    "DETECTORS",
    "DetectConfig",
    "Detector",
    "Finding",
    "detect",
    "detector_inputs",
    "per_step_rows",
]

DETECTORS: tuple[Detector, ...] = (*_INPUTS, *_POLICY, *_TRAINING)
"""Every detector, in the order :func:`detect` runs them (causes first)."""
_OLD_VS_NEW = {"temperature", "truncated-sampling", "mismatch", "weight-sync", "importance-weights", "clipping",
               "retokenization"}
_DEMOTIONS: tuple[tuple[tuple[str, ...], set[str]], ...] = (
    (("GRP101", "GRP104"), _OLD_VS_NEW),
    # a stale engine's lag-0 disagreement is the policy's drift: it reads as mismatch, and a tilt when entropy falls
    (("GRP201",), {"mismatch", "importance-weights", "temperature"}),
    (("GRP102", "GRP103", "GRP108"), {"mismatch", "importance-weights", "weight-sync"}),
    (("GRP202",), {"importance-weights"}),  # a mismatch's weights are its tail
    (("GRP101",), {"mask"}),  # GRP104's zeros may be the fill of the shifted column
)
"""(causes, categories they demote): a detector in one of the categories needs the causes' detectors to run too."""


def detector_inputs(codes: Iterable[str]) -> tuple[list[str], list[str]]:
    """What the detectors reporting ``codes`` read, with the detectors whose findings can demote theirs.

    Returns:
        The figure keys (``analyze --select`` patterns) and the findings-only group names they read; a run that
        computes these gives those codes the same findings as a run that computes every figure.
    """
    wanted = set(codes)
    while True:
        categories = {CODES[code][0] for code in wanted}
        more = {cause for causes, demoted in _DEMOTIONS if categories & demoted for cause in causes} - wanted
        if not more:
            break
        wanted |= more
    chosen = [d for d in DETECTORS if wanted & set(d.codes)]
    keys = list(dict.fromkeys(key for d in chosen for key in d.keys))
    groups = list(dict.fromkeys(group for d in chosen for group in d.groups))
    return keys, groups


def _demote(findings: list[Finding], causes: tuple[str, ...], categories: set[str]) -> None:
    """Cap at ``info`` the findings in ``categories`` when a finding in ``causes`` explains them."""
    found = [f.code for f in findings if f.code in causes and f.severity in ("warning", "error")]
    if not found:
        return
    why = ", ".join(found)
    for f in findings:
        if f.category in categories and f.code not in causes and f.severity != "info":
            f.severity = _cap(f.severity, f.notes, f"explained by {why}: fix that first and re-run")


def _loud(findings: list[Finding], code: str) -> Finding | None:
    return next((f for f in findings if f.code == code and f.severity in ("warning", "error")), None)


def _retokenised_not_shifted(findings: list[Finding]) -> None:
    """A short re-tokenised sequence can agree better at a one-token shift (the shifted comparison drops the pair
    at its end, where the re-encoded token may sit): when no more sequences prefer a shift than twice those that are
    re-tokenised, the re-tokenisation is the cause."""
    retok, shift = _loud(findings, "GRP108"), _loud(findings, "GRP101")
    if retok is None or shift is None:
        return
    shifted = max(v["value"] for k, v in shift.evidence.items() if k.startswith("diag/shift_seq_"))
    if shifted <= 2 * retok.evidence["diag/retok_seq_frac"]["value"]:
        shift.severity = _cap(shift.severity, shift.notes, "explained by GRP108: re-tokenised sequences look shifted")


def _tilt_or_lift(findings: list[Finding]) -> None:
    """When both a temperature (GRP102) and a truncation (GRP103) are conclusive, one explains the other: a colder
    engine lifts every likely token too (and a peaked policy samples few others) but steepens the line (slope above
    1); renormalisation lifts every token by −log(kept mass), most where the context is flat, which flattens it."""
    tilt, lift = _loud(findings, "GRP102"), _loud(findings, "GRP103")
    if tilt is None or lift is None:
        return
    if tilt.evidence["diag/pair_slope_old_on_new"]["value"] > 1:
        lift.severity = _cap(lift.severity, lift.notes,
                             "explained by GRP102: a colder engine lifts likely tokens and steepens the line")
    else:
        tilt.severity = _cap(tilt.severity, tilt.notes,
                             "explained by GRP103: a truncated sampling set lifts every behaviour log-prob")


def detect(
    figures: Mapping[str, Any],
    per_step: Sequence[Mapping[str, Any]] | None = None,
    config: DetectConfig | None = None,
) -> list[Finding]:
    """Apply every detector to ``figures`` and return the findings, most severe first, then by code.

    Args:
        figures: overall figures: ``analyze``'s metric keys and the ``diag/*`` keys (``diagnosis_compute``).
        per_step: optional ``--group-by step`` groups or flat per-step rows; used where ``diag/by_step`` is absent.
        config: what the run corrects for (:class:`DetectConfig`).
    """
    cfg = config or DetectConfig()
    ctx = _Ctx(figures, per_step_rows(per_step), cfg)
    findings: list[Finding] = []
    for detector in DETECTORS:
        findings.extend(detector.run(ctx))
    _retokenised_not_shifted(findings)
    _tilt_or_lift(findings)
    if any(f.code == "GRP101" and f.severity != "info" for f in findings):
        for f in findings:
            if f.code == "GRP104" and set(f.evidence) == {"diag/old_zero_new_nonzero_frac"} and f.severity != "info":
                f.severity = _cap(f.severity, f.notes, "the zeros are the fill of the shifted column (GRP101)")
    for causes, categories in _DEMOTIONS[:4]:
        _demote(findings, causes, categories)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (-order[f.severity], f.code))
