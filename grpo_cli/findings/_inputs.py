"""GRP1xx: how the dump was written — alignment, temperature, truncated sampling, the loss mask, the reference
policy, duplicated sequences."""

from __future__ import annotations

from typing import Any

from grpo_cli.findings._base import (
    Detector,
    Finding,
    _cap,
    _Ctx,
    _ev,
    _few,
    _grade,
    _max_sev,
    _num,
    _sequences,
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
    ONESIDED_MIN_SHIFT,
    ONESIDED_WARNING,
    REF_EQUAL_ERROR,
    REF_EQUAL_WARNING,
    REF_ZERO_ERROR,
    SHIFT_SEQ_ERROR,
    SHIFT_SEQ_WARNING,
    SLOPE_ERROR,
    SLOPE_MIN_LAG0,
    SLOPE_WARNING,
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
    sev, notes = _few(_grade(frac, SHIFT_SEQ_WARNING, SHIFT_SEQ_ERROR), flagged, "sequences prefer the shift")
    word = "late" if side > 0 else "early"
    title = f"old_logp looks one token {word} against new_logp in {frac:.1%} of sequences"
    ev = {
        f"diag/shift_seq_{word}_frac": _ev(frac, SHIFT_SEQ_WARNING),
        "diag/shift_abs_diff_0": _ev(_num(f, "diag/shift_abs_diff_0"), None),
        f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}": _ev(
            _num(f, f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}"), None
        ),
    }
    fix = RULES["GRP101"].fix
    return [Finding("GRP101", "alignment", sev, title, ev, {"sequences": _sequences(f.get("diag/shift_top"))},
                    fix, notes)]


def _temperature(c: _Ctx) -> list[Finding]:
    f = c.fig
    key = "diag/old_vs_new_slope"
    if _num(f, "diag/lag0_old_vs_new_slope") is not None and (_num(f, "diag/lag0_n_tokens") or 0) >= SLOPE_MIN_LAG0:
        key = "diag/lag0_old_vs_new_slope"
    b = _num(f, key)
    if b is None:
        return []
    dev = abs(b - 1.0)
    sev = _grade(dev, SLOPE_WARNING, SLOPE_ERROR)
    if sev is None:
        return []
    t_ratio = b  # old ≈ new / T_b·T_train to first order: b ≈ T_train / T_behaviour
    title = (
        f"old_logp is tilted against new_logp (slope {b:.2f}): behaviour and training log-probs look computed at "
        f"different temperatures (ratio ≈ {t_ratio:.2f})"
    )
    ev = {
        key: _ev(b, f"|b − 1| ≥ {SLOPE_WARNING}"),
        "diag/old_vs_new_intercept": _ev(_num(f, "diag/old_vs_new_intercept"), None),
        "diag/old_gt_new_frac": _ev(_num(f, "diag/old_gt_new_frac"), None),
    }
    fix = RULES["GRP102"].fix
    return [Finding("GRP102", "temperature", sev, title, ev,
                    {"sequences": _sequences(f.get("diag/old_minus_new_top"))}, fix)]


def _truncated(c: _Ctx) -> list[Finding]:
    f = c.fig
    frac = _num(f, "diag/onesided_seq_frac")
    shift = _num(f, "diag/seq_old_minus_new_mean")
    ci = _num(f, "diag/seq_old_minus_new_ci")
    if frac is None or shift is None:
        return []
    sev = _grade(frac, ONESIDED_WARNING, ONESIDED_ERROR)
    if sev is None or shift < ONESIDED_MIN_SHIFT:
        return []
    notes: list[str] = []
    if ci is not None and shift - ci < ONESIDED_MIN_SHIFT:
        sev = _cap(sev, notes, f"the mean shift's 95 % interval ({shift:.3f} ± {ci:.3f}) reaches {ONESIDED_MIN_SHIFT}")
    b = _num(f, "diag/old_vs_new_slope")
    if b is not None and abs(b - 1.0) >= SLOPE_WARNING:
        notes.append("the old-vs-new slope is tilted too (GRP102); a temperature mismatch also lifts confident "
                     "tokens, so read this with GRP102")
    title = (
        f"old_logp sits above new_logp on nearly every token in {frac:.0%} of sequences (mean +{shift:.3f} nats): "
        "behaviour log-probs look renormalised over a top-p/top-k set"
    )
    ev = {
        "diag/onesided_seq_frac": _ev(frac, ONESIDED_WARNING),
        "diag/seq_old_minus_new_mean": _ev(shift, ONESIDED_MIN_SHIFT, ci=ci),
        "diag/old_gt_new_frac": _ev(_num(f, "diag/old_gt_new_frac"), None),
    }
    fix = RULES["GRP103"].fix
    return [Finding("GRP103", "truncated-sampling", sev, title, ev,
                    {"sequences": _sequences(f.get("diag/old_minus_new_top"))}, fix, notes)]


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
        title = "loss_mask covers prompt or padding tokens: " + ("; ".join(what) or "a few tokens")
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
        title = f"loss_mask misses response tokens: {frac:.1%} of generated tokens are outside the loss"
        fix = RULES["GRP105"].fix
        out.append(Finding("GRP105", "mask", sev2, title, ev2, {"sequences": _sequences(f.get("diag/mask_top"))},
                           fix, notes))
    return out




def _reference(c: _Ctx) -> list[Finding]:
    f = c.fig
    ev: dict[str, dict[str, Any]] = {}
    sev: str | None = None
    worst = ("", 0.0)
    for other in ("new", "old", "prox"):
        key = f"diag/equal_frac/{other}_ref"
        v = _num(f, key)
        if v is None or v < REF_EQUAL_WARNING:
            continue
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
    if worst[0] == "new" and steps and max(steps) == 0:
        sev = _cap(sev, notes, "the dump holds step 0 only, where the policy still equals the reference")
    if worst[0]:
        title = f"ref_logp equals {worst[0]}_logp bitwise on {worst[1]:.0%} of tokens: it is not a reference policy"
    else:
        title = f"ref_logp is exactly 0 on {zero:.0%} of tokens: no reference model was run"
    fix = RULES["GRP106"].fix
    return [Finding("GRP106", "reference", sev, title, ev, {}, fix, notes)]


def _duplicates(c: _Ctx) -> list[Finding]:
    f = c.fig
    id_frac, id_extra = _num(f, "diag/dup_id_frac"), _num(f, "diag/dup_id_extra")
    content = _num(f, "diag/dup_content_frac")
    where = {"sequences": f.get("diag/dup_where") or []}
    fix = RULES["GRP107"].fix
    if id_extra:
        sev = "error" if (id_frac or 0) >= DUP_ID_ERROR else "warning"
        title = f"{int(id_extra)} sequences repeat a (step, seq_id) already seen ({id_frac:.1%} of sequences)"
        return [Finding("GRP107", "duplicates", sev, title,
                        {"diag/dup_id_extra": _ev(int(id_extra), 1), "diag/dup_id_frac": _ev(id_frac, DUP_ID_ERROR)},
                        where, fix)]
    if content is not None and content >= DUP_CONTENT_WARNING:
        sev = "warning" if id_frac is None else "info"
        notes = [] if id_frac is None else ["every copy has its own seq_id: identical samples of one prompt"]
        title = f"{content:.1%} of sequences repeat another sequence's log-probs exactly"
        return [Finding("GRP107", "duplicates", sev, title,
                        {"diag/dup_content_frac": _ev(content, DUP_CONTENT_WARNING)}, where, fix, notes)]
    return []


DETECTORS = (
    Detector(_alignment, ("GRP101",), groups=("diag/shift",)),
    Detector(_mask, ("GRP104", "GRP105"), groups=("diag/zeros",)),
    Detector(_reference, ("GRP106",), groups=("diag/equality", "diag/zeros", "diag/by_step")),
    Detector(_duplicates, ("GRP107",), groups=("diag/duplicates",)),
    Detector(_temperature, ("GRP102",), groups=("diag/relation", "diag/lags")),
    Detector(_truncated, ("GRP103",), groups=("diag/relation",)),
)
"""The GRP1xx detectors, in the order :func:`~grpo_cli.findings.detect.detect` runs them."""
