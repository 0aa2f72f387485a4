"""Every user-facing rendering: Rich tables, strict JSON and CSV. Nothing else prints results.

Environment handling (``NO_COLOR``, not a TTY, terminal width) lives in :func:`make_console` alone.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli import __version__
from grpo_cli.keys import KEYS, SECTIONS, section_of

__all__ = [
    "JSON_SCHEMA_VERSION",
    "dumps_json",
    "json_document",
    "make_console",
    "render_group_table",
    "render_table",
    "to_csv",
]

JSON_SCHEMA_VERSION = 1


def make_console(*, stderr: bool = False, file: TextIO | None = None, record: bool = False) -> Console:
    """A console that honours ``NO_COLOR`` and writes plain text when not attached to a terminal."""
    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    no_color = bool(os.environ.get("NO_COLOR"))
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(
        file=stream,
        no_color=no_color or not is_tty,
        highlight=False,
        soft_wrap=False,
        record=record,
        width=None if is_tty else 120,
        color_system="auto" if is_tty and not no_color else None,
    )


def _strict(value: Any) -> Any:
    """Non-finite floats become ``null``: the JSON stays strict (RFC 8259) and nothing pretends to be a number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def json_document(
    *,
    command: str,
    inputs: list[str],
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    omitted: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON envelope every command shares (``schema_version`` first)."""
    doc: dict[str, Any] = {
        "schema_version": JSON_SCHEMA_VERSION,
        "tool": {"name": "grpo-cli", "version": __version__, "command": command},
        "inputs": inputs,
        "config": dict(config),
        "metrics": dict(metrics),
        "omitted": dict(omitted or {}),
    }
    if extra:
        doc.update(extra)
    return _strict(doc)


def dumps_json(document: Mapping[str, Any]) -> str:
    return json.dumps(document, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def to_csv(metrics: Mapping[str, Any], groups: list[dict[str, Any]] | None = None) -> str:
    """Long form ``metric,value``, or ``group,metric,value`` with groups (the overall figures have group ``all``).

    List-valued figures (``top_kl``) are JSON-encoded in their cell.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")

    def rows(values: Mapping[str, Any]) -> list[list[Any]]:
        out = []
        for key, value in _strict(dict(values)).items():
            if isinstance(value, (list, dict)):
                value = json.dumps(value, allow_nan=False, separators=(",", ":"))
            out.append([key, "" if value is None else value])
        return out

    if groups is None:
        writer.writerow(["metric", "value"])
        writer.writerows(rows(metrics))
    else:
        writer.writerow(["group", "metric", "value"])
        writer.writerows(["all", *row] for row in rows(metrics))
        for group in groups:
            writer.writerows([group["key"], *row] for row in rows(group["metrics"]))
    return buffer.getvalue()


def render_group_table(console: Console, group_by: str, groups: list[dict[str, Any]], metrics: list[str]) -> None:
    """One row per group value (e.g. per step), the chosen metrics as columns."""
    table = Table(title=f"Per {group_by}", title_justify="left")
    table.add_column(group_by, justify="right", style="cyan")
    for name in metrics:
        table.add_column(name, justify="right")
    for group in groups:
        values = group["metrics"]
        table.add_row(str(group["key"]), *(format_value(values[m]) if m in values else "–" for m in metrics))
    console.print(table)


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1e5 or magnitude < 1e-3:
            return f"{value:.4e}"
        return f"{value:.6g}"
    return str(value)


_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(counts: list[int]) -> str:
    """One character per count, scaled to the largest; any non-zero count shows at least ``▁``."""
    top = max(counts, default=0)
    if top <= 0:
        return " " * len(counts)
    return "".join(_BARS[0 if c <= 0 else max(1, math.ceil(8 * c / top))] for c in counts)


def render_distributions(console: Console, metrics: Mapping[str, Any]) -> None:
    """The ``*/hist`` figures as one-line text histograms, and ``by_staleness`` as a table (issue 4 §4, §5)."""
    table = Table(title="Distributions", title_justify="left", expand=False)
    for column, justify in (("distribution", "left"), ("from", "right"), ("histogram", "left"), ("to", "left")):
        table.add_column(column, justify=justify, no_wrap=True)
    table.add_column("outside", style="dim")
    for key, hist in metrics.items():
        if not key.endswith("/hist"):
            continue
        if isinstance(hist, dict):  # log-spaced view of a value distribution
            outside = f"{hist['below']:,} below ({hist['zero']:,} zero), {hist['above']:,} above"
            edges = hist["edges"]
            table.add_row(key, format_value(edges[0]), sparkline(hist["counts"]), format_value(edges[-1]), outside)
        elif hist:  # tokens per lag
            lags = [r for r in hist if not (r.get("overflow") or r.get("underflow"))]
            extra = [r for r in hist if r.get("overflow") or r.get("underflow")]
            per_lag = {r["lag"]: r["n_tokens"] for r in lags}
            low, high = (min(per_lag), max(per_lag)) if per_lag else (0, -1)
            counts = [per_lag.get(lag, 0) for lag in range(low, high + 1)]
            outside = ", ".join(
                f"{'≥' if r.get('overflow') else '<'}{max(r['lag'], 0)}: {r['n_tokens']:,}" for r in extra
            )
            table.add_row(key, f"lag {low}", sparkline(counts), f"lag {high}", outside)
    if table.row_count:
        console.print(table)
    rows = metrics.get("by_staleness")
    if rows:
        fields = [f for f in ("n_tokens", "kl/k3", "clip/ratio", "is/mean", "abs_diff/mean") if f in rows[0]]
        table = Table(title="By staleness (lag = current − version)", title_justify="left", expand=False)
        table.add_column("lag", justify="right", style="cyan")
        for name in fields:
            table.add_column(name, justify="right")
        for row in rows:
            lag = f"≥{row['lag']}" if row.get("overflow") else "<0" if row.get("underflow") else str(row["lag"])
            table.add_row(lag, *(format_value(row[name]) for name in fields))
        console.print(table)


def render_table(
    console: Console,
    *,
    title: str,
    metrics: Mapping[str, Any],
    omitted: Mapping[str, str],
    inputs: list[str],
    config: Mapping[str, Any],
    sources: Mapping[str, str] | None = None,
) -> None:
    """Figures grouped in sections with one-line meanings, then what was not computed and why.

    ``sources`` maps displayed keys renamed by ``--names`` to grpo-cli's keys (for their section and meaning).
    """
    sources = sources or {}
    config_text = ", ".join(f"{k}={format_value(v)}" for k, v in config.items())
    console.print(Text(f"{title} — {len(inputs)} file(s): {', '.join(inputs[:3])}{' …' if len(inputs) > 3 else ''}"))
    console.print(Text(f"config: {config_text}", style="dim"))
    by_section: dict[str, list[str]] = {}
    for key in metrics:
        if isinstance(metrics[key], (list, dict)):
            continue
        by_section.setdefault(section_of(sources.get(key, key)), []).append(key)
    order = list(SECTIONS) + [s for s in by_section if s not in SECTIONS]
    for section in order:
        keys = by_section.get(section)
        if not keys:
            continue
        table = Table(title=SECTIONS.get(section, section), title_justify="left", expand=False)
        table.add_column("metric", style="cyan", no_wrap=True)
        table.add_column("value", justify="right", no_wrap=True)
        table.add_column("meaning", style="dim")
        for key in keys:
            origin = sources.get(key, key)
            meaning = KEYS[origin].meaning if origin in KEYS else ""
            table.add_row(key, format_value(metrics[key]), f"{origin}: {meaning}" if origin != key else meaning)
        console.print(table)
    render_distributions(console, metrics)
    top = metrics.get("top_kl")
    if top:
        table = Table(title="Highest-KL tokens (k3 vs old)", title_justify="left")
        for column in ("file", "row", "position", "kl", "ratio", "new_logp", "old_logp"):
            table.add_column(column, justify="right")
        for record in top:
            file_index = record["file"]
            name = os.path.basename(inputs[file_index]) if 0 <= file_index < len(inputs) else str(file_index)
            table.add_row(
                name,
                str(record["row"]),
                str(record["position"]),
                *(format_value(record[c]) for c in ("kl", "ratio", "new_logp", "old_logp")),
            )
        console.print(table)
    if omitted:
        table = Table(title="Not computed", title_justify="left", style="dim")
        table.add_column("metric", style="dim")
        table.add_column("why", style="dim")
        for key, reason in omitted.items():
            table.add_row(key, reason)
        console.print(table)
