"""The :class:`Rule` declaration and how its prose becomes markdown: threshold values filled in from
:mod:`grpo_cli.findings.thresholds`, paragraphs wrapped to the page's width."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpo_cli.findings.thresholds as thresholds

WIDTH = 116
"""The width ``docs/findings.md`` and ``grpo-cli explain`` wrap their prose to."""

_SPEC = re.compile(r"^(?:\*(?P<factor>[0-9.]+))?(?P<percent>%?)$")
# A word that would turn a wrapped line into a list item, a heading, a quote or a setext underline.
_BLOCK_START = re.compile(r"^([-+*>#]|\d+[.)])$")
_OPERATORS = frozenset({"=", "≈", "<", ">", "≤", "≥", "→"})


class _Value:
    """A threshold as a template shows it: ``{NAME}`` is the value (``0.05``, ``4000``), ``{NAME:%}`` a percentage
    (``5 %``), ``{NAME:*4}`` / ``{NAME:*2%}`` a multiple of it (for a limit the detector derives, e.g.
    ``4 * MASK_FRAC_ERROR``)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        m = _SPEC.match(spec)
        if m is None:
            raise ValueError(f"unknown threshold format {spec!r} (use '', '%', '*N' or '*N%')")
        value = self.value * float(m["factor"]) if m["factor"] else self.value
        if m["percent"]:
            return f"{value * 100:.6g} %"
        return f"{value:.6g}"


def template_fields(template: str) -> set[str]:
    """The ``str.format`` field names of ``template`` (``{NAME:%}`` → ``NAME``)."""
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}


def fill(template: str, names: tuple[str, ...] | None = None) -> str:
    """``template`` with every ``{NAME}`` field replaced by the value of :mod:`grpo_cli.findings.thresholds`'s
    constant ``NAME`` (``names`` limits the constants it may name)."""
    fields = template_fields(template)
    allowed = fields if names is None else fields & set(names)
    if fields - allowed:
        raise KeyError(f"{', '.join(sorted(fields - allowed))} not among the rule's thresholds")
    return template.format(**{name: _Value(getattr(thresholds, name)) for name in fields})


def wrap(text: str) -> str:
    """Markdown ``text`` (paragraphs separated by a blank line, list items starting a line with ``- ``) wrapped to
    :data:`WIDTH` columns, list items' continuation lines indented by two spaces."""
    return "\n\n".join(
        "\n".join(wrapped for line in block.split("\n")
                  for wrapped in _wrap_line(line, "  " if line.startswith("- ") else ""))
        for block in text.split("\n\n")
    )


def _wrap_line(line: str, subsequent: str) -> list[str]:
    """Greedy wrap of one line, never between an operator and its operands; a word that would start a block (``-``,
    ``1.``) at the start of a line takes the word before it along."""
    out: list[str] = []
    current: list[str] = []
    width = 0
    words: list[str] = []
    for word in line.split(" "):  # an operator stays with both its operands: `b = 1.33`, `lag > 0`
        if words and (word in _OPERATORS or words[-1].rsplit(" ", 1)[-1] in _OPERATORS):
            words[-1] = f"{words[-1]} {word}"
        else:
            words.append(word)
    for word in words:
        if current and width + 1 + len(word) > WIDTH:
            carried = [current.pop()] if _BLOCK_START.match(word) and len(current) > 1 else []
            out.append(" ".join(current))
            current = [subsequent + " ".join([*carried, word])] if carried else [subsequent + word]
            width = len(current[0])
        else:
            current.append(word)
            width += len(word) + (1 if len(current) > 1 else 0)
    out.append(" ".join(current))
    return out


@dataclass(frozen=True)
class Rule:
    """One finding code, declared once: the detector reads its :attr:`fix` (and later its :attr:`title`), and
    ``docs/findings.md`` and ``grpo-cli explain`` render its prose.

    The prose fields are markdown, one paragraph per string (paragraphs separated by ``"\\n\\n"``, list items by
    ``"\\n- "``), unwrapped: :func:`wrap` wraps them for the page. :attr:`severity` and :attr:`detection` are
    templates whose ``{NAME}`` fields are :mod:`grpo_cli.findings.thresholds` constants listed in
    :attr:`thresholds` (``{NAME:%}`` shows a percentage, ``{NAME:*4}`` a multiple), so the page prints the values
    the detector compares with; literal braces are doubled.

    Attributes:
        code: the stable code (``GRP101``).
        category: its category, one of :data:`~grpo_cli.findings.catalog.CATEGORIES`.
        name: the short name (the heading of its section, ``CODES``' second item).
        title: the finding's one-line title as a ``str.format`` template; its fields are what the detector fills
            in (a fraction, a slope, a direction …).
        evidence: the evidence keys the detector may report (``{field}`` where the detector fills the key in).
        thresholds: the names of the :mod:`~grpo_cli.findings.thresholds` constants the detector compares with.
        severity: when the finding is ``error``, ``warning`` or ``info`` (template).
        meaning: what it means.
        why: why it matters.
        detection: how it is detected, with the values measured on simulated dumps (template).
        fix: how to fix it, naming the trainers' options; the detector reports it as ``Finding.fix``.
        variants: other title templates for other forms of the same finding (``{"zero": …}``).
    """

    code: str
    category: str
    name: str
    title: str
    evidence: tuple[str, ...]
    thresholds: tuple[str, ...]
    severity: str
    meaning: str
    why: str
    detection: str
    fix: str
    variants: Mapping[str, str] = field(default_factory=dict)

    def threshold_values(self) -> dict[str, Any]:
        """Each of :attr:`thresholds` with its value in :mod:`grpo_cli.findings.thresholds`."""
        return {name: getattr(thresholds, name) for name in self.thresholds}

    def markdown(self) -> str:
        """The rule's section of ``docs/findings.md`` (what ``grpo-cli explain`` prints), ending in a newline."""
        values = ", ".join(f"`{name}` = {format(_Value(value), '')}" for name, value in self.threshold_values().items())
        evidence = ", ".join(f"`{key}`" for key in self.evidence)
        parts = [
            f"## {self.code} {self.name}",
            f"**Category**: `{self.category}`",
            wrap(f"**Severity**: {fill(self.severity, self.thresholds)}"),
        ]
        if values:
            parts.append(wrap(f"**Thresholds** (`grpo_cli/findings/thresholds.py`): {values}."))
        if evidence:
            parts.append(wrap(f"**Evidence**: {evidence}."))
        for heading, text in (("What it means", self.meaning), ("Why it matters", self.why),
                              ("How it is detected", fill(self.detection, self.thresholds)),
                              ("How to fix", self.fix)):
            parts.append(f"### {heading}\n{wrap(text)}")
        return "\n\n".join(parts) + "\n"
