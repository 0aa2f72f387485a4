"""Charts made of characters: per-step sparklines and bar histograms of the ratio, |Δlogp| and lag distributions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.bar import Bar
from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli._format import format_value

__all__ = ["distribution_rows", "downsample", "render_distributions", "render_trends", "sparkline", "trend_sparkline"]


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
    as a table. Each histogram's first row also shows all of its bins as one :func:`sparkline`."""
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
