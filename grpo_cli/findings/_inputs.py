"""GRP1xx: how the dump was written — alignment, temperature, truncated sampling, the loss mask, the reference
policy, duplicated sequences."""

from __future__ import annotations

import math
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
    _graded_fraction,
    _judge,
    _max_sev,
    _num,
    _sequences,
    _settle_notes,
)
from grpo_cli.findings.catalog import RULES
from grpo_cli.findings.thresholds import (
    DUP_CONTENT_WARNING,
    DUP_ID_ERROR,
    HOLE_INFO,
    MASK_FRAC_ERROR,
    MASK_FRAC_WARNING,
    MASK_SEQ_WARNING,
    ONESIDED_ERROR,
    ONESIDED_WARNING,
    REF_EQUAL_ERROR,
    REF_EQUAL_WARNING,
    REF_ZERO_ERROR,
    RETOK_ERROR,
    RETOK_WARNING,
    SHIFT_SEQ_ERROR,
    SHIFT_SEQ_WARNING,
    TEMPERATURE_ERROR,
    TEMPERATURE_WARNING,
)


def _alignment(c: _Ctx) -> list[Finding]:
    f = c.fig
    late, early = _num(f, "diag/shift_seq_late_frac"), _num(f, "diag/shift_seq_early_frac")
    n_seq = _num(f, "diag/shift_n_seq")
    if late is None or early is None or not n_seq:
        return []
    frac, side = (late, 1) if late >= early else (early, -1)
    flagged = round(frac * n_seq)
    if flagged == 0:
        return []
    sev, notes, est = _graded_fraction(frac, n_seq, SHIFT_SEQ_WARNING, SHIFT_SEQ_ERROR, "sequences")
    word = "late" if side > 0 else "early"
    title = RULES["GRP101"].title.format(side=word, frac=frac)
    ev = {
        f"diag/shift_seq_{word}_frac": est.ev(SHIFT_SEQ_WARNING),
        "diag/shift_abs_diff_0": _ev(_num(f, "diag/shift_abs_diff_0"), None),
        f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}": _ev(
            _num(f, f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}"), None
        ),
    }
    fix = RULES["GRP101"].fix
    return [Finding("GRP101", "alignment", sev, title, ev, {"sequences": _sequences(f.get("diag/shift_top"))},
                    fix, notes)]


def _tilt_holds(f: Mapping[str, Any]) -> tuple[Estimate, Estimate] | None:
    """The two one-sided slopes when both lie conclusively on the same side of 1 (a real tilt), else ``None``:
    independent noise in either column pulls them to opposite sides (errors in variables)."""
    b1 = _estimate(f, "diag/pair_slope_old_on_new")
    b2 = _estimate(f, "diag/pair_slope_new_on_old_inverse")
    if b1 is None or b2 is None:
        return None
    if (b1.low > 1 and b2.low > 1) or (b1.high < 1 and b2.high < 1):
        return b1, b2
    return None


def _temperature(c: _Ctx) -> list[Finding]:
    f = c.fig
    ratio = _estimate(f, "diag/temperature_ratio")
    slopes = _tilt_holds(f)
    if ratio is None or slopes is None or ratio.value <= 0 or ratio.low <= 0:
        return []
    # Graded on |ln r|, so a colder and a hotter engine of the same factor weigh the same.
    logs = sorted((abs(math.log(ratio.low)), abs(math.log(ratio.high))))
    dev = Estimate(abs(math.log(ratio.value)), 0.0 if ratio.low <= 1 <= ratio.high else logs[0], logs[1])
    sev = _judge(dev, math.log1p(TEMPERATURE_WARNING), math.log1p(TEMPERATURE_ERROR))
    if sev is None:
        return []
    notes = _settle_notes(sev, dev, math.log1p(TEMPERATURE_WARNING), _num(f, "diag/pair_n_tokens"), "tokens")
    partner = f.get("diag/pair_partner") or "new_logp"
    title = RULES["GRP102"].title.format(ratio=ratio.value, low=ratio.low, high=ratio.high, partner=partner,
                                        scope=f.get("diag/pair_scope") or "lag 0")
    ev = {
        "diag/temperature_ratio": ratio.ev(f"outside [1/{1 + TEMPERATURE_WARNING:g}, {1 + TEMPERATURE_WARNING:g}]"),
        "diag/pair_slope_old_on_new": slopes[0].ev(1.0),
        "diag/pair_slope_new_on_old_inverse": slopes[1].ev(1.0),
    }
    for key in ("diag/pair_d_likely", "diag/pair_d_unlikely"):
        est = _estimate(f, key)
        if est is not None:
            ev[key] = est.ev(None)
    return [Finding("GRP102", "temperature", sev, title, ev, {}, RULES["GRP102"].fix, notes)]


def _truncated(c: _Ctx) -> list[Finding]:
    f = c.fig
    onesided = _estimate(f, "diag/pair_onesided")
    lik, unl = _estimate(f, "diag/pair_d_likely"), _estimate(f, "diag/pair_d_unlikely")
    if onesided is None or lik is None:
        return []
    if lik.value <= 0 or (unl is not None and unl.value <= 0):
        return []  # a lift on every token, not a tilt
    sev = _judge(onesided, ONESIDED_WARNING, ONESIDED_ERROR)
    if sev is None:
        return []
    notes = _settle_notes(sev, onesided, ONESIDED_WARNING, _num(f, "diag/pair_n_tokens"), "tokens")
    title = RULES["GRP103"].title.format(frac=onesided.value, shift=lik.value, scope=f.get("diag/pair_scope") or "")
    ev = {"diag/pair_onesided": onesided.ev(ONESIDED_WARNING), "diag/pair_d_likely": lik.ev(0.0)}
    if unl is not None:
        ev["diag/pair_d_unlikely"] = unl.ev(0.0)
    return [Finding("GRP103", "truncated-sampling", sev, title, ev, {}, RULES["GRP103"].fix, notes)]


def _retokenization(c: _Ctx) -> list[Finding]:
    f = c.fig
    frac = _estimate(f, "diag/retok_seq_frac")
    n = _num(f, "diag/retok_n_seq")
    if frac is None or not n:
        return []
    sev = _judge(frac, RETOK_WARNING, RETOK_ERROR) or "info"
    notes = _settle_notes(sev, frac, RETOK_WARNING, c.n_sequences, "sequences")
    title = RULES["GRP108"].title.format(frac=frac.value, n=int(n), tokens=int(_num(f, "diag/retok_n_tokens") or 0))
    ev = {"diag/retok_seq_frac": frac.ev(RETOK_WARNING),
          "diag/retok_n_tokens": _ev(int(_num(f, "diag/retok_n_tokens") or 0), None)}
    return [Finding("GRP108", "retokenization", sev, title, ev, {"sequences": _sequences(f.get("diag/retok_top"))},
                    RULES["GRP108"].fix, notes)]


def _mask(c: _Ctx) -> list[Finding]:
    f = c.fig
    out: list[Finding] = []
    ev: dict[str, dict[str, Any]] = {}
    sev: str | None = None
    what = []
    for key, label in (
        ("diag/prompt_in_loss_frac", "prompt tokens (version −1)"),
        ("diag/old_zero_new_nonzero_frac", "tokens where the engine log-prob is exactly 0"),
    ):
        v = _num(f, key)
        if v is not None and v > 0:
            ev[key] = _ev(v, MASK_FRAC_WARNING)
            g = _grade(v, MASK_FRAC_WARNING, MASK_FRAC_ERROR)
            if g:
                what.append(f"{v:.1%} {label}")
            sev = _max_sev(sev, g or "info")
    trailing = _num(f, "diag/trailing_zero_seq_frac")
    if trailing is not None and trailing > 0:
        ev["diag/trailing_zero_seq_frac"] = _ev(trailing, MASK_SEQ_WARNING)
        g = _grade(trailing, MASK_SEQ_WARNING, MASK_FRAC_ERROR * 4)
        if g:
            what.append(f"{trailing:.1%} of sequences ending in a run of exact-zero log-probs (padding)")
        sev = _max_sev(sev, g or "info")
    if sev is not None:
        title = RULES["GRP104"].title.format(what="; ".join(what) or "a few tokens")
        fix = RULES["GRP104"].fix
        out.append(Finding("GRP104", "mask", sev, title, ev, {"sequences": _sequences(f.get("diag/mask_top"))},
                           fix))
    ev2: dict[str, dict[str, Any]] = {}
    missing = _num(f, "diag/generated_masked_frac")
    holes = _num(f, "diag/mask_hole_frac")
    sev2: str | None = None
    notes: list[str] = []
    if missing is not None and missing > 0:
        ev2["diag/generated_masked_frac"] = _ev(missing, MASK_FRAC_WARNING)
        sev2 = _grade(missing, MASK_FRAC_WARNING, MASK_FRAC_ERROR) or "info"
    elif missing is None and holes is not None and holes >= HOLE_INFO:
        ev2["diag/mask_hole_frac"] = _ev(holes, HOLE_INFO)
        sev2 = "info"
        notes.append("without versions, masked tokens inside a response may be tool output (multi-turn)")
    if sev2 is not None:
        frac = missing if missing is not None else holes
        title = RULES["GRP105"].title.format(frac=frac)
        fix = RULES["GRP105"].fix
        out.append(Finding("GRP105", "mask", sev2, title, ev2, {"sequences": _sequences(f.get("diag/mask_top"))},
                           fix, notes))
    return out




def _later_steps_equal(f: Mapping[str, Any]) -> tuple[dict[str, float], list[int]] | None:
    """Per column, the fraction of valid tokens whose ``ref_logp`` equals it bitwise over the later half of the
    steps (a reference that is the initial policy equals the policy in the first steps only), and those steps."""
    rows = [r for r in f.get("diag/by_step") or [] if r.get("n_ref")]
    if not rows:
        return None
    # The later half, and never the first two steps of the dump: the proximal policy is one version behind the
    # policy, so it still is the initial weights at step 1.
    later = [r for r in rows[len(rows) // 2:] if r["step"] >= rows[0]["step"] + 2]
    if not later:
        return {}, []
    n = sum(r["n_ref"] for r in later)
    return {other: sum(r.get(f"ref_equal_{other}", 0) for r in later) / n for other in ("new", "old", "prox")}, [
        r["step"] for r in later]


def _reference(c: _Ctx) -> list[Finding]:
    f = c.fig
    ev: dict[str, dict[str, Any]] = {}
    sev: str | None = None
    worst = ("", 0.0)
    later = _later_steps_equal(f)
    fractions = later[0] if later else {o: _num(f, f"diag/equal_frac/{o}_ref") for o in ("new", "old", "prox")}
    for other, v in fractions.items():
        if v is None or v < REF_EQUAL_WARNING:
            continue
        key = f"diag/by_step[ref_equal_{other}] later half" if later else f"diag/equal_frac/{other}_ref"
        ev[key] = _ev(v, REF_EQUAL_WARNING)
        sev = _max_sev(sev, _grade(v, REF_EQUAL_WARNING, REF_EQUAL_ERROR))
        if v > worst[1]:
            worst = (other, v)
    zero = _num(f, "diag/zero_frac/ref_logp")
    if zero is not None and zero >= REF_ZERO_ERROR:
        ev["diag/zero_frac/ref_logp"] = _ev(zero, REF_ZERO_ERROR)
        sev = "error"
    if sev is None:
        return []
    notes: list[str] = []
    steps = [r["step"] for r in f.get("diag/by_step") or []]
    if worst[0] in ("new", "prox") and steps and max(steps) <= 1:
        sev = _cap(sev, notes, "the dump holds only the first steps, where the policy still equals the reference")
    if worst[0]:
        title = RULES["GRP106"].title.format(other=worst[0], frac=worst[1],
                                            steps="the later steps" if later else "all steps")
    else:
        title = RULES["GRP106"].variants["zero"].format(frac=zero)
    return [Finding("GRP106", "reference", sev, title, ev, {"steps": later[1] if later else []},
                    RULES["GRP106"].fix, notes)]


def _duplicates(c: _Ctx) -> list[Finding]:
    f = c.fig
    id_frac, id_extra = _num(f, "diag/dup_id_frac"), _num(f, "diag/dup_id_extra")
    content = _num(f, "diag/dup_content_frac")
    where = {"sequences": f.get("diag/dup_where") or []}
    fix = RULES["GRP107"].fix
    if id_extra:
        sev = "error" if (id_frac or 0) >= DUP_ID_ERROR else "warning"
        title = RULES["GRP107"].title.format(n=int(id_extra), frac=id_frac)
        return [Finding("GRP107", "duplicates", sev, title,
                        {"diag/dup_id_extra": _ev(int(id_extra), 1), "diag/dup_id_frac": _ev(id_frac, DUP_ID_ERROR)},
                        where, fix)]
    if content is not None and content >= DUP_CONTENT_WARNING:
        sev = "warning" if id_frac is None else "info"
        notes = [] if id_frac is None else ["every copy has its own seq_id: identical samples of one prompt"]
        title = RULES["GRP107"].variants["content"].format(frac=content)
        return [Finding("GRP107", "duplicates", sev, title,
                        {"diag/dup_content_frac": _ev(content, DUP_CONTENT_WARNING)}, where, fix, notes)]
    return []


DETECTORS = (
    Detector(_alignment, ("GRP101",), groups=("diag/shift",)),
    Detector(_mask, ("GRP104", "GRP105"), groups=("diag/zeros",)),
    Detector(_reference, ("GRP106",), groups=("diag/equality", "diag/zeros", "diag/by_step")),
    Detector(_duplicates, ("GRP107",), groups=("diag/duplicates",)),
    Detector(_retokenization, ("GRP108",), groups=("diag/pairs",)),
    Detector(_truncated, ("GRP103",), groups=("diag/pairs",)),
    Detector(_temperature, ("GRP102",), groups=("diag/pairs",)),
)
"""The GRP1xx detectors, in the order :func:`~grpo_cli.findings.detect.detect` runs them."""
