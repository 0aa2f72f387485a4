"""Every finding code is declared once (:mod:`grpo_cli.findings.catalog`): ``CODES``/``CATEGORIES``, the detectors'
fix text, ``grpo-cli explain`` and ``docs/findings.md`` all come from the declarations, and the thresholds the page
prints are the constants the detectors compare with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli.findings import CATEGORIES, CODES, explain, thresholds
from grpo_cli.findings.catalog import (
    COMMON_RULES,
    COMMON_THRESHOLDS,
    POWER_TABLE,
    REGENERATE,
    RULES,
    Rule,
    fill,
    render_docs,
    template_fields,
    wrap,
)

ROOT = Path(__file__).resolve().parents[1]
_CONSTANTS = {name for name in vars(thresholds) if name.isupper()}


def test_the_committed_docs_are_the_generated_page():
    text = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    power = (ROOT / POWER_TABLE).read_text(encoding="utf-8")
    assert "## Power table" in text and power in text
    assert text == render_docs(power), f"docs/findings.md is stale: regenerate it with `{REGENERATE}`"


def test_codes_and_categories_keep_their_public_values_and_order():
    assert CODES == {
        "GRP101": ("alignment", "old_logp shifted against new_logp"),
        "GRP102": ("temperature", "behaviour and training log-probs at different temperatures"),
        "GRP103": ("truncated-sampling", "behaviour log-probs renormalised over a truncated set"),
        "GRP104": ("mask", "prompt or padding tokens in the loss"),
        "GRP105": ("mask", "response tokens missing from the loss"),
        "GRP106": ("reference", "ref_logp is not a reference policy"),
        "GRP107": ("duplicates", "sequences counted more than once"),
        "GRP108": ("retokenization", "the trainer scored other tokens than the engine sampled"),
        "GRP201": ("weight-sync", "train/inference disagreement grows step by step at lag 0"),
        "GRP202": ("mismatch", "train/inference disagreement above bf16 level"),
        "GRP203": ("importance-weights", "heavy-tailed importance weights"),
        "GRP204": ("staleness", "lags beyond what the run corrects"),
        "GRP205": ("prox-approximation", "approximated proximal policy beyond its safe lag"),
        "GRP206": ("clipping", "clip fraction signals too large an update"),
        "GRP207": ("prox-approximation", "prox_logp is old_logp: the proximal policy was not recomputed"),
        "GRP301": ("advantage", "advantage sign opposite to reward"),
        "GRP302": ("advantage", "advantages not centred within groups"),
        "GRP303": ("advantage", "advantage scale inconsistent across groups"),
        "GRP304": ("no-signal", "most groups have zero reward variance"),
        "GRP401": ("entropy-collapse", "entropy falls towards zero over steps"),
        "GRP402": ("length-truncation", "many responses cut at the length limit"),
    }
    assert list(CODES) == sorted(CODES)
    assert CATEGORIES == (
        "alignment", "temperature", "truncated-sampling", "mask", "weight-sync", "mismatch", "advantage",
        "no-signal", "reference", "duplicates", "entropy-collapse", "length-truncation", "clipping",
        "importance-weights", "staleness", "prox-approximation", "retokenization",
    )
    assert set(CATEGORIES) == {rule.category for rule in RULES.values()}


@pytest.mark.parametrize("code", list(CODES))
def test_every_code_has_a_complete_rule(code):
    rule = RULES[code]
    assert isinstance(rule, Rule) and rule.code == code
    assert (rule.category, rule.name) == CODES[code]
    for name in ("title", "severity", "meaning", "why", "detection", "fix"):
        assert getattr(rule, name).strip(), f"{code}: empty {name}"
    assert rule.evidence and rule.thresholds
    assert template_fields(rule.title), f"{code}: the title template names what the detector fills in"
    # The fix is reported as one line (Finding.fix), and only severity/detection are threshold templates.
    assert "\n" not in rule.fix and "\n" not in rule.title
    for name in ("meaning", "why", "fix"):
        assert not template_fields(getattr(rule, name)), f"{code}: {name} is prose, not a template"


@pytest.mark.parametrize("code", list(CODES))
def test_every_threshold_a_rule_names_is_a_constant(code):
    rule = RULES[code]
    assert set(rule.thresholds) <= _CONSTANTS, f"{code}: {set(rule.thresholds) - _CONSTANTS} not in thresholds.py"
    assert len(set(rule.thresholds)) == len(rule.thresholds)
    for name in ("severity", "detection"):
        used = template_fields(getattr(rule, name))
        assert used <= set(rule.thresholds), f"{code}: {name} names {used - set(rule.thresholds)} undeclared"
        fill(getattr(rule, name), rule.thresholds)  # every field formats


def test_every_threshold_constant_is_documented_by_a_rule():
    named = set(COMMON_THRESHOLDS).union(*(rule.thresholds for rule in RULES.values()))
    assert _CONSTANTS - named == set(), "thresholds.py constants no rule lists"
    assert template_fields(COMMON_RULES) <= set(COMMON_THRESHOLDS)


def test_the_page_prints_the_constants_values():
    page = render_docs()
    assert f"`{thresholds.TEMPERATURE_WARNING}`" in page or f"= {thresholds.TEMPERATURE_WARNING}" in page
    grp101 = RULES["GRP101"].markdown()
    assert f"`SHIFT_SEQ_ERROR` = {thresholds.SHIFT_SEQ_ERROR:g}" in grp101
    assert f"at or above {thresholds.SHIFT_SEQ_ERROR * 100:g} %" in grp101
    # derived limits: 4 × MASK_FRAC_ERROR for trailing zero runs, 2 × SIGN_WARNING for a flipped sign
    assert f"`error` ≥ {4 * thresholds.MASK_FRAC_ERROR:g})" in fill(RULES["GRP104"].severity)
    assert f"(`error` above {2 * thresholds.SIGN_WARNING * 100:g} %)" in fill(RULES["GRP301"].severity)


def test_threshold_formats():
    text = fill("{SHIFT_SEQ_WARNING} {SHIFT_SEQ_WARNING:%} {ZERO_STD_ERROR:*50} {SIGN_WARNING:*2%}")
    assert text == "0.02 2 % 40 10 %"
    with pytest.raises(KeyError):
        fill("{TEMPERATURE_ERROR}", ("TEMPERATURE_WARNING",))
    with pytest.raises(ValueError):
        fill("{TEMPERATURE_ERROR:.2f}")
    assert fill("s ∈ {{−1, 0, +1}}") == "s ∈ {−1, 0, +1}"


def test_wrapping_keeps_the_markdown_structure():
    text = "word " * 40 + "- not a list item " + "x " * 60 + "\n- item " + "y " * 70 + "\n\nnext paragraph"
    out = wrap(text)
    lines = out.split("\n")
    assert max(len(line) for line in lines) <= 116
    assert [line for line in lines if line.startswith("- ")] == [line for line in lines if line.startswith("- item")]
    assert all(line.startswith("  y") for line in lines[lines.index(next(x for x in lines if x.startswith("- item")))
                                                            + 1: lines.index("")])
    assert out.endswith("\n\nnext paragraph")
    for n in range(50, 60):  # an operator never ends or starts a line
        lines = wrap("x " * n + "lag > 0 and b = 1.33 " + "y " * 60).split("\n")
        assert not any(line.endswith((">", "=")) or line.startswith((">", "=")) for line in lines)


@pytest.mark.parametrize("code", list(CODES))
def test_explain_renders_the_rule(code):
    rule = RULES[code]
    text = explain(code.lower())
    assert text.startswith(f"## {code} {rule.name}\n") and text.endswith("\n")
    assert text in render_docs()
    flat = " ".join(text.split())
    for part in (rule.meaning, rule.why, fill(rule.detection, rule.thresholds), rule.fix):
        assert " ".join(part.split()) in flat
    for heading in ("### What it means", "### Why it matters", "### How it is detected", "### How to fix"):
        assert heading in text


def test_findings_report_the_catalog_fix():
    from grpo_cli.findings.detect import detect

    findings = detect({"groups/zero_std_frac": 0.9, "seq/no_eos_frac": 0.6, "n_valid_tokens": 10**6,
                       "n_sequences": 10**4})
    assert {f.code: f.fix for f in findings} == {"GRP304": RULES["GRP304"].fix, "GRP402": RULES["GRP402"].fix}


def test_the_module_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "grpo_cli.findings.catalog"], capture_output=True, check=True,
                         cwd=ROOT).stdout.decode("utf-8")
    assert out == render_docs((ROOT / POWER_TABLE).read_text(encoding="utf-8"))


def test_the_catalog_imports_no_torch():
    code = "import sys, grpo_cli.findings.catalog; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
