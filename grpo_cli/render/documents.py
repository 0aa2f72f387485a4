"""Machine-readable outputs: the strict JSON envelope every command shares and long-form CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grpo_cli import __version__

if TYPE_CHECKING:
    from grpo_cli.commands.compare_prox import CompareProxResult
    from grpo_cli.engine.run import AnalysisResult

__all__ = [
    "JSON_SCHEMA_VERSION", "analyze_document", "compare_prox_document", "dumps_json", "json_document", "to_csv",
]

JSON_SCHEMA_VERSION = 1
"""Bumped whenever a key users script against is renamed or dropped (``docs/metrics.md``, "Contracts")."""


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


def to_csv(
    metrics: Mapping[str, Any],
    groups: list[dict[str, Any]] | None = None,
    findings: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Long form ``metric,value``, or ``group,metric,value`` with groups (the overall figures have group ``all``).

    List-valued figures (``top_kl``) are JSON-encoded in their cell; each finding is a row ``findings/<code>`` whose
    value is the finding as JSON.
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

    found = {f"findings/{f['code']}": dict(f) for f in findings}
    if groups is None:
        writer.writerow(["metric", "value"])
        writer.writerows(rows(metrics))
        writer.writerows(rows(found))
    else:
        writer.writerow(["group", "metric", "value"])
        writer.writerows(["all", *row] for row in rows(metrics))
        writer.writerows(["all", *row] for row in rows(found))
        for group in groups:
            writer.writerows([group["key"], *row] for row in rows(group["metrics"]))
    return buffer.getvalue()


def to_wide_csv(metrics: Mapping[str, Any], groups: list[dict[str, Any]] | None = None, *,
                group_by: str | None = None) -> str:
    """Wide form for pandas and spreadsheets: one row per group key (first the whole dump, key ``all``), one column
    per scalar figure (the union over rows, in first-seen order; an empty cell where a row lacks it). List-valued
    figures (``top_kl``, histograms) have no place in a grid and are left out (``--format json`` keeps them)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    table = [("all", _strict(dict(metrics)))]
    table += [(group["key"], _strict(dict(group["metrics"]))) for group in groups or []]
    columns: dict[str, None] = {}
    for _, values in table:
        columns.update((key, None) for key, value in values.items() if not isinstance(value, (list, dict)))
    writer.writerow([group_by or "group", *columns])
    for key, values in table:
        writer.writerow([key, *("" if values.get(c) is None else values[c] for c in columns)])
    return buffer.getvalue()


def analyze_document(result: AnalysisResult, *, preset: str | None = None) -> dict[str, Any]:
    """What ``analyze --format json`` prints for ``result`` (``groups`` when it was grouped)."""
    extra: dict[str, Any] = {"columns": result.columns}
    if preset is not None:
        extra["preset"] = preset
    if result.config.get("group_by") is not None:
        extra["groups"] = result.groups
    extra["findings"] = result.findings
    return json_document(command="analyze", inputs=result.inputs, config=result.config, metrics=result.metrics,
                         omitted=result.omitted, extra=extra)


def compare_prox_document(result: CompareProxResult, *, preset: str | None = None) -> dict[str, Any]:
    """What ``compare-prox --format json`` prints for ``result``."""
    extra: dict[str, Any] = {"columns": result.columns, "recommendations": result.recommendations}
    if preset is not None:
        extra["preset"] = preset
    return json_document(command="compare-prox", inputs=result.inputs, config=result.config, metrics=result.metrics,
                         omitted=result.omitted, extra=extra)
