"""Every finding code declared once, as ruff declares its rules: code, category, short name, title template,
evidence keys, thresholds and the prose of its documentation (what it means, why it matters, how it is detected, how
to fix it).

The detectors take their ``fix`` from here, ``CODES`` and ``CATEGORIES`` of :mod:`grpo_cli.findings` derive from
:data:`RULES` and :data:`CATEGORIES`, ``grpo-cli explain CODE`` prints :meth:`Rule.markdown`, and
``docs/findings.md`` is :func:`render_docs`'s text (regenerate it with :data:`REGENERATE`). Torch-free.
"""

from __future__ import annotations

from grpo_cli.findings.catalog._inputs import RULES as _INPUTS
from grpo_cli.findings.catalog._policy import RULES as _POLICY
from grpo_cli.findings.catalog._rule import WIDTH, Rule, fill, template_fields, wrap
from grpo_cli.findings.catalog._training import RULES as _TRAINING

__all__ = [
    "CATEGORIES",
    "COMMON_RULES",
    "COMMON_THRESHOLDS",
    "INTRODUCTION",
    "POWER_TABLE",
    "REGENERATE",
    "RULES",
    "WIDTH",
    "Rule",
    "fill",
    "render_docs",
    "template_fields",
    "wrap",
]

RULES: dict[str, Rule] = {rule.code: rule for rule in (*_INPUTS, *_POLICY, *_TRAINING)}
"""Every rule by code, in code order."""

CATEGORIES = (
    "alignment", "temperature", "truncated-sampling", "mask", "weight-sync", "mismatch", "advantage", "no-signal",
    "reference", "duplicates", "entropy-collapse", "length-truncation", "clipping", "importance-weights",
    "staleness", "prox-approximation", "retokenization",
)
"""The categories of :data:`RULES`, in the order ``grpo_cli.findings.CATEGORIES`` has always listed them (the order
they were introduced, not code order: a public contract)."""

REGENERATE = "python -m grpo_cli.findings.catalog > docs/findings.md"
POWER_TABLE = "bench/power_table.md"
"""Where ``bench/power.py`` writes the power table, relative to the repository root (the page's last section)."""
"""The command that writes ``docs/findings.md`` from the declarations."""

INTRODUCTION = (
    "A finding turns figures into a diagnosis, the way a linter turns code into diagnostics: a stable **code** "
    "(`GRP101`), a **category**, a **severity** (`info`, `warning`, `error`), a one-line **title**, the **evidence** "
    "(each figure with its value and threshold, and a confidence bound where the statistic is noisy), **where** "
    "(steps, lags, groups, and the worst sequences as file index and row) and a **fix** naming the option of AReaL, "
    "verl, TRL, slime or OpenRLHF that changes the behaviour. `grpo-cli explain CODE` prints the section of this "
    "page for `CODE`.\n\n"
    "The detectors live in `grpo_cli/findings/` — `detect.py` (`detect(figures, per_step, config)`), one module per "
    "family of codes (`_inputs.py` GRP1xx, `_policy.py` GRP2xx, `_training.py` GRP3xx–GRP4xx); the statistics they "
    "need beyond `analyze`'s keys are the `diag/*` keys of `grpo_cli/core/diagnosis/` (mergeable states, streamed "
    "like every other figure). Every threshold below is a named constant in `grpo_cli/findings/thresholds.py`, and "
    "the values printed here are read from those constants. Each code is declared once in "
    "`grpo_cli/findings/catalog/` (category, name, title, evidence, thresholds, this page's prose and the fix the "
    "finding reports); this page is generated from the declarations: edit them, then run "
    f"`{REGENERATE}`."
)
"""The page's introduction (markdown, unwrapped)."""

COMMON_THRESHOLDS: tuple[str, ...] = ()
"""The thresholds every detector shares (:data:`COMMON_RULES` names them)."""

COMMON_RULES = (
    "- **Severity from evidence, at any size.** Every graded statistic comes with a 95 % interval over its natural "
    "unit: a delete-a-block jackknife over 20 hash blocks of GRPO groups for token-level statistics (slopes, means, "
    "tail fractions), Wilson's score interval for fractions of sequences or groups, the exact value for a count or "
    "a fact of the dump (lags, prompt tokens in the loss). `error` needs the whole interval past the error "
    "threshold, `warning` the whole interval past the warning threshold. Each evidence entry carries `value`, "
    "`low`, `high` and `threshold`.\n"
    "- **Inconclusive.** When the estimate is past the warning threshold but its interval reaches back below it, "
    "the finding is `inconclusive`: shown on screen, counted in the verdict line and in `check`'s output (never "
    "failing it), with a note of about how much more data would settle it (the interval shrinks as 1/√n). The "
    "verdict never says \"no problem found\" while something is inconclusive. A strong effect in a small dump is "
    "an error: there is no size cap.\n"
    "- **Causes first.** An alignment shift (GRP101) or prompt tokens in the loss (GRP104) distort every "
    "old-vs-new figure, so temperature, truncation, re-tokenisation, mismatch, weight-sync, importance-weight and "
    "clipping findings are capped at `info` while they stand; a weight-sync trend (GRP201) explains a lag-0 "
    "mismatch, tilt and weight tail; a temperature (GRP102), truncation (GRP103) or re-tokenisation (GRP108) "
    "explains the mismatch, weight-sync and importance-weight findings; a mismatch (GRP202) explains the weight "
    "tail. The capped symptom says \"explained by CODE\" on screen. Fix the cause and re-run.\n"
    "- **Same weights.** Behaviour against training log-probs is judged where both come from the same weights "
    "(lag 0; `new_logp` or `prox_logp`, whichever is closer to `old_logp`), so staleness and the step's own "
    "updates, which the decoupled loss corrects by design, never read as engine faults.\n"
    "- **Partial faults.** A fault that hits a fraction of the sequences (one broken rollout worker) is found "
    "through per-sequence statistics rather than dump-wide means, and `where` lists the worst sequences, which are "
    "the broken ones.\n"
    "- **Calibration.** Thresholds come from sources where one exists and otherwise from a physically real corpus "
    "(`grpo_cli/commands/corpus.py`): a tiny causal LM, warm-started by supervised fine-tuning so its policy is "
    "peaked, trained by an asynchronous GRPO loop with a bfloat16 engine and a float32 trainer, with faults "
    "injected where stacks break and healthy controls (lags 0–3, lags 0–6 with `--max-staleness 6`, on-policy, T "
    "= 0.7 on both sides, one step, 64 sequences). The power table below gives each detector's detection rate "
    "against fault magnitude and dump size, on seeds the thresholds were not set with (`bench/power.py`).\n\n"
    "Configuration (`DetectConfig`): `max_staleness` (default 4, the largest lag the run's correction is meant for) "
    "and `prox_approximation` (`loglinear`/`linear` when the run approximates the proximal policy instead of "
    "recomputing it)."
)
"""The rules every detector follows (markdown, unwrapped; a template over :data:`COMMON_THRESHOLDS`)."""


def render_docs(power_table: str | None = None) -> str:
    """The whole ``docs/findings.md`` page: the introduction, the common rules and one section per rule, with the
    threshold values read from :mod:`grpo_cli.findings.thresholds`, and last the power table (``bench/power.py``'s
    ``bench/power_table.md``) when given."""
    head = [
        f"<!-- Generated from grpo_cli/findings/catalog/ by `{REGENERATE}`: edit the declarations, not this page. -->",
        "# Findings",
        wrap(INTRODUCTION),
        "## Common rules",
        wrap(fill(COMMON_RULES, COMMON_THRESHOLDS)),
    ]
    page = "\n\n".join(head) + "\n\n" + "\n".join(rule.markdown() for rule in RULES.values())
    if power_table:
        page += "\n## Power table\n\n" + power_table
    return page
