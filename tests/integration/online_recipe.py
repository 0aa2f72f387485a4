"""Test helper: a recipe page's "Findings while training" code, as printed, and the data to judge it on.

Each page shows its ``Diagnoser`` call as a ``diff`` against its own python block (``...`` stands for the block's
lines in between); :func:`online_code` applies that diff to the block, so the tests run the code a reader gets by
following the page, and a diff that no longer matches its block fails the test. The ``diagnose`` helper those
calls use is the one printed in ``docs/recipes/README.md`` ("Findings while training"), executed in the same
module, as the pages say.

The data: a lookup-table causal LM (the logits at position t depend on token t only, as in each recipe test), whose
responses an "engine" samples at a temperature and reports the sampled tokens' log-probs for. Healthy, the engine
runs at the trainer's temperature with bf16 logits (the usual engine/trainer numerics); the faults are ones a
recipe's columns show and the detectors name on a few dozen sequences: the engine at temperature 0.7 against the
trainer's 1.0 (GRP102), or behaviour log-probs one token late (GRP101).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_cli.commands.analyze import analyze
from grpo_cli.io import RolloutDataset

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"
LOUD = ("warning", "error")
FAULTS = {"temperature": "GRP102", "shift": "GRP101"}
"""The injected faults and the code each must be named by."""


def _blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)


def readme_helper() -> str:
    """The ``diagnose`` helper of ``docs/recipes/README.md``, as printed."""
    (block,) = [b for b in _blocks(RECIPES / "README.md", "python") if "def diagnose" in b]
    return block


def page_diff(page: Path) -> str:
    """The page's one ``diff`` block (its "Findings while training" section)."""
    diffs = _blocks(page, "diff")
    assert len(diffs) == 1, f"{page.name}: one diff block, found {len(diffs)}"
    return diffs[0]


def apply_diff(code: str, diff: str) -> str:
    """``code`` with ``diff`` applied: ``-`` lines must be there and go, ``+`` lines come in, context lines must
    match, and a context line ``...`` skips the code's lines up to the diff's next context or ``-`` line; blank lines
    are not compared. The diff's first context or ``-`` line must occur once in ``code``; a diff of ``+`` lines only
    is returned as code."""
    ops = [(line[:1], line[1:]) for line in diff.splitlines() if line.strip()]
    assert all(op in "+- " for op, _ in ops), "diff lines start with '+', '-' or ' '"
    anchors = [text for op, text in ops if op != "+" and text.strip() != "..."]
    if not anchors:
        return "\n".join(text for _, text in ops) + "\n"
    src = code.splitlines()
    assert src.count(anchors[0]) == 1, f"the diff's first line is not once in the block: {anchors[0]!r}"
    i = src.index(anchors[0])
    out = src[:i]
    skipping = False
    for op, text in ops:
        if op == "+":
            out.append(text)
            continue
        if text.strip() == "...":
            skipping = True
            continue
        if skipping:
            while i < len(src) and src[i] != text:
                out.append(src[i])
                i += 1
            skipping = False
        while i < len(src) and not src[i].strip():  # blank lines (a page's editor may strip a diff's)
            out.append(src[i])
            i += 1
        assert i < len(src) and src[i] == text, f"the diff does not match the block at {text!r}"
        if op == " ":
            out.append(text)
        i += 1
    return "\n".join(out + src[i:]) + "\n"


def new_side(diff: str) -> str:
    """What a diff of a framework's own file (not printed on the page) leaves at the place it names: its context and
    ``+`` lines, dedented."""
    lines = [line[1:] for line in diff.splitlines() if line[:1] in " +" and line.strip()]
    assert not any(line.strip() == "..." for line in lines), "a diff with '...' needs the block it applies to"
    return textwrap.dedent("\n".join(lines)) + "\n"


def online_code(page: Path, block: str) -> str:
    """The page's python ``block`` with its Diagnoser diff applied, preceded by the README's helper (one module)."""
    return readme_helper() + "\n\n" + apply_diff(block, page_diff(page))


def record_feeds(namespace: Any) -> list[dict[str, Any]]:
    """Wrap the module's ``diagnose`` (the recipe calls it by its global name): the list fills with the keywords of
    every call, so a test can see which sequences reached the Diagnoser, and how often."""
    calls: list[dict[str, Any]] = []
    inner = namespace.diagnose

    def diagnose(step: Any, **columns: Any) -> None:
        calls.append({"step": step, **columns})
        inner(step, **columns)

    namespace.diagnose = diagnose
    return calls


def engine_logps(table: torch.Tensor, seq: Sequence[int], start: int, temperature: float) -> list[float]:
    """What a bf16 engine at ``temperature`` reports for tokens ``start:`` of ``seq`` (token t scored by the logits
    at token t − 1)."""
    logp = torch.log_softmax(table.to(torch.bfloat16).float() / temperature, dim=-1)
    return [float(logp[a, b]) for a, b in zip(seq[start - 1:-1], seq[start:])]


def sample(table: torch.Tensor, prompt: list[int], n: int, temperature: float,
           generator: torch.Generator) -> tuple[list[int], list[float]]:
    """``n`` response tokens sampled after ``prompt`` at ``temperature`` and the engine's log-probs of them."""
    seq = list(prompt)
    probs = torch.softmax(table.to(torch.bfloat16).float() / temperature, dim=-1)
    for _ in range(n):
        seq.append(int(torch.multinomial(probs[seq[-1]], 1, generator=generator)))
    return seq[len(prompt):], engine_logps(table, seq, len(prompt), temperature)


def behaviour(table: torch.Tensor, prompt: list[int], n: int, fault: str | None,
              generator: torch.Generator) -> tuple[list[int], list[float]]:
    """A response and its behaviour log-probs, healthy or with ``fault`` (a key of :data:`FAULTS`)."""
    response, logps = sample(table, prompt, n, 0.7 if fault == "temperature" else 1.0, generator)
    if fault == "shift":  # the dump code writes each value one token late (the first token gets the second's)
        logps = [logps[0], *logps[:-1]] if len(logps) > 1 else logps
    return response, logps


def graded(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((f["code"], f["severity"]) for f in findings)


def loud(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(code, sev) for code, sev in graded(findings) if sev in LOUD]


def analyzed(dump: Path | list[Path], diagnoser: Any) -> list[dict[str, Any]]:
    """``analyze``'s findings on a dump, with the options ``diagnoser`` was made with."""
    files = sorted(dump.glob("*.parquet")) if isinstance(dump, Path) else dump
    return analyze(RolloutDataset(files), diagnoser.config, findings=diagnoser.detect_config).findings


def check(diagnoser: Any, dump: Path | list[Path], fault: str | None) -> None:
    """The three outcomes every recipe's Diagnoser test asserts: a healthy run raises nothing at warning or error, a
    fault is named by its code, and the run's findings are ``analyze``'s on the dump the recipe wrote (codes and
    severities)."""
    online = diagnoser.findings()
    if fault is None:
        assert loud(online) == []
    else:
        assert FAULTS[fault] in [code for code, _ in loud(online)], graded(online)
    assert graded(online) == graded(analyzed(dump, diagnoser))
