"""GRP2xx: trainer against inference engine and off-policy data — weight sync, numeric mismatch, importance
weights, staleness, the proximal approximation, clipping."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from grpo_cli.findings._base import (
    Detector,
    Estimate,
    Finding,
    _cap,
    _Ctx,
    _estimate,
    _ev,
    _grade,
    _judge,
    _max_sev,
    _num,
    _sequences,
    _series,
    _settle_notes,
    _trend,
    _wilson,
)
from grpo_cli.findings.catalog import RULES
from grpo_cli.findings.thresholds import (
    BIG_SEQ_WARNING,
    CLIP_ERROR,
    CLIP_WARNING,
    MULT_ERROR_ERROR,
    MULT_ERROR_WARNING,
    PROX_BEYOND_WARNING,
    PROX_EQUAL_ERROR,
    PROX_EQUAL_WARNING,
    PROX_INFO_LAG,
    STALE_ERROR,
    STALE_WARNING,
    SYNC_DRIFT_RATIO,
    SYNC_LAG0_SPREAD,
    SYNC_LAG_DRIFT,
    SYNC_MIN_RISE,
    SYNC_MIN_SEQ_RISE,
    SYNC_RANK_CORR,
    SYNC_RATIO_ERROR,
    SYNC_RATIO_WARNING,
    TAIL_ERROR,
    TAIL_WARNING,
)


def _lag_excess(f: Mapping[str, Any]) -> list[tuple[int, float, float]]:
    """Per step, the largest excess of a sequence's mean |new − old| over the typical value at its lag (the median
    over steps of ``diag/by_step_lag`` ``abs_diff_mean``): a stale engine raises it at every lag, so it shows even in
    steps where the broken worker produced no lag-0 sequence. Only when some step's worst lag-0 sequence is at
    least SYNC_LAG0_SPREAD times another step's (an engine out of sync at lag 0) and the policy's own change per
    version
    (``prox_abs_diff_mean`` of ``diag/by_step``) does not rise (fitted last/first < SYNC_DRIFT_RATIO): a larger
    policy step (GRP206, GRP401) raises the lag > 0 disagreement too."""
    rows = f.get("diag/by_step_lag") or []
    lag0 = [r["lag0_seq_max"] for r in f.get("diag/by_step") or [] if r.get("lag0_seq_max") is not None]
    if not lag0 or min(lag0) <= 0 or max(lag0) < SYNC_LAG0_SPREAD * min(lag0):
        return []  # no step has lag-0 sequences far off the others: no engine is out of sync at lag 0
    drift = [(int(r["step"]), float(r["prox_abs_diff_mean"]), 1.0) for r in f.get("diag/by_step") or []
             if r.get("prox_abs_diff_mean") is not None]
    t = _trend(drift)
    if not rows or t is None or t[1] <= 0 or t[2] / t[1] >= SYNC_DRIFT_RATIO:
        return []
    base: dict[int, float] = {}
    for lag in {r["lag"] for r in rows}:
        base[lag] = statistics.median(r["abs_diff_mean"] for r in rows if r["lag"] == lag)
    out = []
    for step in sorted({r["step"] for r in rows}):
        xs = [r["seq_max"] - base[r["lag"]] for r in rows if r["step"] == step and r.get("seq_max") is not None]
        if xs:
            out.append((step, max(xs), 1.0))
    return out


def _median_drift(f: Mapping[str, Any]) -> float:
    """The median over steps of mean |new − prox| (the policy's change over one version)."""
    values = [r["prox_abs_diff_mean"] for r in f.get("diag/by_step") or [] if r.get("prox_abs_diff_mean") is not None]
    return statistics.median(values) if values else math.inf


def _weight_sync(c: _Ctx) -> list[Finding]:
    f = c.fig
    notes: list[str] = []
    candidates = [
        ("lag0_seq_max", _series(f, c.steps, "lag0_seq_max", None)),
        ("lag0_abs_diff_mean", _series(f, c.steps, "lag0_abs_diff_mean", "by_staleness/lag0")),
    ]
    excess = _lag_excess(f)
    if excess:
        candidates.append(("lag_excess", excess))
    if not any(s for _, s in candidates):
        candidates = [("abs_diff_mean", _series(f, c.steps, "abs_diff_mean", "kl/abs_diff_mean"))]
        notes.append("no versions: the disagreement could not be restricted to lag 0")
    best: tuple[str, str, float, float, float, list[tuple[int, float, float]]] | None = None
    for key, series in candidates:
        t = _trend(series)
        if t is None:
            continue
        rho, start, end = t
        # The worst sequence of a step is a maximum, noisier than a mean: its rise must clear more.
        min_rise = SYNC_MIN_RISE if key == "lag0_abs_diff_mean" else SYNC_MIN_SEQ_RISE
        if rho < SYNC_RANK_CORR or end - start < min_rise:
            continue
        if key == "lag_excess" and end - start < _median_drift(f):
            continue  # within what one version of the policy's own change explains
        # A rise from the bf16 floor can fit a line that starts below 0: measure it from the smallest observed value.
        floor = min((v for _, v, _ in series if v > 0), default=0.0)
        if max(start, floor) <= 0:
            continue
        ratio = end / max(start, floor)
        sev = _grade(ratio, SYNC_RATIO_WARNING, SYNC_RATIO_ERROR)
        if sev is not None and (best is None or ratio > best[3]):
            best = (key, sev, rho, ratio, end - start, series)
    if best is None:
        return []
    key, sev, rho, ratio, rise, series = best
    lag_series = _series(f, c.steps, "lag_mean", "staleness/theta_mean")
    lt = _trend(lag_series)
    if not key.startswith("lag0") and lt is not None and lt[2] - lt[1] > SYNC_LAG_DRIFT:
        # A rising lag explains a rising all-lag disagreement; the lag-0 series holds no staleness by construction.
        sev = _cap(sev, notes, f"the recorded lag rises too ({lt[1]:.2f} → {lt[2]:.2f}): this may be staleness")
    if key == "abs_diff_mean":
        sev = _cap(sev, notes, "lag unknown")
    first, last = series[0][1], series[-1][1]
    title = RULES["GRP201"].title.format(series=key, first=first, last=last, ratio=ratio)
    ev = {
        f"diag/by_step[{key}] fitted last/first": _ev(ratio, SYNC_RATIO_WARNING),
        f"diag/by_step[{key}] fitted rise": _ev(rise, SYNC_MIN_RISE),
        f"diag/by_step[{key}] rank correlation with step": _ev(rho, SYNC_RANK_CORR),
    }
    fix = RULES["GRP201"].fix
    worst = sorted(series, key=lambda x: -x[1])[:5]
    where = {"steps": [s for s, _, _ in worst], "sequences": _sequences(f.get("diag/lag0_top"))}
    return [Finding("GRP201", "weight-sync", sev, title, ev, where, fix, notes)]


def _mismatch(c: _Ctx) -> list[Finding]:
    f = c.fig
    mult = _estimate(f, "diag/pair_mult_prob_error")
    if mult is None:
        return []
    sev = _judge(mult, MULT_ERROR_WARNING, MULT_ERROR_ERROR)
    ev = {"diag/pair_mult_prob_error": mult.ev(MULT_ERROR_WARNING)}
    big, n_seq0 = _num(f, "diag/lag0_big_seq_frac"), int(_num(f, "diag/lag0_n_seq") or 0)
    if big is not None and n_seq0:
        # One broken worker among healthy ones barely moves the mean; the share of lag-0 sequences far off shows it.
        big_est = _wilson(round(big * n_seq0), n_seq0)
        ev["diag/lag0_big_seq_frac"] = big_est.ev(BIG_SEQ_WARNING)
        sev = _max_sev(sev, _judge(big_est, BIG_SEQ_WARNING))
    if sev is None:
        return []
    notes: list[str] = []
    if f.get("diag/pair_scope") == "all tokens":
        sev = _cap(sev, notes, "no versions: staleness cannot be separated from numerics")
    else:
        notes += _settle_notes(sev, mult, MULT_ERROR_WARNING, _num(f, "diag/pair_n_tokens"), "tokens")
    title = RULES["GRP202"].title.format(error=mult.value, frac=big or 0.0, scope=f.get("diag/pair_scope") or "lag 0")
    return [Finding("GRP202", "mismatch", sev, title, ev, {"sequences": _sequences(f.get("diag/lag0_top"))},
                    RULES["GRP202"].fix, notes)]


def _importance(c: _Ctx) -> list[Finding]:
    f = c.fig
    tail = _estimate(f, "diag/pair_tail_frac")
    if tail is None:
        return []
    sev = _judge(tail, TAIL_WARNING, TAIL_ERROR)
    if sev is None:
        return []
    notes = _settle_notes(sev, tail, TAIL_WARNING, _num(f, "diag/pair_n_tokens"), "tokens")
    ev = {"diag/pair_tail_frac": tail.ev(TAIL_WARNING)}
    ess = _num(f, "is/ess")
    if ess is not None:
        ev["is/ess"] = _ev(ess, None)
    title = RULES["GRP203"].title.format(frac=tail.value, scope=f.get("diag/pair_scope") or "lag 0",
                                        partner=f.get("diag/pair_partner") or "new_logp")
    tokens = [{"file": t.get("file"), "row": t.get("row"), "position": t.get("position"), "ratio": t.get("ratio")}
              for t in (f.get("top_kl") or [])[:5]]
    return [Finding("GRP203", "importance-weights", sev, title, ev, {"tokens": tokens}, RULES["GRP203"].fix, notes)]


def _prox_recompute(c: _Ctx) -> list[Finding]:
    f = c.fig
    frac = _estimate(f, "diag/prox_equal_old_seq_frac")
    if frac is None or frac.value == 0:
        return []
    sev = _judge(frac, PROX_EQUAL_WARNING, PROX_EQUAL_ERROR) or "info"
    notes = _settle_notes(sev, frac, PROX_EQUAL_WARNING, _num(f, "diag/prox_equal_old_n_stale"), "stale sequences")
    title = RULES["GRP207"].title.format(frac=frac.value)
    ev = {"diag/prox_equal_old_seq_frac": frac.ev(PROX_EQUAL_WARNING),
          "diag/prox_equal_old_n_stale": _ev(int(_num(f, "diag/prox_equal_old_n_stale") or 0), None)}
    return [Finding("GRP207", "prox-approximation", sev, title, ev, {}, RULES["GRP207"].fix, notes)]


def _lag_hist(f: Mapping[str, Any]) -> list[tuple[int, int]]:
    rows = f.get("staleness/hist")
    if rows:
        return [(int(r["lag"]), int(r["n_tokens"])) for r in rows if r.get("lag", -1) >= 0]
    return [(int(r["lag"]), int(r["n_tokens"])) for r in f.get("diag/by_lag") or []]


def _staleness(c: _Ctx) -> list[Finding]:
    f = c.fig
    hist = _lag_hist(f)
    total_n = sum(n for _, n in hist)
    if not total_n:
        return []
    limit = c.cfg.max_staleness
    beyond = sum(n for k, n in hist if k > limit)
    frac = beyond / total_n
    sev = _grade(frac, STALE_WARNING, STALE_ERROR)
    if sev is None:
        return [] if beyond == 0 else [Finding(
            "GRP204", "staleness", "info", RULES["GRP204"].variants["below"].format(frac=frac, limit=limit),
            {"lag beyond max_staleness frac": _ev(frac, STALE_WARNING)}, {}, RULES["GRP204"].fix)]
    lag_max = max(k for k, _ in hist)
    title = RULES["GRP204"].title.format(frac=frac, limit=limit, lag_max=lag_max)
    rows = [r for r in (f.get("by_staleness") or []) if r.get("lag", -1) > limit][:5]
    fix = RULES["GRP204"].fix
    return [Finding("GRP204", "staleness", sev, title,
                    {"lag beyond max_staleness frac": _ev(frac, STALE_WARNING, max_staleness=limit),
                     "staleness/theta_max": _ev(lag_max, limit)},
                    {"lags": [r.get("lag") for r in rows] or [k for k, _ in hist if k > limit][:5]}, fix)]


def _prox(c: _Ctx) -> list[Finding]:
    f = c.fig
    safe = _num(f, "diag/prox_loglinear_safe_lag")
    beyond = _num(f, "diag/prox_beyond_safe_frac")
    lag_max = _num(f, "diag/lag_max") or _num(f, "staleness/theta_max")
    if safe is None or beyond is None or beyond < PROX_BEYOND_WARNING:
        return []
    used = c.cfg.prox_approximation
    notes: list[str] = []
    if used in ("loglinear", "linear"):
        sev = "warning"
    elif lag_max is not None and lag_max >= PROX_INFO_LAG:
        sev = "info"
        notes.append("the run was not declared to use an approximation (DetectConfig.prox_approximation)")
    else:
        return []
    title = RULES["GRP205"].title.format(frac=beyond, safe_lag=int(safe), lag_max=int(lag_max or 0))
    rows = [r for r in f.get("diag/by_lag") or [] if r.get("lag", 0) > safe][:5]
    fix = RULES["GRP205"].fix
    return [Finding("GRP205", "prox-approximation", sev, title,
                    {"diag/prox_beyond_safe_frac": _ev(beyond, PROX_BEYOND_WARNING),
                     "diag/prox_loglinear_safe_lag": _ev(int(safe), None)},
                    {"lags": [{"lag": r["lag"], "error": r.get("prox_loglinear_error")} for r in rows]}, fix, notes)]


def _clipping(c: _Ctx) -> list[Finding]:
    f = c.fig
    overall = _num(f, "clip/ratio")
    series = _series(f, c.steps, "clip_frac", "clip/ratio")
    worst = max(series, key=lambda x: x[1]) if series else None
    # Fractions of tokens with Wilson intervals: one step of 288 tokens at 0.205 is not yet past 0.2.
    n_tokens = c.n_tokens or 0
    estimates: list[tuple[str, Estimate, int | None]] = []
    if overall is not None:
        estimates.append(("clip/ratio", _wilson(round(overall * n_tokens), int(n_tokens)), None))
    if worst:
        estimates.append(("max over steps of clip fraction", _wilson(round(worst[1] * worst[2]), int(worst[2])),
                          worst[0]))
    if not estimates:
        return []
    sev = None
    for _, est, _ in estimates:
        sev = _max_sev(sev, _judge(est, CLIP_WARNING, CLIP_ERROR))
    if sev is None:
        return []
    value = max(est.value for _, est, _ in estimates)
    title = RULES["GRP206"].title.format(value=value, overall=value if overall is None else overall)
    ev = {key: est.ev(CLIP_WARNING, **({"step": step} if step is not None else {})) for key, est, step in estimates}
    notes = _settle_notes(sev, max((e for _, e, _ in estimates), key=lambda e: e.value), CLIP_WARNING, None, "tokens")
    steps = sorted(series, key=lambda x: -x[1])[:5]
    return [Finding("GRP206", "clipping", sev, title, ev, {"steps": [s for s, v, _ in steps if v >= CLIP_WARNING]},
                    RULES["GRP206"].fix, notes)]


DETECTORS = (
    Detector(_weight_sync, ("GRP201",), groups=("diag/by_step", "diag/lags"),
             keys=("by_staleness", "kl/abs_diff_mean", "staleness/theta_mean")),
    Detector(_mismatch, ("GRP202",), groups=("diag/pairs", "diag/lags")),
    Detector(_importance, ("GRP203",), groups=("diag/pairs",), keys=("is/ess", "top_kl")),
    Detector(_staleness, ("GRP204",), groups=("diag/lags",), keys=("staleness/hist", "by_staleness")),
    Detector(_prox, ("GRP205",), groups=("diag/lags",), keys=("staleness/theta_max",)),
    Detector(_clipping, ("GRP206",), groups=("diag/by_step",), keys=("clip/ratio",)),
    Detector(_prox_recompute, ("GRP207",), groups=("diag/pairs",)),
)
"""The GRP2xx detectors, in the order :func:`~grpo_cli.findings.detect.detect` runs them."""
