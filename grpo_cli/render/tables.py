"""Figures as Rich tables: sections with one-line meanings, the per-group table, and what was not computed."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli._format import format_value
from grpo_cli.metrics.registry import KEYS, SECTIONS, section_of
from grpo_cli.render.terminal import render_distributions, render_trends

__all__ = ["render_group_table", "render_omitted", "render_table"]


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
    prox = config.get("ratio_base") == "prox"
    top = metrics.get("top_kl")
    if top:
        table = Table(title="Highest-KL tokens (k3 vs old)", title_justify="left")
        values = ("kl", "ratio", "ratio_base", "new_logp", "old_logp") if prox else (
            "kl", "ratio", "new_logp", "old_logp")
        for column in ("file", "row", "position", *values):
            header = {"ratio": "ratio vs old", "ratio_base": "ratio vs prox"}.get(column, column)
            table.add_column(header, justify="right")
        merged = merge_identical_tokens(top, values)
        for record, rows in merged:
            table.add_row(*_location(record, inputs, rows), *(format_value(record.get(c)) for c in values))
        _note_merged(table, merged)
        console.print(table)
    top_ratio = metrics.get("top_ratio")
    if top_ratio:
        base = "prox" if prox else "old"
        table = Table(title=f"Highest-ratio tokens (π_θ / π_{base}; the first is ratio/max)", title_justify="left")
        for column in ("file", "row", "position", "ratio", "new_logp", f"{base}_logp"):
            table.add_column(column, justify="right")
        merged = merge_identical_tokens(top_ratio, ("ratio", "new_logp", "base_logp"))
        for record, rows in merged:
            table.add_row(*_location(record, inputs, rows),
                          *(format_value(record[c]) for c in ("ratio", "new_logp", "base_logp")))
        _note_merged(table, merged)
        console.print(table)
    render_omitted(console, omitted)


def _location(record: Mapping[str, Any], inputs: Sequence[str], rows: Sequence[int] = ()) -> tuple[str, str, str]:
    file_index = record["file"]
    name = os.path.basename(inputs[file_index]) if 0 <= file_index < len(inputs) else str(file_index)
    return name, row_ranges(rows or [record["row"]]), str(record["position"])


def row_ranges(rows: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` → ``3–5, 9``."""
    runs: list[list[int]] = []
    for row in sorted(rows):
        if runs and row == runs[-1][1] + 1:
            runs[-1][1] = row
        else:
            runs.append([row, row])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def merge_identical_tokens(
    records: Sequence[Mapping[str, Any]], values: Sequence[str]
) -> list[tuple[Mapping[str, Any], list[int]]]:
    """Top-token rows that differ only in their row (the same token of duplicated sequences: repeated prompts and
    identical samples) become one line listing the rows."""
    merged: list[tuple[Mapping[str, Any], list[int]]] = []
    index: dict[tuple[Any, ...], int] = {}
    for record in records:
        key = (record["file"], record["position"], *(record.get(c) for c in values))
        if key in index:
            merged[index[key]][1].append(record["row"])
        else:
            index[key] = len(merged)
            merged.append((record, [record["row"]]))
    return merged


def _note_merged(table: Table, merged: Sequence[tuple[Mapping[str, Any], list[int]]]) -> None:
    if any(len(rows) > 1 for _, rows in merged):
        table.caption = "rows with identical values are merged (the same token in duplicated sequences)"


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
