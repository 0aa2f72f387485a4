"""Findings on the terminal: the verdict line, one short block per finding, and the headline figures.

The first screen of ``analyze`` (the full tables are ``--all`` away) and the top of ``check``'s output.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli._constants import HEADLINE_KEYS
from grpo_cli._format import format_value
from grpo_cli.findings import verdict
from grpo_cli.metrics.registry import KEYS

__all__ = ["HEADLINE_KEYS", "render_findings", "render_headline", "render_rescaling"]


_STYLE = {"error": "bold red", "warning": "yellow", "inconclusive": "magenta", "info": "cyan"}
_SHOWN_SEQUENCES = 3


def _where(where: Mapping[str, Any], inputs: Sequence[str]) -> list[str]:
    """What to open, as short lines: steps, lags, groups, then the worst sequences as ``file:row``."""
    lines = []
    for key in ("steps", "lags", "groups"):
        values = where.get(key)
        if values:
            shown = ", ".join(str(v) for v in list(values)[:8]) + (" …" if len(values) > 8 else "")
            lines.append(f"{key}: {shown}")
    items = where.get("sequences") or where.get("tokens") or []
    located = []
    for item in items[:_SHOWN_SEQUENCES]:
        file_index = item.get("file")
        name = (os.path.basename(inputs[file_index]) if isinstance(file_index, int) and 0 <= file_index < len(inputs)
                else str(file_index))
        detail = f"{name} row {item.get('row')}"
        if item.get("position") is not None:
            detail += f" position {item['position']}"
        if item.get("step") is not None:
            detail += f" (step {item['step']})"
        located.append(detail)
    if located:
        more = len(items) - len(located)
        lines.append("sequences: " + "; ".join(located) + (f"; {more} more in the JSON" if more > 0 else ""))
    return lines


def _evidence(ev: Mapping[str, Any]) -> str:
    """``value [low, high] (threshold t)``; the interval only where the statistic has a spread."""
    text = format_value(ev.get("value"))
    low, high = ev.get("low"), ev.get("high")
    if low != high or (low is None and ev.get("value") is not None):
        text += f" [95 %: {format_value(low) if low is not None else '−∞'}, "
        text += f"{format_value(high) if high is not None else '∞'}]"
    if ev.get("threshold") is not None:
        text += f" (threshold {format_value(ev['threshold'])})"
    return text


def render_findings(
    console: Console, findings: Sequence[Mapping[str, Any]], *, n_tokens: int, inputs: Sequence[str]
) -> None:
    """The verdict (``2 problems, 1 warning in 1.2 M tokens``), then each finding: severity, code, category and
    title; the evidence against its thresholds; where to look; the fix. ``info`` findings take one line each."""
    line = verdict(findings, n_tokens)
    worst = next((f["severity"] for f in findings if f["severity"] != "info"), None)
    console.print(Text(line, style=_STYLE.get(worst or "", "bold green")))
    for finding in findings:
        style = _STYLE[finding["severity"]]
        head = Text()
        head.append(f"{finding['severity']:<12} ", style=style)
        head.append(f"{finding['code']} ", style="bold")
        head.append(f"[{finding['category']}] ", style="dim")
        head.append(finding["title"])
        explained = next((n.split(":")[0] for n in finding.get("notes") or [] if n.startswith("explained by")), None)
        if explained:
            head.append(f" ({explained})", style="dim")
        console.print(head)
        if finding["severity"] == "info":
            continue
        for key, ev in finding["evidence"].items():
            console.print(Text(f"    {key} = {_evidence(ev)}", style="dim"))
        for where_line in _where(finding.get("where") or {}, inputs):
            console.print(Text(f"    where: {where_line}"))
        if finding.get("fix"):
            console.print(Text(f"    fix: {finding['fix']}"))
        for note in finding.get("notes") or []:
            console.print(Text(f"    note: {note}", style="dim"))
    if findings:
        console.print(Text("`grpo-cli explain CODE` says how each is detected and fixed.", style="dim"))


def render_headline(console: Console, metrics: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> None:
    """A compact table of :data:`HEADLINE_KEYS` (renamed keys under ``--names``: ``sources`` maps them back)."""
    ours = {sources.get(key, key) if sources else key: key for key in metrics}
    table = Table(title="Headline figures (--all for every table)", title_justify="left", expand=False)
    table.add_column("metric", style="cyan", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("meaning", style="dim")
    for key in HEADLINE_KEYS:
        shown = ours.get(key)
        if shown is None or isinstance(metrics[shown], (list, dict)):
            continue
        table.add_row(shown, format_value(metrics[shown]), KEYS[key].meaning if key in KEYS else "")
    console.print(table)


def render_rescaling(console: Console, config: Mapping[str, Any]) -> None:
    """Say so when the temperature a dump records rescales the log-probs of the figures (twinkle's convention:
    log-prob / T), so nobody compares halved figures with a trainer's logs unawares."""
    recorded = (config.get("from_metadata") or {}).get("temperature")
    if recorded is None or float(recorded) == 1.0:
        return
    console.print(Text(
        f"note: the dump records temperature {recorded}: the GRPOMetric-family, ratio and loss figures use "
        f"log-probs divided by it (twinkle's convention; verl and TRL log them as stored). `--temperature 1` reads "
        "them as stored; the findings always read them as stored.", style="yellow"))
