"""``diff``'s outputs: the ranked side-by-side table with per-step sparklines, strict JSON and CSV."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli._format import format_value
from grpo_cli.render.documents import json_document
from grpo_cli.render.terminal import downsample

if TYPE_CHECKING:
    from grpo_cli.commands.diff import DiffResult, FigureChange

__all__ = ["CSV_COLUMNS", "diff_csv", "diff_document", "paired_sparklines", "render_diff"]

CSV_COLUMNS = ("key", "base", "new", "change", "low", "high", "significant", "z_score", "rel_change", "note")

_MARKS = "▁▂▃▄▅▆▇█"

WITHIN_NOISE_ROWS = 10
"""Figures within noise shown in the table without ``--all`` (the closest to the threshold)."""


def diff_document(result: DiffResult) -> dict[str, Any]:
    """What ``diff --format json`` prints: ``figures`` (ranked, one object per figure with ``key``, ``base``,
    ``new``, ``change``, ``low``, ``high``, ``significant``), the runs, the figures only one run has, the findings
    only one run has and (both split by step) the per-step ``series``."""
    extra: dict[str, Any] = {
        "runs": {"base": result.base.to_json(), "new": result.new.to_json()},
        "z": result.z,
        "findings": result.findings,
        "figures": [figure.to_json() for figure in result.figures],
        "only_in": result.only_in,
        "series": result.series(),
    }
    return json_document(command="diff", inputs=[*result.base.result.inputs, *result.new.result.inputs],
                         config=result.config, metrics={}, extra=extra)


def diff_csv(result: DiffResult) -> str:
    """One row per figure in rank order (:data:`CSV_COLUMNS`); an empty cell where there is no value."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for figure in result.figures:
        row = figure.to_json()
        writer.writerow(["" if _missing(row[c]) else row[c] for c in CSV_COLUMNS])
    return buffer.getvalue()


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def paired_sparklines(
    base: Sequence[float | None], new: Sequence[float | None], width: int
) -> tuple[str, str]:
    """Two series as block characters on one shared scale (so their levels compare), a space where missing.

    Example:
        >>> paired_sparklines([0.0, 0.0, 0.0], [0.0, 1.0, 2.0], 3)
        ('▁▁▁', '▁▅█')
    """
    a, b = downsample(base, width), downsample(new, width)
    present = [v for v in (*a, *b) if v is not None]
    if not present:
        return " " * len(a), " " * len(b)
    lo, hi = min(present), max(present)

    def draw(points: Sequence[float | None]) -> str:
        if hi == lo:
            return "".join(" " if p is None else _MARKS[3] for p in points)
        return "".join(" " if p is None else _MARKS[round((p - lo) / (hi - lo) * 7)] for p in points)

    return draw(a), draw(b)


def _interval(figure: FigureChange) -> str:
    if figure.low is None or figure.high is None:
        return "—"
    return f"[{format_value(figure.low)}, {format_value(figure.high)}]"


def render_diff(console: Console, result: DiffResult, *, show_all: bool = False, trends: int = 12) -> None:
    """Findings only one run has first, then the figures ranked by how far beyond noise their change is
    (significant ones all; ``show_all`` or the :data:`WITHIN_NOISE_ROWS` closest of the rest), then the per-step
    series of the top ``trends`` figures side by side when both runs have steps."""
    base, new = result.base, result.new
    console.print(f"[bold]grpo-cli diff[/bold]: {new.label} vs {base.label} (change = {new.label} − {base.label}; "
                  f"interval ±{format_value(result.z)} jackknife s.e., widened by Student's t for few blocks)")
    for run in (base, new):
        console.print(f"  {run.label}: {', '.join(run.result.inputs)} ({run.n_blocks} {run.blocking} blocks)")
    if result.findings:
        table = Table(title="Findings in one run only", title_justify="left")
        for column in ("only in", "severity", "code", "title"):
            table.add_column(column)
        for finding in result.findings:
            label = base.label if finding["only_in"] == "base" else new.label
            table.add_row(label, str(finding.get("severity", "")), str(finding.get("code", "")),
                          str(finding.get("title", "")))
        console.print(table)
    significant = result.significant
    rest = [f for f in result.figures if not f.significant]
    shown = significant + (rest if show_all else rest[:WITHIN_NOISE_ROWS])
    title = (f"{len(significant)} of {len(result.figures)} figures changed beyond noise"
             if significant else f"No figure changed beyond noise ({len(result.figures)} compared)")
    table = Table(title=title, title_justify="left")
    table.add_column("figure", style="cyan", no_wrap=True)
    table.add_column(base.label, justify="right", no_wrap=True)
    table.add_column(new.label, justify="right", no_wrap=True)
    for column in ("change", "rel", "interval of change", "s.e."):
        table.add_column(column, justify="right", no_wrap=True)
    table.caption = "s.e.: |change| in standard errors; * beyond noise: the interval excludes 0"
    table.caption_justify = "left"
    for figure in shown:
        rel = "" if figure.rel_change is None else f"{figure.rel_change * 100:+.1f}%"
        z = "—" if figure.z_score is None else f"{figure.z_score:.1f}"
        style = "bold red" if figure.significant else ""
        table.add_row(figure.key, format_value(figure.base), format_value(figure.new), format_value(figure.change),
                      rel, _interval(figure), Text(z + (" *" if figure.significant else "  "), style=style))
    console.print(table)
    hidden = len(result.figures) - len(shown)
    if hidden:
        console.print(f"  … {hidden} more within noise (--all shows every figure)")
    for label, keys in ((base.label, result.only_in["base"]), (new.label, result.only_in["new"])):
        if keys:
            console.print(f"  only in {label}: {', '.join(keys)}")
    _render_series(console, result, shown[:trends])


def _render_series(console: Console, result: DiffResult, figures: Sequence[FigureChange]) -> None:
    wanted = {f.key for f in figures}
    series = [s for s in result.series() if s["key"] in wanted]
    if not series:
        return
    steps = series[0]["steps"]
    width = max(8, min(len(steps), 40, (console.width - 40) // 2))
    per_mark = f"; each mark is the mean of ≈{len(steps) / width:.3g} steps" if len(steps) > width else ""
    table = Table(title=f"Per step, one scale per row (steps {steps[0]} → {steps[-1]}{per_mark})",
                  title_justify="left")
    table.add_column("figure", style="cyan", no_wrap=True)
    table.add_column(result.base.label, no_wrap=True, min_width=width)
    table.add_column(result.new.label, no_wrap=True, min_width=width)
    for item in series:
        a, b = paired_sparklines(item["base"], item["new"], width)
        table.add_row(item["key"], Text(a, style="blue"), Text(b, style="green"))
    console.print(table)
