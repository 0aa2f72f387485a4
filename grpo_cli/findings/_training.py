"""GRP3xx/GRP4xx: the learning signal and its course — advantages against rewards, groups without reward variance,
entropy collapse, length truncation."""

from __future__ import annotations

import math

from grpo_cli._intervals import jackknife_interval
from grpo_cli.findings._base import (
    Detector,
    Estimate,
    Finding,
    _cap,
    _Ctx,
    _ev,
    _grade,
    _graded_fraction,
    _halves,
    _judge,
    _num,
    _series,
    _settle_notes,
)
from grpo_cli.findings.catalog import RULES
from grpo_cli.findings.thresholds import (
    ENTROPY_RATIO_ERROR,
    ENTROPY_RATIO_WARNING,
    NO_EOS_ERROR,
    NO_EOS_INFO,
    NO_EOS_WARNING,
    REWARD_RISE,
    SCALE_WARNING,
    SIGN_WARNING,
    UNCENTRED_WARNING,
    ZERO_STD_ERROR,
    ZERO_STD_INFO,
    ZERO_STD_WARNING,
)


def _advantage(c: _Ctx) -> list[Finding]:
    f = c.fig
    out: list[Finding] = []
    groups = _num(f, "diag/groups_spread_n") or 0
    n_groups = _num(f, "diag/groups_n") or 0
    where_all = f.get("diag/adv_where") or []
    flip = _num(f, "diag/adv_sign_flip_frac")
    if flip:
        sev, notes, est = _graded_fraction(flip, groups, SIGN_WARNING, 2 * SIGN_WARNING, "groups")
        out.append(Finding(
            "GRP301", "advantage", sev,
            RULES["GRP301"].title.format(frac=flip),
            {"diag/adv_sign_flip_frac": est.ev(SIGN_WARNING)},
            {"groups": [w for w in where_all if w["problem"] == "sign"]},
            RULES["GRP301"].fix, notes))
    unc = _num(f, "diag/adv_uncentred_frac")
    if unc:
        judged = _num(f, "diag/adv_centring_n") or n_groups
        sev, notes, est = _graded_fraction(unc, judged, UNCENTRED_WARNING, None, "groups")
        out.append(Finding(
            "GRP302", "advantage", sev,
            RULES["GRP302"].title.format(frac=unc),
            {"diag/adv_uncentred_frac": est.ev(UNCENTRED_WARNING)},
            {"groups": [w for w in where_all if w["problem"] == "uncentred"]},
            RULES["GRP302"].fix, notes))
    out_frac = _num(f, "diag/adv_scale_outlier_frac")
    if out_frac:
        sev, notes, est = _graded_fraction(out_frac, groups, SCALE_WARNING, None, "groups")
        out.append(Finding(
            "GRP303", "advantage", sev,
            RULES["GRP303"].title.format(frac=out_frac, exponent=_num(f, "diag/adv_scale_exponent") or math.nan),
            {"diag/adv_scale_outlier_frac": est.ev(SCALE_WARNING),
             "diag/adv_scale_exponent": _ev(_num(f, "diag/adv_scale_exponent"), "−1 or 0")},
            {}, RULES["GRP303"].fix, notes))
    return out


def _no_signal(c: _Ctx) -> list[Finding]:
    f = c.fig
    z = _num(f, "groups/zero_std_frac")
    if z is None or z < ZERO_STD_INFO:
        return []
    n_groups = _num(f, "diag/groups_n")
    if n_groups:  # the run's rate, estimated from this dump's groups
        sev, notes, est = _graded_fraction(z, n_groups, ZERO_STD_WARNING, ZERO_STD_ERROR, "groups")
    else:
        sev, notes, est = _grade(z, ZERO_STD_WARNING, ZERO_STD_ERROR) or "info", [], Estimate(z, z, z)
    return [Finding("GRP304", "no-signal", sev, RULES["GRP304"].title.format(frac=z),
                    {"groups/zero_std_frac": est.ev(ZERO_STD_WARNING)}, {}, RULES["GRP304"].fix, notes)]


def _entropy_ratio(series: list[tuple[int, float, float]]) -> Estimate:
    """The lower of the last quarter's mean entropy and the last step's, over the first quarter's mean, with a
    delete-one-step jackknife interval over the steps that enter it (a fall in the final steps counts before it
    fills a quarter of the run; with 8 steps, one noisy step should not make a collapse)."""
    k = max(1, len(series) // 4)

    def stat(kept: list[tuple[int, float, float]]) -> float:
        head, tail = kept[:k], kept[-k:]
        first = sum(v * w for _, v, w in head) / sum(w for _, _, w in head)
        last = sum(v * w for _, v, w in tail) / sum(w for _, _, w in tail)
        return min(last, kept[-1][1]) / first if first > 0 else math.nan

    value = stat(series)
    used = [i for i in range(len(series)) if i < k or i >= len(series) - k]
    loo = [stat(series[:i] + series[i + 1:]) for i in used if len(series) > 2 * k]
    return Estimate(value, *jackknife_interval(value, [v for v in loo if math.isfinite(v)]))


def _entropy(c: _Ctx) -> list[Finding]:
    f = c.fig
    series = _series(f, c.steps, "entropy_mean", "entropy/mean")
    key = "entropy_mean"
    if not series:
        series, key = _series(f, c.steps, "neg_logp_mean", None), "neg_logp_mean"
    h = _halves(series, 0.25)
    if h is None or h[0] <= 0:
        return []
    est = _entropy_ratio(series)
    last, ratio = est.value * h[0], est.value
    sev = _judge(est, ENTROPY_RATIO_WARNING, ENTROPY_RATIO_ERROR, below=True)
    if sev is None:
        return []
    notes = _settle_notes(sev, est, ENTROPY_RATIO_WARNING, len(series), "steps")
    rewards = _halves(_series(f, c.steps, "reward_mean", "reward/mean"), 0.25)
    if rewards is not None and rewards[1] - rewards[0] >= REWARD_RISE:
        # A policy converging on its task loses entropy as its reward rises; collapse is the concern when the
        # entropy goes while the reward does not follow (Cui et al. 2025, "The Entropy Mechanism of RL for LLMs").
        sev = _cap(sev, notes, f"the mean reward rose from {rewards[0]:.3g} to {rewards[1]:.3g} over the same steps: "
                               "the policy may be converging")
    title = RULES["GRP401"].title.format(first=h[0], last=last, ratio=ratio)
    fix = RULES["GRP401"].fix
    evidence = {f"diag/by_step[{key}] last/first quarter": est.ev(ENTROPY_RATIO_WARNING)}
    if rewards is not None:
        evidence["diag/by_step[reward_mean] last − first quarter"] = _ev(rewards[1] - rewards[0], REWARD_RISE)
    return [Finding("GRP401", "entropy-collapse", sev, title, evidence,
                    {"steps": [series[0][0], series[-1][0]]}, fix, notes)]


def _truncation(c: _Ctx) -> list[Finding]:
    f = c.fig
    overall = _num(f, "seq/no_eos_frac")
    series = _series(f, c.steps, "no_eos_frac", "seq/no_eos_frac")
    if overall is None and series:
        w = sum(x[2] for x in series)
        overall = sum(x[1] * x[2] for x in series) / w if w else None
    if overall is None:
        return []
    if overall < NO_EOS_INFO:
        return []
    n_seq = _num(f, "n_sequences") or sum(x[2] for x in series)
    sev, notes, est = _graded_fraction(overall, n_seq, NO_EOS_WARNING, NO_EOS_ERROR, "sequences")
    title = RULES["GRP402"].title.format(frac=overall)
    fix = RULES["GRP402"].fix
    steps = sorted(series, key=lambda x: -x[1])[:5]
    return [Finding("GRP402", "length-truncation", sev, title, {"seq/no_eos_frac": est.ev(NO_EOS_WARNING)},
                    {"steps": [s for s, _, _ in steps]}, fix, notes)]


DETECTORS = (
    Detector(_advantage, ("GRP301", "GRP302", "GRP303"), groups=("diag/groups",)),
    Detector(_no_signal, ("GRP304",), groups=("diag/groups",), keys=("groups/zero_std_frac",)),
    Detector(_entropy, ("GRP401",), groups=("diag/by_step",), keys=("entropy/mean", "reward/mean")),
    Detector(_truncation, ("GRP402",), groups=("diag/by_step",), keys=("seq/no_eos_frac",)),
)
"""The GRP3xx/GRP4xx detectors, in the order :func:`~grpo_cli.findings.detect.detect` runs them."""
