"""The ``compare-prox`` table: methods side by side, staleness lags as rows, one verdict line per method.

Kept next to :mod:`grpo_cli.render.tables` (whose console, number format and "Not computed" conventions it reuses);
JSON and CSV go through :mod:`grpo_cli.render.documents` unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from grpo_cli._format import format_value
from grpo_cli.commands.compare_prox import lag_label
from grpo_cli.metrics.prox import PROX_FIGURE_MEANINGS
from grpo_cli.render.tables import render_omitted, render_table

if TYPE_CHECKING:
    from grpo_cli.commands.compare_prox import CompareProxResult

__all__ = ["SUMMARY_ROWS", "render_compare_prox", "render_compare_prox_table"]

SUMMARY_ROWS: tuple[str, ...] = (
    "abs_error_mean",
    "abs_error_p99",
    "abs_error_max",
    "rel_error_mean",
    "rmse",
    "behave_imp_weight_abs_error_mean",
    "behave_imp_weight_rel_error_mean",
    "importance_weight_abs_error_mean",
    "importance_weight_rel_error_mean",
    "clip_flip_frac",
    "behave_weight_flip_frac",
    "loss_ppo",
    "loss_abs_error",
    "loss_rel_error",
    "max_safe_lag",
)
"""The summary table's rows (figures; their meanings come from :data:`grpo_cli.metrics.prox.PROX_FIGURE_MEANINGS`)."""


def render_compare_prox(
    console: Console, result: CompareProxResult, labels: Mapping[str, str], *, methods: Sequence[str],
    tolerance: float,
) -> None:
    """``compare-prox``'s screen: the side-by-side table, or under ``--names`` (renamed keys, ``labels`` non-empty)
    the plain sectioned table, since the side-by-side layout reads grpo-cli's keys."""
    if labels:
        render_table(console, title="grpo-cli compare-prox", metrics=result.metrics, omitted=result.omitted,
                     inputs=result.inputs, config=result.config, sources=labels)
        return
    render_compare_prox_table(console, metrics=result.metrics, omitted=result.omitted, inputs=result.inputs,
                              config=result.config, methods=methods, recommendations=result.recommendations,
                              tolerance=tolerance)


def _short(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value != 0 and 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return format_value(value)


def render_compare_prox_table(
    console: Console,
    *,
    metrics: Mapping[str, Any],
    omitted: Mapping[str, str],
    inputs: Sequence[str],
    config: Mapping[str, Any],
    methods: Sequence[str],
    recommendations: Mapping[str, str],
    tolerance: float,
) -> None:
    """Print the summary (figures × methods), the by-staleness table (lags × methods) and the verdicts."""
    config_text = ", ".join(f"{k}={format_value(v)}" for k, v in config.items() if k != "methods")
    files = ", ".join(inputs[:3]) + (" …" if len(inputs) > 3 else "")
    console.print(Text(f"grpo-cli compare-prox — {len(inputs)} file(s): {files}"))
    console.print(Text(f"config: {config_text}", style="dim"))
    counts = [("sequences", "n_sequences"), ("tokens", "n_tokens"), ("valid", "n_valid_tokens"),
              ("compared (valid, generated)", "prox/n_tokens"), ("loss/ppo with the truth", "prox/loss_ppo")]
    console.print(Text("; ".join(f"{label} {format_value(metrics[k])}" for label, k in counts if k in metrics)))

    summary = Table(title="Approximation vs recomputed prox_logp (valid generated tokens)", title_justify="left")
    summary.add_column("figure", style="cyan", no_wrap=True)
    for m in methods:
        summary.add_column(m, justify="right", no_wrap=True)
    summary.add_column("meaning", style="dim")
    for figure in SUMMARY_ROWS:
        keys = [f"prox/{m}/{figure}" for m in methods]
        if not any(k in metrics for k in keys):
            continue
        cells: list[str | Text] = [format_value(metrics[k]) if k in metrics else "—" for k in keys]
        summary.add_row(figure, *cells, PROX_FIGURE_MEANINGS.get(figure, ""))
    if summary.row_count:
        console.print(summary)

    # Rows keyed by (negative-lag bin last, lag): the order analyze's by_staleness uses.
    by_lag: dict[tuple[bool, int], dict[str, Mapping[str, Any]]] = {}
    for m in methods:
        for row in metrics.get(f"prox/{m}/by_staleness") or []:
            by_lag.setdefault((bool(row.get("underflow")), row["lag"]), {})[m] = row
    if by_lag:
        title = f"By staleness lag k = v_θ − v_b (* abs_error_mean > tolerance {tolerance:g})"
        table = _lag_table(title, by_lag, methods, tolerance)
        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        if natural <= console.width or len(methods) == 1:
            console.print(table)
        else:  # too wide for this terminal (3 methods × 3 columns): one table per method, nothing cut
            for m in methods:
                console.print(_lag_table(f"{title} — {m}", by_lag, [m], tolerance))

    if recommendations:
        console.print(Text(f"Max safe lag (tolerance {tolerance:g} on abs_error_mean):", style="bold"))
        for m in methods:
            if m in recommendations:
                console.print(Text(f"  {recommendations[m]}"))
    render_omitted(console, omitted)


def _lag_table(
    title: str, by_lag: Mapping[tuple[bool, int], Mapping[str, Mapping[str, Any]]], methods: Sequence[str],
    tolerance: float,
) -> Table:
    """Lags as rows; per method |err|, rmse and (when computed) the clip-flip fraction."""
    table = Table(title=title, title_justify="left")
    table.add_column("lag", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    with_clip = any("clip_flip_frac" in r for rows in by_lag.values() for r in rows.values())
    prefix = len(methods) > 1
    for m in methods:
        table.add_column(f"{m}\n|err|" if prefix else "|err|", justify="right", no_wrap=True)
        table.add_column(f"{m}\nrmse" if prefix else "rmse", justify="right", no_wrap=True)
        if with_clip:
            table.add_column(f"{m}\nclip flip" if prefix else "clip flip", justify="right", no_wrap=True)
    for key in sorted(by_lag):
        rows = by_lag[key]
        first = next(iter(rows.values()))
        cells: list[Any] = [lag_label(first), format_value(first["n_tokens"])]
        for m in methods:
            row = rows.get(m)
            if row is None:
                cells += ["—"] * (3 if with_clip else 2)
                continue
            err = row["abs_error_mean"]
            flag = "" if err <= tolerance else "*"
            cells.append(Text(_short(err) + flag, style="red" if flag else ""))
            cells.append(_short(row["rmse"]))
            if with_clip:
                cells.append(_short(row["clip_flip_frac"]) if "clip_flip_frac" in row else "—")
        table.add_row(*cells)
    return table
