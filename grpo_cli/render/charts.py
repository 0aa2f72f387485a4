"""The report's charts: matplotlib figures (object API, no pyplot state) rendered to inline SVG strings.

Byte-identical output for the same input: every figure is built inside one :func:`matplotlib.rc_context` that pins
``svg.hashsalt`` (ids are hashes, not random), ``svg.fonttype = "none"`` (real ``<text>``, smaller, selectable) and
the style; ``savefig`` gets no date or creator metadata; constrained layout keeps labels inside the figure.
:func:`inline_svg` then makes the SVG safe to paste into an HTML page next to others: prolog and metadata dropped,
every ``id`` and reference to it prefixed with the figure's own id, namespace declarations (the only URLs in
matplotlib's output) removed — HTML parses inline ``<svg>`` without them.

Example:
    >>> svg = trend_chart("fig-demo", [0, 1, 2], {"kl/k3": [0.1, 0.2, None]}, ylabel="KL")  # doctest: +SKIP
    >>> svg.startswith("<svg") and 'id="fig-demo-' in svg  # doctest: +SKIP
    True
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "RC",
    "heatmap_chart",
    "histogram_chart",
    "inline_svg",
    "prox_lag_chart",
    "trend_chart",
]

RC: dict[str, Any] = {
    "svg.hashsalt": "grpo-cli-report",
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.labelsize": 9.0,
    "axes.grid": True,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "grid.alpha": 0.35,
    "grid.linewidth": 0.6,
    "legend.fontsize": 8.0,
    "legend.frameon": False,
    "lines.linewidth": 1.4,
    "xtick.labelsize": 8.0,
    "ytick.labelsize": 8.0,
    "figure.facecolor": "white",
}
"""rcParams every chart is drawn with (in an ``rc_context``, never globally), plus the colour cycle :data:`PALETTE`."""

# Okabe–Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
BAND_COLOUR = "#E69F00"
WIDTH_IN = 5.6
HEIGHT_IN = 2.7

# No date (the output must not depend on when it was made) and no creator (it names the matplotlib version); the
# whole <metadata> block is dropped by inline_svg anyway.
_METADATA: dict[str, Any] = {"Date": None, "Creator": None}


def _rc() -> dict[Any, Any]:  # Any keys: matplotlib types rc_context keys as a Literal of rc names
    from cycler import cycler

    return {**RC, "axes.prop_cycle": cycler(color=list(PALETTE))}


def _figure(height: float = HEIGHT_IN, width: float = WIDTH_IN) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


_ID = re.compile(r'\bid="([^"]+)"')
_URL_REF = re.compile(r"url\(#([^)]+)\)")
_HREF = re.compile(r'(?:xlink:)?href="#([^"]+)"')
_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.S)
_METADATA_BLOCK = re.compile(r"\s*<metadata>.*?</metadata>", re.S)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')
_SIZE = re.compile(r'(<svg\b[^>]*?)\s+width="[^"]*"\s+height="[^"]*"')


def inline_svg(svg: str, prefix: str) -> str:
    """``svg`` (matplotlib's output) ready for inlining in HTML under the unique id ``prefix``.

    Example:
        >>> inline_svg('<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10pt" height="5pt" '
        ...            'viewBox="0 0 10 5"><g id="a" clip-path="url(#b)"><use xlink:href="#c"/></g></svg>', "f")
        '<svg id="f" viewBox="0 0 10 5" role="img"><g id="f-a" clip-path="url(#f-b)"><use href="#f-c"/></g></svg>'
    """
    svg = _PROLOG.sub("", svg, count=1)
    svg = _METADATA_BLOCK.sub("", svg)
    svg = _XMLNS.sub("", svg)
    svg = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = _URL_REF.sub(lambda m: f"url(#{prefix}-{m.group(1)})", svg)
    svg = _HREF.sub(lambda m: f'href="#{prefix}-{m.group(1)}"', svg)
    # Size comes from CSS (width: 100%) and the viewBox's aspect ratio.
    svg = _SIZE.sub(r"\1", svg, count=1)
    svg = svg.replace("<svg", f'<svg id="{prefix}"', 1).replace(" version=\"1.1\"", "", 1)
    head, _, rest = svg.partition(">")
    return f'{head} role="img">{rest}'.strip()


def _to_svg(fig: Figure, prefix: str) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata=_METADATA)
    return inline_svg(buffer.getvalue(), prefix)


def _nan(values: Sequence[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan
            for v in values]


def trend_chart(
    prefix: str,
    x: Sequence[int],
    series: Mapping[str, Sequence[float | None]],
    *,
    ylabel: str,
    xlabel: str = "step",
    hline: tuple[float, str] | None = None,
    base_x: Sequence[int] = (),
    base_series: Mapping[str, Sequence[float | None]] | None = None,
    base_label: str = "base",
) -> str:
    """Lines of ``series`` (label → one value per ``x``; ``None`` leaves a gap) over ``x``; with ``base_series``
    (``report --compare``), the base run's lines of the same labels over ``base_x``, dashed in the same colours."""
    from matplotlib import rc_context
    from matplotlib.ticker import MaxNLocator, StrMethodFormatter

    with rc_context(_rc()):
        fig = _figure()
        ax = fig.add_subplot()
        marker = "o" if len(x) <= 30 else None
        for label, values in series.items():
            (line,) = ax.plot(list(x), _nan(values), label=label, marker=marker, markersize=3)
            if base_series is not None and label in base_series:
                ax.plot(list(base_x), _nan(base_series[label]), label=f"{label} ({base_label})", color=line.get_color(),
                        linestyle="--", linewidth=1.0, alpha=0.8)
        n_base = sum(1 for label in series if base_series is not None and label in base_series)
        if hline is not None:
            ax.axhline(hline[0], color="#555555", linestyle="--", linewidth=0.9, label=hline[1])
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are integers: no 0.5 ticks
        linthresh = _spike_threshold([v for values in series.values() for v in _nan(values)])
        if linthresh is not None:
            # One spike would flatten every other point into a line at 0: linear up to the typical size, then log
            # (matplotlib's "symlog" scale; the label says so).
            ax.set_yscale("symlog", linthresh=linthresh)
            ylabel = f"{ylabel} (symlog above {linthresh:.3g})"
        ax.set_ylabel(ylabel)
        # Each tick carries its own value: matplotlib's shared "1e6" offset label would collide with the legend.
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.3g}"))
        ax.margins(x=0.01)
        _legend(ax, len(series) + n_base + (hline is not None))
        return _to_svg(fig, prefix)


SPIKE_FACTOR = 20.0
"""A trend gets a symlog axis when its largest |value| exceeds this many times the median |value|."""


def _spike_threshold(values: Sequence[float]) -> float | None:
    """The linear range of a symlog axis (the median |value|) when one outlier dwarfs the rest, else ``None``."""
    finite = sorted(abs(v) for v in values if math.isfinite(v))
    if len(finite) < 5:
        return None
    median = finite[len(finite) // 2]
    if median <= 0 or finite[-1] <= SPIKE_FACTOR * median:
        return None
    return median


def _legend(ax: Axes, n: int) -> None:
    if n > 1:
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncols=min(n, 4), borderaxespad=0.2,
                  handlelength=1.6, columnspacing=1.0)


def histogram_chart(
    prefix: str,
    hist: Mapping[str, Any],
    *,
    xlabel: str,
    band: tuple[float, float, str] | None = None,
    vlines: Sequence[tuple[float, str]] = (),
    plain_ticks: bool = False,
) -> str:
    """A log–log bar histogram of an ``analyze`` ``*/hist`` figure (log-spaced ``edges``, ``counts``; the tokens
    outside its range are for the caption), with an optional shaded ``band`` (low, high, label), dashed ``vlines``
    and, with ``plain_ticks``, x ticks at round numbers (0.5, 0.8, 1, 1.2, …) instead of powers of ten."""
    from matplotlib import rc_context
    from matplotlib.ticker import FixedLocator, NullFormatter, StrMethodFormatter

    edges, counts = list(hist["edges"]), list(hist["counts"])
    with rc_context(_rc()):
        fig = _figure()
        ax = fig.add_subplot()
        lefts = edges[:-1]
        widths = [b - a for a, b in itertools.pairwise(edges)]
        if len(edges) == 2 and widths[0] == 0:  # one value only: a visible sliver around it
            lefts, widths = [edges[0] * 0.98], [edges[0] * 0.04]
        ax.bar(lefts, counts, width=widths, align="edge", log=True, color=PALETTE[0], edgecolor="white",
               linewidth=0.4, label="valid tokens")
        handles = 1
        if band is not None:
            ax.axvspan(band[0], band[1], color=BAND_COLOUR, alpha=0.2, linewidth=0, label=band[2], zorder=0.5)
            handles += 1
        for (value, label), colour in zip(vlines, PALETTE[1:]):
            ax.axvline(value, color=colour, linestyle="--", linewidth=1.3, label=label, zorder=3)
            handles += 1
        ax.set_xscale("log")
        if plain_ticks:
            low, high = edges[0], edges[-1]
            ticks = [t for t in _ROUND_TICKS if low <= t <= high]
            if len(ticks) >= 2:
                ax.xaxis.set_major_locator(FixedLocator(ticks))
                ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens (log)")
        _legend(ax, handles)
        return _to_svg(fig, prefix)


_ROUND_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def _lag_label(row: Mapping[str, Any]) -> str:
    if row.get("underflow"):
        return "< 0"
    if row.get("overflow"):
        return f"≥ {row['lag']}"
    return str(row["lag"])


def heatmap_chart(prefix: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Staleness lag (rows of ``by_staleness``) × figure (``columns``: key, how it is coloured).

    Each column is coloured on its own scale (min → pale, max → dark): ``"value"`` by the figure itself,
    ``"dev1"`` by its distance from 1 (an importance-weight mean should be 1). Cells carry the figure's value.
    """
    from matplotlib import rc_context

    n_rows, n_cols = len(rows), len(columns)
    shade = [[0.0] * n_cols for _ in range(n_rows)]
    for j, (key, mode) in enumerate(columns):
        values = [row.get(key) for row in rows]
        scores = [None if v is None else abs(v - 1) if mode == "dev1" else v for v in values]
        present = [s for s in scores if s is not None and math.isfinite(s)]
        lo, hi = (min(present), max(present)) if present else (0.0, 0.0)
        for i, s in enumerate(scores):
            shade[i][j] = 0.0 if s is None or not math.isfinite(s) or hi == lo else (s - lo) / (hi - lo)
    with rc_context({**_rc(), "axes.grid": False}):
        fig = _figure(height=min(1.0 + 0.32 * n_rows, 12.0), width=WIDTH_IN)
        ax = fig.add_subplot()
        ax.pcolormesh(shade, cmap="Blues", vmin=0.0, vmax=1.3, edgecolors="white", linewidth=1.0)
        for i, row in enumerate(rows):
            for j, (key, _) in enumerate(columns):
                value = row.get(key)
                text = "–" if value is None else f"{value:.4g}"
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8,
                        color="white" if shade[i][j] > 0.7 else "#222222")
        ax.set_xticks([j + 0.5 for j in range(n_cols)], [key for key, _ in columns])
        ax.xaxis.tick_top()
        ax.set_yticks([i + 0.5 for i in range(n_rows)],
                      [f"lag {_lag_label(r)} ({r['n_tokens']:,} tok)" for r in rows])
        ax.invert_yaxis()
        ax.tick_params(length=0)
        for side in ("left", "bottom", "top", "right"):
            ax.spines[side].set_visible(False)
        return _to_svg(fig, prefix)


def prox_lag_chart(
    prefix: str,
    by_method: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    tolerance: float,
    safe_lags: Mapping[str, int | None],
) -> str:
    """``compare-prox``: each method's mean |ℓp̂ − ℓp*| per staleness lag, the tolerance line and each method's
    max safe lag (a marker ring). Lags below 0 are left out (no approximation applies there)."""
    from matplotlib import rc_context

    with rc_context(_rc()):
        fig = _figure()
        ax = fig.add_subplot()
        every: list[float] = []
        ticks: dict[int, str] = {}
        for colour, (method, rows) in zip(PALETTE, by_method.items()):
            kept = [r for r in rows if not r.get("underflow")]
            x = [r["lag"] for r in kept]
            y = _nan([r["abs_error_mean"] for r in kept])
            every += [v for v in y if not math.isnan(v)]
            ticks.update({r["lag"]: _lag_label(r) for r in kept})
            ax.plot(x, y, marker="o", markersize=3.5, color=colour, label=method)
            safe = safe_lags.get(method)
            if safe is not None and safe in x:
                ax.plot([safe], [y[x.index(safe)]], marker="o", markersize=9, markerfacecolor="none",
                        markeredgecolor=colour, linestyle="none")
        ax.axhline(tolerance, color="#555555", linestyle="--", linewidth=0.9, label=f"tolerance {tolerance:g}")
        if every and min(every) > 0:
            ax.set_yscale("log")
        if len(ticks) <= 20:
            ax.set_xticks(sorted(ticks), [ticks[k] for k in sorted(ticks)])
        ax.set_xlabel("staleness lag k = v_θ − v_b (ring: max safe lag)")
        ax.set_ylabel("mean |ℓp̂ − ℓp*|")
        _legend(ax, len(by_method) + 1)
        return _to_svg(fig, prefix)
