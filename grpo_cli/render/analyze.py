"""``analyze``'s outputs: the terminal screen (findings, headline or every table, the per-group table), its CSV,
and the per-group table's columns (``--metrics``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from grpo_cli.errors import UsageError
from grpo_cli.render.documents import to_csv, to_wide_csv
from grpo_cli.render.findings import render_findings, render_headline, render_rescaling
from grpo_cli.render.tables import render_group_table, render_table

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.engine.run import AnalysisResult

__all__ = ["DEFAULT_GROUP_METRICS", "analyze_csv", "group_table_metrics", "render_analyze"]

DEFAULT_GROUP_METRICS = ("n_valid_tokens", "kl/k3", "clip/ratio", "ratio/max", "logp/diff_mean")
"""The per-group table's columns without ``--metrics`` (each as far as reported)."""


def group_table_metrics(names: str | None, result: AnalysisResult, labels: Mapping[str, str]) -> list[str]:
    """The per-group table's columns: ``--metrics`` (comma-separated, validated) or :data:`DEFAULT_GROUP_METRICS`
    under the keys the result reports (``labels``: a peer's key → grpo-cli's, from ``--names``).

    Raises:
        UsageError: a ``--metrics`` name the result does not report, with the closest reported keys.
    """
    available = set(result.metrics)
    for group in result.groups:
        available |= set(group["metrics"])
    if names is None:
        theirs: dict[str, str] = {}
        for key, ours in labels.items():
            theirs.setdefault(ours, key)  # the first peer key of a figure, as the table lists them
        return [name for name in (theirs.get(key, key) for key in DEFAULT_GROUP_METRICS) if name in available]
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        def close(name: str) -> str:
            matches = difflib.get_close_matches(name, sorted(available), n=3, cutoff=0.6)
            return f"'{name}' (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else f"'{name}'"

        raise UsageError(f"--metrics: not reported for this dump: {', '.join(close(name) for name in unknown)}; "
                         "--format json lists every reported key")
    return chosen


def render_analyze(
    console: Console,
    result: AnalysisResult,
    labels: Mapping[str, str],
    *,
    group_by: str | None,
    metrics: Sequence[str],
    all_tables: bool,
) -> None:
    """The findings, then the headline figures (or, with ``all_tables``, every figure's table), then the per-group
    table of ``metrics`` when ``group_by`` is set."""
    render_findings(console, result.findings, n_tokens=int(result.metrics.get("n_tokens", 0)), inputs=result.inputs)
    render_rescaling(console, result.config)
    if all_tables:
        render_table(console, title="grpo-cli analyze", metrics=result.metrics, omitted=result.omitted,
                     inputs=result.inputs, config=result.config, sources=labels)
    else:
        render_headline(console, result.metrics, labels)
    if group_by is not None:
        render_group_table(console, group_by, result.groups, list(metrics))


def analyze_csv(result: AnalysisResult, *, group_by: str | None, wide: bool) -> str:
    """``--format csv``: one row per figure (and group), or with ``wide`` one row per group and a column per
    figure."""
    groups = result.groups if group_by is not None else None
    if wide:
        return to_wide_csv(result.metrics, groups, group_by=group_by)
    return to_csv(result.metrics, groups=groups, findings=result.findings)
