"""Findings: documented thresholds applied to figure dicts (``grpo-cli``'s metric keys and the ``diag/*`` keys of
:mod:`grpo_cli.core.diagnosis`), in the style of a linter's diagnostics.

:func:`detect` is pure: it reads figures (the overall dict, optionally per-step rows) and returns
:class:`Finding` objects sorted by severity and code. Every threshold is a module constant whose docstring gives the
reason or source; ``docs/findings.md`` has one section per code. A detector never fires above ``info`` when the dump
is small (:data:`MIN_TOKENS`, :data:`MIN_SEQUENCES`) or when the confidence bound of its statistic straddles the
threshold, and several detectors need a minimum number of affected sequences, so a few odd tokens stay ``info``.

Detectors whose statistic is explained by an earlier, more basic finding (an alignment shift or prompt tokens in the
loss distort every old-vs-new figure) are demoted to ``info`` with a note, so the user fixes the cause first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "CODES",
    "SEVERITIES",
    "DetectConfig",
    "Finding",
    "detect",
    "per_step_rows",
]

SEVERITIES = ("info", "warning", "error")
CATEGORIES = (
    "alignment", "temperature", "truncated-sampling", "mask", "weight-sync", "mismatch", "advantage", "no-signal",
    "reference", "duplicates", "entropy-collapse", "length-truncation", "clipping", "importance-weights",
    "staleness", "prox-approximation",
)
#: code → (category, short name)
CODES: dict[str, tuple[str, str]] = {
    "GRP101": ("alignment", "old_logp shifted against new_logp"),
    "GRP102": ("temperature", "behaviour and training log-probs at different temperatures"),
    "GRP103": ("truncated-sampling", "behaviour log-probs renormalised over a truncated set"),
    "GRP104": ("mask", "prompt or padding tokens in the loss"),
    "GRP105": ("mask", "response tokens missing from the loss"),
    "GRP106": ("reference", "ref_logp is not a reference policy"),
    "GRP107": ("duplicates", "sequences counted more than once"),
    "GRP201": ("weight-sync", "train/inference disagreement grows step by step at lag 0"),
    "GRP202": ("mismatch", "train/inference disagreement above bf16 level"),
    "GRP203": ("importance-weights", "heavy-tailed importance weights"),
    "GRP204": ("staleness", "lags beyond what the run corrects"),
    "GRP205": ("prox-approximation", "approximated proximal policy beyond its safe lag"),
    "GRP206": ("clipping", "clip fraction signals too large an update"),
    "GRP301": ("advantage", "advantage sign opposite to reward"),
    "GRP302": ("advantage", "advantages not centred within groups"),
    "GRP303": ("advantage", "advantage scale inconsistent across groups"),
    "GRP304": ("no-signal", "most groups have zero reward variance"),
    "GRP401": ("entropy-collapse", "entropy falls towards zero over steps"),
    "GRP402": ("length-truncation", "many responses cut at the length limit"),
}

# -- thresholds (each documented in docs/findings.md with its reason) -------------------------------------------------
MIN_TOKENS = 4000
"""Below this many valid tokens a finding is ``info`` at most: a token fraction of 1 % would rest on < 40 tokens,
a handful of sequences."""
MIN_SEQUENCES = 64
"""Below this many sequences a finding is ``info`` at most (sequence fractions move by ≥ 1.5 % per sequence)."""
MIN_FLAGGED_SEQUENCES = 3
"""Per-sequence detectors need at least this many flagged sequences for more than ``info``."""
SHIFT_SEQ_WARNING, SHIFT_SEQ_ERROR = 0.02, 0.10
"""GRP101: fraction of sequences agreeing better at a one-token shift (healthy simulated dumps: 0)."""
SLOPE_WARNING, SLOPE_ERROR = 0.05, 0.15
"""GRP102: |b − 1| of the least-squares line old ≈ a + b·new. Healthy simulated dumps: |b − 1| ≤ 0.003 (lags 0–3
included); a 0.6/1.0 temperature pair gives b ≈ 1.33; b ≈ T_train/T_behaviour to first order."""
SLOPE_MIN_LAG0 = 500
"""GRP102 reads the slope over lag-0 tokens when there are at least this many: at lag > 0 the policy's own drift
(e.g. entropy falling between versions) tilts the line as a temperature would."""
ONESIDED_WARNING, ONESIDED_ERROR = 0.10, 0.50
"""GRP103: fraction of sequences (≥ 8 valid tokens) with old > new on ≥ 95 % of their tokens (healthy: < 1 %;
a renormalised top-p = 0.8: ≈ 97 %)."""
ONESIDED_MIN_SHIFT = 0.01
"""GRP103: and the mean old − new (nats) must be positive by at least this (the kept mass S < 0.99)."""
MASK_FRAC_WARNING, MASK_FRAC_ERROR = 0.005, 0.05
"""GRP104/105: fractions of valid (or generated) tokens that are prompt tokens in the loss, engine zeros, trailing
zero runs or generated tokens out of the loss; healthy dumps have exactly 0 of each."""
MASK_SEQ_WARNING = 0.02
"""GRP104: fraction of sequences with a trailing run of exact zeros under the mask (padding in the loss)."""
HOLE_INFO = 0.05
"""GRP105 without ``versions``: masked tokens inside a response span / valid tokens; multi-turn dumps mask tool
output legitimately, so this alone is ``info``."""
REF_EQUAL_WARNING, REF_EQUAL_ERROR = 0.2, 0.9
"""GRP106: fraction of valid tokens where ``ref_logp`` equals another column bitwise; a reference that differs by
any training step matches on ~0 tokens (healthy: 0)."""
REF_ZERO_ERROR = 0.9
"""GRP106: fraction of valid tokens with ``ref_logp`` exactly 0 (AReaL's placeholder without a reference model)."""
DUP_ID_ERROR = 0.05
"""GRP107: a repeated (step, seq_id) is a bug at any count (warning); above this fraction of sequences, error."""
DUP_CONTENT_WARNING = 0.05
"""GRP107 without ``seq_id``: identical sequences (hash of every token's new and old log-prob) above this
fraction; identical samples of one prompt are legitimate for short low-entropy answers (on-policy sim: 2 %)."""
SYNC_RATIO_WARNING, SYNC_RATIO_ERROR = 2.0, 4.0
"""GRP201: last over first value of the least-squares line through the per-step lag-0 disagreement (the worst
lag-0 sequence of each step, or the step's lag-0 mean); healthy simulated dumps: ≈ 1."""
SYNC_RANK_CORR = 0.6
"""GRP201: and the Spearman rank correlation of that series with the step must be at least this (a steady rise,
not one bad step; with 6 steps a chance value ≥ 0.6 has probability ≈ 0.12, and the ratio and rise must hold too:
healthy simulated dumps stay at ×1.2)."""
SYNC_LAG0_SPREAD = 3.0
"""GRP201's all-lag series needs lag-0 evidence: the largest per-step worst lag-0 sequence at least this many times
the smallest (healthy simulated dumps: ≤ 2; a larger policy step leaves lag 0 flat)."""
SYNC_DRIFT_RATIO = 1.5
"""GRP201's all-lag series is used only while the policy's own change per version (mean |new − prox| per step)
stays flat (fitted last/first below this)."""
SYNC_MIN_RISE = 0.01
"""GRP201: and the rise must be at least this many nats (slime's healthy level is ~0.011; a public SGLang run
drifting 0.011 → 0.036 over 30 steps is the pattern)."""
SYNC_LAG_DRIFT = 0.5
"""GRP201: the recorded mean lag must not rise by more than this over the steps (fitted line), else the rise may
be staleness."""
MULT_ERROR_WARNING, MULT_ERROR_ERROR = 1.05, 1.2
"""GRP202: NeMo RL's mean exp(|new − old|) over lag-0 tokens (1 = identical). Healthy bf16 simulation: 1.008;
published bf16 stacks show mean |Δ| ≈ 0.011 (exp ≈ 1.011). 1.05 is ~5× the healthy excess."""
BIG_SEQ_WARNING = 0.05
"""GRP202: fraction of lag-0 sequences whose mean |new − old| > 0.1 (one broken worker); healthy: 0."""
TAIL_WARNING, TAIL_ERROR = 0.005, 0.05
"""GRP203: fraction of valid tokens with w = exp(new − old) outside [1/2, 2] (verl's ``rollout_is_threshold`` 2,
``is/frac_high + is/frac_low``); healthy simulated dumps: 0."""
ESS_WARNING = 0.8
"""GRP203: ``is/ess`` (truncated weights, verl's ESS) below this; healthy: ≥ 0.99."""
STALE_WARNING, STALE_ERROR = 0.05, 0.25
"""GRP204: fraction of generated tokens with a lag above :attr:`DetectConfig.max_staleness`."""
PROX_BEYOND_WARNING = 0.05
"""GRP205: fraction of stale tokens (lag ≥ 1) beyond the log-linear approximation's safe lag (mean error ≤ 0.01,
compare-prox's default ``--tolerance``)."""
PROX_INFO_LAG = 8
"""GRP205 without a declared approximation: only when lags reach this (AReaL's docs: be careful above ~10)."""
CLIP_WARNING, CLIP_ERROR = 0.2, 0.4
"""GRP206: ``clip/ratio`` overall or on any step; healthy simulated dumps: 0, PPO runs in verl/TRL logs typically
stay at a few percent; above 0.2 most of the update's tokens have no gradient."""
SIGN_WARNING = 0.05
"""GRP301: fraction of groups with spread where cov(reward, advantage) < 0 (healthy GRPO: exactly 0)."""
UNCENTRED_WARNING = 0.05
"""GRP302: fraction of groups whose mean advantage is not 0 (healthy GRPO/RLOO/Dr.GRPO: exactly 0)."""
SCALE_WARNING = 0.05
"""GRP303: fraction of groups whose advantage scale is off the run's normalisation by > 10 % (healthy: 0)."""
ZERO_STD_INFO, ZERO_STD_WARNING, ZERO_STD_ERROR = 0.25, 0.5, 0.8
"""GRP304: ``groups/zero_std_frac`` (TRL ``frac_reward_zero_std``); healthy simulation (success rates 0.15–0.85,
8 samples): ≈ 0.1."""
ENTROPY_RATIO_WARNING, ENTROPY_RATIO_ERROR = 0.5, 0.2
"""GRP401: the lower of the last quarter's mean entropy and the last step's, over the first quarter's mean
(healthy simulated dumps: 0.92–1.05)."""
REWARD_RISE = 0.1
"""GRP401: a rise of the mean reward (last quarter of the steps over the first) from which an entropy fall reads as
convergence (``info``), not collapse; rewards in [0, 1] (pass/fail) rise by far more when a run learns its task."""
NO_EOS_INFO, NO_EOS_WARNING, NO_EOS_ERROR = 0.05, 0.2, 0.5
"""GRP402: ``seq/no_eos_frac`` overall or on any step (healthy simulation: ≈ 0.03)."""


@dataclass(frozen=True)
class DetectConfig:
    """What :func:`detect` knows about the run beyond the figures.

    Attributes:
        max_staleness: the largest lag the run's correction is meant for (TRL ``async_grpo`` ``max_staleness``
            defaults to 4; AReaL's ``max_head_offpolicyness`` bounds it at rollout time).
        prox_approximation: ``"loglinear"`` or ``"linear"`` when the run uses AReaL's ``prox_logp_method``
            approximation instead of recomputing, else ``None``.
        min_tokens, min_sequences: the small-dump limits.
    """

    max_staleness: int = 4
    prox_approximation: str | None = None
    min_tokens: int = MIN_TOKENS
    min_sequences: int = MIN_SEQUENCES


@dataclass
class Finding:
    """One diagnostic.

    Attributes:
        code: stable code (``GRP101`` …), ``docs/findings.md`` explains it.
        category: one of :data:`CATEGORIES`.
        severity: ``info``, ``warning`` or ``error``.
        title: one line.
        evidence: figure → ``{"value": …, "threshold": …}`` (and ``"ci"`` where the statistic is noisy).
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


def _ev(value: Any, threshold: Any, **extra: Any) -> dict[str, Any]:
    return {"value": value, "threshold": threshold, **extra}


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


# -- the detectors ---------------------------------------------------------------------------------------------------
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
        self.small = (n_tok is not None and n_tok < cfg.min_tokens) or (
            n_seq is not None and n_seq < cfg.min_sequences
        )

    def finish(self, f: Finding) -> Finding:
        if self.small and f.severity != "info":
            f.severity = _cap(
                f.severity, f.notes,
                f"small dump ({int(self.n_tokens or 0)} valid tokens, {int(self.n_sequences or 0)} sequences; "
                f"limits {self.cfg.min_tokens} and {self.cfg.min_sequences})",
            )
        return f


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
    sev = _grade(frac, SHIFT_SEQ_WARNING, SHIFT_SEQ_ERROR) or "info"
    notes: list[str] = []
    if flagged < MIN_FLAGGED_SEQUENCES:
        sev = _cap(sev, notes, f"only {flagged} sequences prefer the shift")
    word = "late" if side > 0 else "early"
    title = f"old_logp looks one token {word} against new_logp in {frac:.1%} of sequences"
    ev = {
        f"diag/shift_seq_{word}_frac": _ev(frac, SHIFT_SEQ_WARNING),
        "diag/shift_abs_diff_0": _ev(_num(f, "diag/shift_abs_diff_0"), None),
        f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}": _ev(
            _num(f, f"diag/shift_abs_diff_{'p1' if side > 0 else 'm1'}"), None
        ),
    }
    fix = (
        "Write every per-token column with the same alignment: value t belongs to token t. Next-token-aligned "
        "tensors (AReaL's loss inputs, OpenRLHF's action tensors, twinkle) must be un-rolled once — "
        "RolloutWriter(alignment='next_token') or `--preset areal|openrlhf|twinkle` when reading. If only some "
        "workers are affected, check the rollout path that fills old_logp (e.g. a response-only engine output "
        "placed one slot off against the prompt)."
    )
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
    fix = (
        "Score with the sampling temperature on both sides: the trainer must divide the logits by the rollout "
        "temperature before log_softmax (AReaL `temperature` in the actor config, verl `rollout.temperature`, "
        "TRL `temperature`, slime `--rollout-temperature`, OpenRLHF `--temperature`), and the engine must report "
        "log-probs at that temperature (vLLM `logprobs_mode=processed_logprobs`; vLLM's default raw_logprobs are "
        "pre-temperature; SGLang returns temperature-scaled log-probs unless SGLANG_RETURN_ORIGINAL_LOGPROB)."
    )
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
    fix = (
        "Either score the same truncated distribution in the trainer (slime replays the top-p set with "
        "`--rollout-top-p`), or take behaviour log-probs of the full softmax (vLLM `logprobs_mode=raw_logprobs` "
        "plus the temperature), or sample without truncation (top_p = 1, top_k = −1). An importance ratio against "
        "renormalised log-probs is offset by log(kept mass) on every token."
    )
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
        fix = (
            "Build loss_mask from the response positions only (1 on generated tokens including EOS, 0 on prompt "
            "and padding): verl `response_mask`, TRL `completion_mask`, slime `loss_masks`, OpenRLHF "
            "`action_mask`, AReaL `loss_mask` (rolled with the log-probs). Padding must be 0 in the mask, not 0.0 "
            "log-probs under a 1."
        )
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
        fix = (
            "Set loss_mask = 1 on every generated token of a kept sequence (only tool/environment output in "
            "multi-turn rollouts and whole filtered sequences belong at 0). Check the code that edits the mask "
            "in flight (rejection sampling, truncation masks) and dump the mask before such edits."
        )
        out.append(Finding("GRP105", "mask", sev2, title, ev2, {"sequences": _sequences(f.get("diag/mask_top"))},
                           fix, notes))
    return out


def _max_sev(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if SEVERITIES.index(a) >= SEVERITIES.index(b) else b


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
    fix = (
        "Load and run the reference model for ref_logp (verl `use_kl_loss`/`use_kl_in_reward` with a ref worker; "
        "TRL `beta` > 0 loads it; AReaL fills zeros when no reference model is configured — write no ref_logp "
        "then). Check that the dump writes the reference tensor, not the actor's or the engine's."
    )
    return [Finding("GRP106", "reference", sev, title, ev, {}, fix, notes)]


def _duplicates(c: _Ctx) -> list[Finding]:
    f = c.fig
    id_frac, id_extra = _num(f, "diag/dup_id_frac"), _num(f, "diag/dup_id_extra")
    content = _num(f, "diag/dup_content_frac")
    where = {"sequences": f.get("diag/dup_where") or []}
    fix = (
        "Write each sequence once per step: one writer per rank with a distinct `rank`, no re-write after a retried "
        "step, RolloutWriter(dedupe=True) for several forwards per sequence (PPO epochs). Deduplicate the dump "
        "before trusting token means."
    )
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
        if rho < SYNC_RANK_CORR or end - start < SYNC_MIN_RISE or start <= 0:
            continue
        if key == "lag_excess" and end - start < _median_drift(f):
            continue  # within what one version of the policy's own change explains
        ratio = end / start
        sev = _grade(ratio, SYNC_RATIO_WARNING, SYNC_RATIO_ERROR)
        if sev is not None and (best is None or ratio > best[3]):
            best = (key, sev, rho, ratio, end - start, series)
    if best is None:
        return []
    key, sev, rho, ratio, rise, series = best
    lag_series = _series(f, c.steps, "lag_mean", "staleness/theta_mean")
    lt = _trend(lag_series)
    if lt is not None and lt[2] - lt[1] > SYNC_LAG_DRIFT:
        sev = _cap(sev, notes, f"the recorded lag rises too ({lt[1]:.2f} → {lt[2]:.2f}): this may be staleness")
    if key == "abs_diff_mean":
        sev = _cap(sev, notes, "lag unknown")
    first, last = series[0][1], series[-1][1]
    title = (
        f"train/inference disagreement at recorded lag 0 grows step by step ({key} {first:.3f} → {last:.3f} "
        f"nats, fitted ×{ratio:.1f}) while the recorded lag does not: the engine seems to sample with stale weights"
    )
    ev = {
        f"diag/by_step[{key}] fitted last/first": _ev(ratio, SYNC_RATIO_WARNING),
        f"diag/by_step[{key}] fitted rise": _ev(rise, SYNC_MIN_RISE),
        f"diag/by_step[{key}] rank correlation with step": _ev(rho, SYNC_RANK_CORR),
    }
    fix = (
        "Check the weight update of the inference engine after every optimiser step (the refit/broadcast "
        "succeeded on every engine and rank; the version counter is bumped only after the new weights are "
        "loaded). AReaL: `update_weights` then `set_version`; verl/slime: the rollout weight sync. A stale engine "
        "whose version stamp advances looks exactly like this; if one worker is affected, its sequences lead "
        "`where`."
    )
    worst = sorted(series, key=lambda x: -x[1])[:5]
    where = {"steps": [s for s, _, _ in worst], "sequences": _sequences(f.get("diag/lag0_top"))}
    return [Finding("GRP201", "weight-sync", sev, title, ev, where, fix, notes)]


def _mismatch(c: _Ctx) -> list[Finding]:
    f = c.fig
    mult = _num(f, "diag/lag0_mult_prob_error")
    big = _num(f, "diag/lag0_big_seq_frac")
    n_seq0 = _num(f, "diag/lag0_n_seq") or 0
    notes: list[str] = []
    ev: dict[str, dict[str, Any]] = {}
    lag0_rows = [r for r in f.get("by_staleness") or [] if r.get("lag") == 0 and r.get("abs_diff/mean") is not None]
    if mult is None and lag0_rows:
        # analyze's lag-0 row gives mean |Δ|; exp(mean |Δ|) ≤ mean exp(|Δ|) (Jensen), a lower bound of the error
        bound = math.exp(float(lag0_rows[0]["abs_diff/mean"]))
        sev = _grade(bound, MULT_ERROR_WARNING, MULT_ERROR_ERROR)
        if sev is None:
            return []
        ev["exp(by_staleness[lag 0].abs_diff/mean)"] = _ev(bound, MULT_ERROR_WARNING, note="lower bound")
        title = f"train/inference disagreement at lag 0 is above bf16 level: exp(mean |new − old|) = {bound:.3f}"
    elif mult is None:
        d = _num(f, "kl/abs_diff_mean")
        if d is None or math.exp(d) < MULT_ERROR_WARNING:
            return []
        ev["exp(kl/abs_diff_mean)"] = _ev(math.exp(d), MULT_ERROR_WARNING)
        title = f"train/inference disagreement mean |new − old| = {d:.3f} nats, staleness unknown"
        notes.append("no versions: staleness cannot be separated from numerics")
        sev = "info"
    else:
        sev = _grade(mult, MULT_ERROR_WARNING, MULT_ERROR_ERROR)
        ev["diag/lag0_mult_prob_error"] = _ev(mult, MULT_ERROR_WARNING)
        if big is not None:
            ev["diag/lag0_big_seq_frac"] = _ev(big, BIG_SEQ_WARNING)
            if big >= BIG_SEQ_WARNING and round(big * n_seq0) >= MIN_FLAGGED_SEQUENCES:
                sev = _max_sev(sev, "warning")
        if sev is None:
            return []
        title = (
            f"train/inference disagreement at lag 0 is above bf16 level: mean exp(|new − old|) = {mult:.3f}"
            + (f", {big:.0%} of lag-0 sequences above 0.1 nats" if big else "")
        )
    fix = (
        "Find the numerical difference between engine and trainer (precision bf16/fp8, attention or fused "
        "kernels, MoE routing, a sampling parameter applied on one side) — NeMo RL's model-validation guide lists "
        "these. Meanwhile correct for it: verl rollout correction (`rollout_is`, `rollout_is_threshold`, "
        "`rollout_rs`), TRL `vllm_importance_sampling_correction` (`vllm_importance_sampling_mode`, "
        "`vllm_importance_sampling_clip_max`), slime `--use-tis --tis-clip`, OpenRLHF "
        "`enable_vllm_is_correction` (`vllm_is_correction_type`), AReaL `use_decoupled_loss` with "
        "`rejection_sampling`."
    )
    return [Finding("GRP202", "mismatch", sev, title, ev, {"sequences": _sequences(f.get("diag/lag0_top"))}, fix,
                    notes)]


def _importance(c: _Ctx) -> list[Finding]:
    f = c.fig
    hi, lo = _num(f, "is/frac_high"), _num(f, "is/frac_low")
    ess = _num(f, "is/ess")
    spikes = _num(f, "spikes/n_ratio_gt_1e3")
    ev: dict[str, dict[str, Any]] = {}
    sev: str | None = None
    tail = None
    lag0 = _series(f, c.steps, "lag0_tail_frac", None)
    n_lag0 = sum(x[2] for x in lag0)
    if n_lag0 >= c.cfg.min_tokens:
        # With versions, the weights of stale tokens also carry the policy's own change between versions, which
        # decoupled PPO or rejection sampling corrects by design; the lag-0 tail is the engine/trainer part alone.
        tail = sum(x[1] * x[2] for x in lag0) / n_lag0
        ev["diag/by_step[lag0_tail_frac]"] = _ev(tail, TAIL_WARNING)
        sev = _grade(tail, TAIL_WARNING, TAIL_ERROR)
    elif hi is not None and lo is not None:
        tail = hi + lo
        ev["is/frac_high + is/frac_low"] = _ev(tail, TAIL_WARNING)
        sev = _grade(tail, TAIL_WARNING, TAIL_ERROR)
    if ess is not None:
        ev["is/ess"] = _ev(ess, ESS_WARNING)
        sev = _max_sev(sev, _grade(ess, ESS_WARNING, below=True))
    if spikes:
        ev["spikes/n_ratio_gt_1e3"] = _ev(int(spikes), 1)
        sev = _max_sev(sev, "warning")
    if sev is None:
        return []
    notes: list[str] = []
    n_tail = (tail or 0) * (c.n_tokens or 0)
    if not spikes and n_tail < 10 * MIN_FLAGGED_SEQUENCES:
        sev = _cap(sev, notes, f"only about {int(n_tail)} tail tokens")
    title = (
        f"importance weights exp(new − old) are heavy-tailed: {0 if tail is None else tail:.2%} of "
        f"{'lag-0 ' if n_lag0 >= c.cfg.min_tokens else ''}tokens outside [0.5, 2]"
        + (f", ESS {ess:.2f}" if ess is not None else "")
    )
    fix = (
        "Bound the weights with truncated or masked importance sampling: verl `rollout_is` (token/sequence) with "
        "`rollout_is_threshold` and `rollout_rs`; TRL `vllm_importance_sampling_mode` (token/sequence, "
        "truncate/mask) with `vllm_importance_sampling_clip_max`; slime `--use-tis --tis-clip` (or icepop); "
        "OpenRLHF `vllm_is_correction_type` tis/icepop/seq-mask-tis with `vllm_is_truncated_threshold`; AReaL "
        "`rejection_sampling` (level, action mask/clamp, upper). Look at the worst tokens first."
    )
    tokens = [{"file": t.get("file"), "row": t.get("row"), "position": t.get("position"), "ratio": t.get("ratio")}
              for t in (f.get("top_kl") or [])[:5]]
    return [Finding("GRP203", "importance-weights", sev, title, ev, {"tokens": tokens}, fix, notes)]


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
        return [] if beyond == 0 else [c.finish(Finding(
            "GRP204", "staleness", "info", f"{frac:.1%} of generated tokens have a lag above {limit}",
            {"lag beyond max_staleness frac": _ev(frac, STALE_WARNING)}, {}, ""))]
    lag_max = max(k for k, _ in hist)
    title = f"{frac:.0%} of generated tokens are more than {limit} versions stale (max lag {lag_max})"
    rows = [r for r in (f.get("by_staleness") or []) if r.get("lag", -1) > limit][:5]
    fix = (
        "Bound the lag where samples are produced or dropped: AReaL `max_head_offpolicyness`, TRL async "
        "`max_staleness`; or correct it: AReaL `use_decoupled_loss` (recomputed `prox_logp`) with "
        "`rejection_sampling`, verl rollout correction (`rollout_is`, `rollout_rs`). Check that the lag the "
        "correction assumes (`--max-staleness` here) is the run's."
    )
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
    title = (
        f"{beyond:.0%} of stale tokens lie beyond the log-linear proximal approximation's safe lag {int(safe)} "
        f"(max lag {int(lag_max or 0)})"
    )
    rows = [r for r in f.get("diag/by_lag") or [] if r.get("lag", 0) > safe][:5]
    fix = (
        "Recompute the proximal policy (AReaL `prox_logp_method: recompute`, the default) or keep lags within the "
        "safe lag (`max_head_offpolicyness`); `grpo-cli compare-prox` reports each method's error by lag "
        "(`prox/<m>/max_safe_lag`). AReaL's docs advise care above about 10 steps of staleness."
    )
    return [Finding("GRP205", "prox-approximation", sev, title,
                    {"diag/prox_beyond_safe_frac": _ev(beyond, PROX_BEYOND_WARNING),
                     "diag/prox_loglinear_safe_lag": _ev(int(safe), None)},
                    {"lags": [{"lag": r["lag"], "error": r.get("prox_loglinear_error")} for r in rows]}, fix, notes)]


def _clipping(c: _Ctx) -> list[Finding]:
    f = c.fig
    overall = _num(f, "clip/ratio")
    series = _series(f, c.steps, "clip_frac", "clip/ratio")
    worst = max(series, key=lambda x: x[1]) if series else None
    value = max([v for v in (overall, worst[1] if worst else None) if v is not None], default=None)
    if value is None:
        return []
    sev = _grade(value, CLIP_WARNING, CLIP_ERROR)
    if sev is None:
        return []
    title = f"clip fraction {value:.0%} (overall {overall if overall is None else f'{overall:.0%}'}): updates " \
            "move the policy too far per step"
    ev = {"clip/ratio": _ev(overall, CLIP_WARNING)}
    if worst:
        ev["max over steps of clip fraction"] = _ev(worst[1], CLIP_WARNING, step=worst[0])
    fix = (
        "Take smaller policy steps: lower the learning rate, fewer PPO epochs/minibatches per batch (AReaL "
        "`ppo_n_minibatches`, verl `ppo_epochs`/`ppo_mini_batch_size`, TRL `num_iterations`), or check that the "
        "clip range matches the run (verl `clip_ratio_low/high`, AReaL `eps_clip`/`eps_clip_higher`, slime "
        "`--eps-clip/--eps-clip-high`)."
    )
    steps = sorted(series, key=lambda x: -x[1])[:5]
    return [Finding("GRP206", "clipping", sev, title, ev, {"steps": [s for s, v, _ in steps if v >= CLIP_WARNING]},
                    fix)]


def _advantage(c: _Ctx) -> list[Finding]:
    f = c.fig
    out: list[Finding] = []
    groups = _num(f, "diag/groups_spread_n") or 0
    n_groups = _num(f, "diag/groups_n") or 0
    where_all = f.get("diag/adv_where") or []
    fix_common = (
        "Compute advantages per group from that group's rewards: A = (r − mean_g r)/(std_g r + ε) (TRL "
        "`scale_rewards`, AReaL `reward_norm`/`adv_norm` with group level and group_size = samples per prompt, "
        "OpenRLHF `group_norm`, slime grpo), with group ids that match the prompts."
    )
    flip = _num(f, "diag/adv_sign_flip_frac")
    if flip:
        n = round(flip * groups)
        sev = _grade(flip, SIGN_WARNING, 2 * SIGN_WARNING) or "info"
        notes: list[str] = []
        if n < MIN_FLAGGED_SEQUENCES:
            sev = _cap(sev, notes, f"only {n} groups")
        out.append(Finding(
            "GRP301", "advantage", sev,
            f"advantages fall as rewards rise in {flip:.0%} of groups: the advantage sign is flipped",
            {"diag/adv_sign_flip_frac": _ev(flip, SIGN_WARNING)},
            {"groups": [w for w in where_all if w["problem"] == "sign"]},
            "Check the sign convention between reward, advantage and loss (loss = −A·ratio); a reward model "
            "returning a cost, or a negated advantage in one worker, produces this. " + fix_common, notes))
    unc = _num(f, "diag/adv_uncentred_frac")
    if unc:
        n = round(unc * n_groups)
        sev = _grade(unc, UNCENTRED_WARNING) or "info"
        notes = []
        if n < MIN_FLAGGED_SEQUENCES:
            sev = _cap(sev, notes, f"only {n} groups")
        out.append(Finding(
            "GRP302", "advantage", sev,
            f"advantages are not centred within {unc:.0%} of groups: group boundaries do not match group_id",
            {"diag/adv_uncentred_frac": _ev(unc, UNCENTRED_WARNING)},
            {"groups": [w for w in where_all if w["problem"] == "uncentred"]},
            "If the run uses a group baseline (GRPO, RLOO, Dr.GRPO), the statistics were taken over the wrong "
            "sequences: check group_size against the samples per prompt and the order of sequences when the "
            "batch is reshaped to [groups, group_size]. A batch-level baseline (REINFORCE++) is not centred per "
            "group by design. " + fix_common, notes))
    out_frac = _num(f, "diag/adv_scale_outlier_frac")
    if out_frac:
        n = round(out_frac * groups)
        sev = _grade(out_frac, SCALE_WARNING) or "info"
        notes = []
        if n < MIN_FLAGGED_SEQUENCES:
            sev = _cap(sev, notes, f"only {n} groups")
        out.append(Finding(
            "GRP303", "advantage", sev,
            f"advantage scale is inconsistent across groups: {out_frac:.0%} of groups are normalised differently "
            f"(scale exponent {_num(f, 'diag/adv_scale_exponent') or float('nan'):.2f}; −1 = group std, 0 = none)",
            {"diag/adv_scale_outlier_frac": _ev(out_frac, SCALE_WARNING),
             "diag/adv_scale_exponent": _ev(_num(f, "diag/adv_scale_exponent"), "−1 or 0")},
            {}, "Normalise every group the same way (divide by the group std plus a small ε, or not at all). "
            + fix_common, notes))
    return out


def _no_signal(c: _Ctx) -> list[Finding]:
    f = c.fig
    z = _num(f, "groups/zero_std_frac")
    if z is None or z < ZERO_STD_INFO:
        return []
    sev = _grade(z, ZERO_STD_WARNING, ZERO_STD_ERROR) or "info"
    fix = (
        "Filter groups whose rewards are all equal and sample more prompts (DAPO's dynamic sampling), adjust the "
        "prompt difficulty, or raise the samples per prompt; TRL logs this as `frac_reward_zero_std`, slime as "
        "`zero_std/count_*`."
    )
    return [Finding("GRP304", "no-signal", sev, f"{z:.0%} of groups have zero reward variance: no learning signal",
                    {"groups/zero_std_frac": _ev(z, ZERO_STD_WARNING)}, {}, fix)]


def _entropy(c: _Ctx) -> list[Finding]:
    f = c.fig
    series = _series(f, c.steps, "entropy_mean", "entropy/mean")
    key = "entropy_mean"
    if not series:
        series, key = _series(f, c.steps, "neg_logp_mean", None), "neg_logp_mean"
    h = _halves(series, 0.25)
    if h is None or h[0] <= 0:
        return []
    last = min(h[1], series[-1][1])  # a fall in the final steps counts before it fills a quarter of the run
    ratio = last / h[0]
    sev = _grade(ratio, ENTROPY_RATIO_WARNING, ENTROPY_RATIO_ERROR, below=True)
    if sev is None:
        return []
    notes: list[str] = []
    rewards = _halves(_series(f, c.steps, "reward_mean", "reward/mean"), 0.25)
    if rewards is not None and rewards[1] - rewards[0] >= REWARD_RISE:
        # A policy converging on its task loses entropy as its reward rises; collapse is the concern when the
        # entropy goes while the reward does not follow (Cui et al. 2025, "The Entropy Mechanism of RL for LLMs").
        sev = _cap(sev, notes, f"the mean reward rose from {rewards[0]:.3g} to {rewards[1]:.3g} over the same steps: "
                               "the policy may be converging")
    title = f"entropy falls from {h[0]:.3f} to {last:.3f} nats over the steps (×{ratio:.2f}): entropy collapse"
    fix = (
        "Slow the collapse: an entropy bonus (verl `entropy_coeff`, TRL `entropy_coef`), a higher clip on the "
        "upper side (clip-higher: verl `clip_ratio_high`, AReaL `eps_clip_higher`, slime `--eps-clip-high`), "
        "Clip-Cov/KL-Cov (verl), or a lower learning rate."
    )
    evidence = {f"diag/by_step[{key}] last/first quarter": _ev(ratio, ENTROPY_RATIO_WARNING)}
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
    sev = _grade(overall, NO_EOS_WARNING, NO_EOS_ERROR) or "info"
    title = f"{overall:.0%} of responses end without EOS (cut at the length limit)"
    fix = (
        "Raise the generation limit (AReaL `max_new_tokens`, verl `data.max_response_length`, TRL "
        "`max_completion_length`), or keep truncated responses out of the loss (TRL `mask_truncated_completions`, "
        "AReaL `mask_no_eos_with_zero`) or shape their reward (AReaL `overlong_reward_penalty`, DAPO's overlong "
        "penalty)."
    )
    steps = sorted(series, key=lambda x: -x[1])[:5]
    return [Finding("GRP402", "length-truncation", sev, title, {"seq/no_eos_frac": _ev(overall, NO_EOS_WARNING)},
                    {"steps": [s for s, _, _ in steps]}, fix)]


_DETECTORS: tuple[Callable[[_Ctx], list[Finding]], ...] = (
    _alignment, _mask, _reference, _duplicates, _temperature, _truncated, _weight_sync, _mismatch, _importance,
    _staleness, _prox, _clipping, _advantage, _no_signal, _entropy, _truncation,
)
_OLD_VS_NEW = {"temperature", "truncated-sampling", "mismatch", "weight-sync", "importance-weights", "clipping"}


def _demote(findings: list[Finding], causes: tuple[str, ...], categories: set[str]) -> None:
    """Cap at ``info`` the findings in ``categories`` when a finding in ``causes`` explains them."""
    found = [f.code for f in findings if f.code in causes and f.severity != "info"]
    if not found:
        return
    why = ", ".join(found)
    for f in findings:
        if f.category in categories and f.code not in causes and f.severity != "info":
            f.severity = _cap(f.severity, f.notes, f"explained by {why}: fix that first and re-run")


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
    for detector in _DETECTORS:
        findings.extend(ctx.finish(f) for f in detector(ctx))
    if any(f.code == "GRP101" and f.severity != "info" for f in findings):
        for f in findings:
            if f.code == "GRP104" and set(f.evidence) == {"diag/old_zero_new_nonzero_frac"} and f.severity != "info":
                f.severity = _cap(f.severity, f.notes, "the zeros are the fill of the shifted column (GRP101)")
    _demote(findings, ("GRP101", "GRP104"), _OLD_VS_NEW)
    _demote(findings, ("GRP102", "GRP103"), {"mismatch", "importance-weights", "weight-sync"})
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (-order[f.severity], f.code))
