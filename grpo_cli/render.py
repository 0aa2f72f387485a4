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
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rich.bar import Bar
from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli import __version__
from grpo_cli.keys import KEYS, SECTIONS, section_of

__all__ = [
    "JSON_SCHEMA_VERSION",
    "distribution_rows",
    "downsample",
    "dumps_json",
    "json_document",
    "make_console",
    "render_distributions",
    "render_group_table",
    "render_omitted",
    "render_table",
    "render_trends",
    "sparkline",
    "to_csv",
    "trend_sparkline",
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
    render_trends(console, group_by, groups, metrics)


def _number(value: Any) -> float | None:
    """A finite figure as float; anything else (absent, null, non-finite, a list) as ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def downsample(values: Sequence[float | None], width: int) -> list[float | None]:
    """Bucket means of ``values`` in at most ``width`` buckets; bucket ``i`` holds ``values[⌊i·n/w⌋ : ⌊(i+1)·n/w⌋]``.

    Missing values (``None``, NaN, ±inf) are left out of their bucket's mean; a bucket with none left is ``None``.
    Series no longer than ``width`` come back unchanged (never stretched).

    Example:
        >>> downsample([1, 3, 5, 7, None, 9], 3)
        [2.0, 6.0, 9.0]
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    n = len(values)
    if n <= width:
        return [_number(v) for v in values]
    out: list[float | None] = []
    for i in range(width):
        bucket = [x for x in (_number(v) for v in values[i * n // width : (i + 1) * n // width]) if x is not None]
        out.append(math.fsum(bucket) / len(bucket) if bucket else None)
    return out


_TREND = "▁▂▃▄▅▆▇█"


def trend_sparkline(values: Sequence[float | None], width: int) -> str:
    """A series as block characters, one per bucket of :func:`downsample`, min–max scaled to ``▁``…``█``.

    A missing bucket is a space; a flat series is all ``▄`` (no extreme to point at).

    Example:
        >>> trend_sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8)
        '▁▂▃▄▅▆▇█'
        >>> trend_sparkline([2, None, 2], 3)
        '▄ ▄'
    """
    points = downsample(values, width)
    present = [p for p in points if p is not None]
    if not present:
        return " " * len(points)
    lo, hi = min(present), max(present)
    if hi == lo:
        return "".join(" " if p is None else _TREND[3] for p in points)
    return "".join(" " if p is None else _TREND[round((p - lo) / (hi - lo) * 7)] for p in points)


def render_trends(console: Console, group_by: str, groups: list[dict[str, Any]], metrics: list[str]) -> None:
    """One row per numeric metric: its sparkline over the group values (ascending) and first/last/min/max."""
    rows = []
    for name in metrics:
        series = [_number(group["metrics"].get(name)) for group in groups]
        present = [v for v in series if v is not None]
        if present:
            rows.append((name, series, present))
    if not rows:
        return
    n = len(groups)
    # What the other columns take: name, four numbers of up to 11 characters, 6 × (2 padding + 1 border) + 1.
    reserved = max(len(name) for name, _, _ in rows) + 4 * 11 + 19
    width = max(8, min(n, 60, console.width - reserved))
    per_mark = f"; each mark is the mean of ≈{n / width:.3g}" if n > width else ""
    table = Table(title=f"Trend over {group_by} ({n} values, ascending{per_mark})", title_justify="left")
    table.add_column("metric", style="cyan", no_wrap=True)
    table.add_column(f"{group_by} {groups[0]['key']} → {groups[-1]['key']}", no_wrap=True, min_width=width)
    for column in ("first", "last", "min", "max"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, series, present in rows:
        table.add_row(
            name,
            Text(trend_sparkline(series, width), style="green"),
            *(format_value(v) for v in (present[0], present[-1], min(present), max(present))),
        )
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


def _edge(value: float) -> str:
    return f"{value:.4g}"


def distribution_rows(hist: Any, max_rows: int = 8) -> list[tuple[str, int]]:
    """A ``*/hist`` figure as ``(bin label, tokens)`` rows for a bar histogram.

    Log-spaced views (``{"edges", "counts", "below", "above", "zero"}``) merge runs of adjacent bins into at most
    ``max_rows`` rows (counts add exactly), with ``< lo`` / ``> hi`` rows when tokens lie outside. Per-lag lists
    (``staleness/hist``) give one row per lag from the smallest to the largest seen (missing lags count 0), merged
    into ranges when there are more than ``2 * max_rows``; the overflow and negative-lag bins come last.

    Example:
        >>> distribution_rows({"edges": [1, 2, 4, 8], "counts": [1, 2, 3], "below": 0, "above": 4, "zero": 0}, 2)
        [('1 – 4', 3), ('4 – 8', 3), ('> 8', 4)]
    """
    rows: list[tuple[str, int]] = []
    if isinstance(hist, Mapping):
        edges, counts = hist["edges"], hist["counts"]
        n = len(counts)
        step = max(1, math.ceil(n / max_rows))
        if hist["below"]:
            zero = f" ({hist['zero']:,} are 0)" if hist["zero"] else ""
            rows.append((f"< {_edge(edges[0])}{zero}", hist["below"]))
        for i in range(0, n, step):
            rows.append((f"{_edge(edges[i])} – {_edge(edges[min(i + step, n)])}", sum(counts[i : i + step])))
        if hist["above"]:
            rows.append((f"> {_edge(edges[-1])}", hist["above"]))
        return rows
    regular = {r["lag"]: r["n_tokens"] for r in hist if not (r.get("overflow") or r.get("underflow"))}
    if regular:
        low, high = min(regular), max(regular)
        step = max(1, math.ceil((high - low + 1) / (2 * max_rows)))
        for first in range(low, high + 1, step):
            last = min(first + step - 1, high)
            label = f"lag {first}" if first == last else f"lag {first}–{last}"
            rows.append((label, sum(regular.get(lag, 0) for lag in range(first, last + 1))))
    for r in hist:
        if r.get("overflow"):
            rows.append((f"lag ≥ {r['lag']}", r["n_tokens"]))
        elif r.get("underflow"):
            rows.append(("lag < 0", r["n_tokens"]))
    return rows


_BAR_WIDTH = 32


def render_distributions(console: Console, metrics: Mapping[str, Any]) -> None:
    """The ``*/hist`` figures as bar histograms (one row per bin, :func:`distribution_rows`) and ``by_staleness``
    as a table (issue 4 §4, §5). Each histogram's first row also shows all of its bins as one :func:`sparkline`."""
    table = Table(title="Distributions (valid tokens per bin)", title_justify="left", expand=False)
    table.add_column("distribution", style="cyan", no_wrap=True)
    table.add_column("bin", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True, min_width=_BAR_WIDTH)
    for key, hist in metrics.items():
        if not key.endswith("/hist") or not hist:
            continue
        bins = distribution_rows(hist)
        if isinstance(hist, Mapping):
            overview = f"all {len(hist['counts'])} log bins: {sparkline(hist['counts'])}"
        else:
            overview = f"per lag: {sparkline([count for _, count in bins])}"
        if table.row_count:
            table.add_section()
        table.add_row(key, "", "", Text(overview, style="dim"))
        top = max((count for _, count in bins), default=0)
        for label, count in bins:
            # A non-zero count shows at least a sliver (1/8 of a cell) so a thin tail never looks empty.
            end = max(count, top / (8 * _BAR_WIDTH)) if count else 0
            table.add_row("", label, f"{count:,}", Bar(max(top, 1), 0, end, width=_BAR_WIDTH, color="blue"))
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
    render_omitted(console, omitted)


def render_omitted(console: Console, omitted: Mapping[str, str]) -> None:
    """The figures that were not computed, each with the reason (nothing when every figure was)."""
    if not omitted:
        return
    table = Table(title="Not computed", title_justify="left", style="dim")
    table.add_column("metric", style="dim")
    table.add_column("why", style="dim")
    for key, reason in omitted.items():
        table.add_row(key, reason)
    console.print(table)
