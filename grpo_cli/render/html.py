"""The report page: a :class:`~grpo_cli.commands.report.Report` → one self-contained HTML string.

A Jinja2 template (``templates/report.html.j2``, autoescaped, CSS inlined from ``templates/report.css``) lays out a
view model built here; the charts are inline SVG (:mod:`grpo_cli.render.charts`); the report's data is embedded as
JSON (``<script type="application/json" id="report-data">``, HTML-escaped, keys sorted) so the page carries its
own numbers. Nothing refers outside the file and nothing depends on the time or the machine, so the same input
gives the same bytes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_cli import __version__
from grpo_cli._constants import REPORT_HEADLINE_KEYS
from grpo_cli._format import format_value
from grpo_cli.commands.report import Report, per_step_series
from grpo_cli.findings import verdict
from grpo_cli.metrics.registry import KEYS, SECTIONS, section_of
from grpo_cli.render import charts
from grpo_cli.render.documents import analyze_document, compare_prox_document
from grpo_cli.render.tables import merge_identical_tokens, row_ranges

__all__ = ["DATA_ELEMENT_ID", "TRENDS", "render_html", "report_data"]

DATA_ELEMENT_ID = "report-data"
"""``id`` of the ``<script type="application/json">`` element holding :func:`report_data`."""

TRENDS: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    ("fig-trend-clip", "Clip fraction", ("clip/ratio", "clip/low", "clip/high"), "fraction of valid tokens",
     "clip/low: r < 1 − ε with A < 0; clip/high: r > 1 + ε_high with A > 0; clip/ratio: their sum."),
    ("fig-trend-kl", "KL(old ‖ new)", ("kl/k1", "kl/k3"), "nats per token",
     "Estimates of KL(old ‖ new) over valid tokens: k1 = mean(old − new), k3 = mean(e^d − 1 − d), d = new − old."),
    ("fig-trend-is-ess", "Importance-weight ESS", ("is/ess",), "ESS / n",
     "Effective sample size fraction of the (truncated) weights w = exp(new − old): 1 = uniform; falling = a few "
     "tokens dominate."),
    ("fig-trend-is-chi2", "Importance-weight χ²", ("is/chi2_token", "is/chi2_seq"), "χ²",
     "mean(w²) − 1 per token, and per sequence with w = exp(Σ log w); spikes mark steps with heavy-tailed weights."),
    ("fig-trend-entropy", "Entropy", ("entropy/mean",), "nats",
     "Mean token entropy of π_θ over valid tokens; a fall towards 0 while the reward stays flat is entropy collapse."),
    ("fig-trend-staleness", "Staleness", ("staleness/theta_mean", "staleness/theta_max"), "versions behind",
     "Trainer version minus each generated token's behaviour version (mean and maximum over valid tokens)."),
    ("fig-trend-loss", "Loss values", ("loss/*",), "loss",
     "Each configured GRPO-family loss evaluated on the step's tokens (docs/losses.md)."),
)
"""The per-step trend charts: (id, title, metric keys — ``loss/*`` = every loss reported, y label, caption)."""

_TOP_KL_VALUES = ("kl", "ratio", "new_logp", "old_logp")
_TOP_RATIO_VALUES = ("ratio", "new_logp", "base_logp")
"""The values the ``top_kl`` and ``top_ratio`` tables (and their lines in "All figures") show per token."""

HEADLINE_KEYS = REPORT_HEADLINE_KEYS
"""Figures shown as cards in the page header (when reported); declared in ``grpo_cli._constants``."""

HEAT_COLUMNS = (("clip/ratio", "value"), ("kl/k3", "value"), ("is/mean", "dev1"))


def report_data(report: Report) -> dict[str, Any]:
    """The page's embedded data: ``analyze``'s JSON document (its ``groups`` replaced by the columnar scalar
    figures under ``per_step``, to keep the page small), ``compare-prox``'s, and each verdict's rules and summary."""
    analyze_doc = {k: v for k, v in analyze_document(report.analysis, preset=report.preset).items() if k != "groups"}
    prox_doc = None if report.prox is None else compare_prox_document(report.prox)
    data: dict[str, Any] = {
        "analyze": analyze_doc,
        "per_step": None,
        "compare_prox": prox_doc,
        "compare_prox_unavailable": report.prox_unavailable,
        "checks": {},
        "findings": report.analysis.findings,
    }
    if report.group_by is not None:
        data["per_step"] = {"group_by": report.group_by, **per_step_series(report.analysis.groups)}
    if report.baseline is not None:
        base = report.baseline
        data["compare"] = {
            "label": report.baseline_label,
            "analyze": {k: v for k, v in analyze_document(base).items() if k != "groups"},
            "per_step": per_step_series(base.groups) if base.config.get("group_by") else None,
        }
    for label, check in report.checks:
        data["checks"][label] = {"summary": check.summary(), "rules": [r.to_json() for r in check.results]}
    return data


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value != 0 and 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return format_value(value)


def _series(
    report: Report, keys: Sequence[str], groups: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, list[Any]]:
    groups = report.analysis.groups if groups is None else groups
    if keys == ("loss/*",):
        names: dict[str, None] = {}
        for group in groups:
            names.update(dict.fromkeys(k for k in group["metrics"] if k.startswith("loss/")))
        keys = tuple(names)
    out = {}
    for key in keys:
        values = [group["metrics"].get(key) for group in groups]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = values
    return out


def _why_missing(report: Report, keys: Sequence[str]) -> str:
    if report.group_by_unavailable:
        return report.group_by_unavailable
    reasons = [report.analysis.omitted[k] for k in keys if k in report.analysis.omitted]
    return reasons[0] if reasons else "not reported for this dump"


def _chart(chart_id: str, title: str, caption: str, svg: str | None, missing: str | None = None) -> dict[str, Any]:
    return {"id": chart_id, "title": title, "caption": caption, "svg": svg, "missing": missing}


def _trend_charts(report: Report) -> list[dict[str, Any]]:
    out = []
    x = [group["key"] for group in report.analysis.groups]
    for chart_id, title, keys, ylabel, caption in TRENDS:
        series = _series(report, keys) if report.group_by else {}
        if not series:
            out.append(_chart(chart_id, title, caption, None, _why_missing(report, keys)))
            continue
        hline = (1.0, "ideal 1") if chart_id == "fig-trend-is-ess" else None
        base = report.baseline
        base_groups = base.groups if base is not None and base.config.get("group_by") else None
        svg = charts.trend_chart(
            chart_id, x, series, ylabel=ylabel, xlabel=report.group_by or "step", hline=hline,
            base_x=[group["key"] for group in base_groups or []],
            base_series=_series(report, keys, base_groups) if base_groups else None, base_label=report.baseline_label,
        )
        out.append(_chart(chart_id, title, caption, svg))
    return out


def _outside(hist: Mapping[str, Any], low: Any, high: Any) -> str:
    """The tokens a ``*/hist`` view leaves out, and the data's full range, as a sentence for the caption."""
    edges = hist["edges"]
    parts = []
    if hist.get("below"):
        zero = f" ({hist['zero']:,} of them 0)" if hist.get("zero") else ""
        parts.append(f"{hist['below']:,} tokens lie below {edges[0]:.4g}{zero}")
    if hist.get("above"):
        parts.append(f"{hist['above']:,} above {edges[-1]:.4g}")
    text = " and ".join(parts)
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        text += ("; " if text else "") + f"the full range is {low:.4g} … {high:.4g}"
    return f" Not drawn: {text}." if text else ""


def _no_hist(report: Report, prefix: str) -> str:
    omitted = report.analysis.omitted.get(f"{prefix}/hist")
    if omitted is not None:
        return omitted
    if f"{prefix}/max" in report.analysis.metrics:  # analyze bins positive values only, on a log scale
        return f"no positive value between p0.1 and p99.9 to bin on a log scale ({prefix}/max = " \
               f"{format_value(report.analysis.metrics[f'{prefix}/max'])})"
    return "not reported for this dump"


def _histogram_charts(report: Report) -> list[dict[str, Any]]:
    metrics, config = report.analysis.metrics, report.analysis.config
    eps, eps_high = config["epsilon"], config["epsilon_high"]
    out = []
    hist = metrics.get("ratio/hist")
    title = "Importance ratio"
    caption = ("PPO ratio r = exp(new − base), base = prox_logp if present else old_logp, in log-spaced bins from "
               "p0.1 to p99.9; the shaded band [1−ε, 1+ε_high] is where r is not clipped.")
    if hist:
        svg = charts.histogram_chart(
            "fig-hist-ratio", hist, xlabel="ratio r (log scale)", plain_ticks=True,
            band=(1 - eps, 1 + eps_high, f"clip band [{1 - eps:g}, {1 + eps_high:g}]"),
        )
        caption += _outside(hist, metrics.get("ratio/min"), metrics.get("ratio/max"))
        out.append(_chart("fig-hist-ratio", title, caption, svg))
    else:
        out.append(_chart("fig-hist-ratio", title, caption, None, _no_hist(report, "ratio")))
    hist = metrics.get("abs_diff/hist")
    title = "|new − old| log-prob difference"
    caption = ("|new − old| per valid token, in log-spaced bins from p0.1 to p99.9. Dashed: where a ratio against "
               "old_logp leaves the clip band (log(1+ε_high) above, |log(1−ε)| below).")
    if hist:
        lines = [(math.log1p(eps_high), f"log(1+ε_high) = {math.log1p(eps_high):.3g}")]
        if 0 < eps < 1:
            lines.append((-math.log1p(-eps), f"|log(1−ε)| = {-math.log1p(-eps):.3g}"))
        svg = charts.histogram_chart("fig-hist-abs-diff", hist, xlabel="|new − old| (log scale)", vlines=lines)
        caption += _outside(hist, metrics.get("abs_diff/min"), metrics.get("abs_diff/max"))
        out.append(_chart("fig-hist-abs-diff", title, caption, svg))
    else:
        out.append(_chart("fig-hist-abs-diff", title, caption, None, _no_hist(report, "abs_diff")))
    return out


def _heatmap(report: Report) -> dict[str, Any]:
    rows = report.analysis.metrics.get("by_staleness") or []
    caption = ("Valid generated tokens by staleness lag (trainer version − behaviour version). Each column is "
               "shaded on its own scale (darker = larger; is/mean by its distance from 1).")
    title = "Staleness lag × clip, KL, importance weight"
    columns = [c for c in HEAT_COLUMNS if rows and c[0] in rows[0]]
    if not columns:
        return _chart("fig-heat-staleness", title, caption, None,
                      report.analysis.omitted.get("by_staleness", "no valid generated tokens with a version"))
    return _chart("fig-heat-staleness", title, caption, charts.heatmap_chart("fig-heat-staleness", rows, columns))


def _prox(report: Report) -> dict[str, Any]:
    title = "compare-prox: proximal approximation error vs lag"
    caption = (f"Mean |ℓp̂ − ℓp*| of each AReaL approximation against the recomputed prox_logp, per staleness lag; "
               f"dashed: the tolerance {report.tolerance:g}.")
    if report.prox is None:
        chart = _chart("fig-prox-lag", title, caption, None, f"compare-prox cannot run on this dump: "
                       f"{report.prox_unavailable}")
        return {"chart": chart, "verdicts": []}
    metrics = report.prox.metrics
    methods = list(report.prox.recommendations)
    by_method = {m: metrics.get(f"prox/{m}/by_staleness") or [] for m in methods}
    if not any(by_method.values()):
        reason = report.prox.omitted.get(f"prox/{methods[0]}/by_staleness", "no valid generated tokens")
        return {"chart": _chart("fig-prox-lag", title, caption, None, reason),
                "verdicts": list(report.prox.recommendations.values())}
    svg = charts.prox_lag_chart("fig-prox-lag", by_method, tolerance=report.tolerance,
                                safe_lags={m: metrics.get(f"prox/{m}/max_safe_lag") for m in methods})
    return {"chart": _chart("fig-prox-lag", title, caption, svg),
            "verdicts": [report.prox.recommendations[m] for m in methods]}


_TOKEN_LISTS = {"top_kl": ("top-kl", _TOP_KL_VALUES), "top_ratio": ("top-ratio", _TOP_RATIO_VALUES)}
"""The token lists "All figures" writes as lines (not JSON): the section their table is in, the values shown."""


def _token_lines(records: Sequence[Mapping[str, Any]], inputs: Sequence[str], values: Sequence[str]) -> str:
    """A top-token list as one line per token (``rollouts.parquet row 3708, position 5: kl 10.46, ratio 14.1``),
    the same token of duplicated sequences on one line, as in its table."""
    lines = []
    for record, record_rows in merge_identical_tokens(list(records), values):
        index = record["file"]
        name = os.path.basename(inputs[index]) if 0 <= index < len(inputs) else str(index)
        shown = ", ".join(f"{c} {_fmt(record[c])}" for c in values if c in record)
        lines.append(f"{name} row {row_ranges(record_rows)}, position {record['position']}: {shown}")
    return "\n".join(lines)


def _figure_sections(metrics: Mapping[str, Any], inputs: Sequence[str] = ()) -> list[dict[str, Any]]:
    by_section: dict[str, list[dict[str, Any]]] = {}
    for key, value in metrics.items():
        structured = isinstance(value, (list, dict))
        anchor = ""
        if key in _TOKEN_LISTS and isinstance(value, list):
            anchor, values = _TOKEN_LISTS[key]
            text = _token_lines(value, inputs, values)
        elif structured:
            text = json.dumps(value, allow_nan=False, separators=(", ", ": "))
        else:
            text = format_value(value)
        meaning = KEYS[key].meaning if key in KEYS else ""
        by_section.setdefault(section_of(key), []).append(
            {"key": key, "value": text, "meaning": meaning, "structured": structured, "anchor": anchor})
    order = list(SECTIONS) + [s for s in by_section if s not in SECTIONS]
    return [{"id": f"figures-{name}", "title": SECTIONS.get(name, name), "name": name, "rows": by_section[name]}
            for name in order if name in by_section]


def _verdicts(report: Report) -> list[dict[str, Any]]:
    out = []
    for label, check in report.checks:
        rows = [{"status": r.status.value, "name": r.rule.label, "value": "–" if r.value is None else _fmt(r.value),
                 "bound": r.bound, "where": r.where, "message": r.message, "severity": r.rule.severity.value}
                for r in check.results]
        title = "check --rules-preset sanity" if label == "sanity" else f"check --rules {' '.join(check.sources)}"
        out.append({"label": label, "title": title, "status": check.status.value, "headline": check.headline(),
                    "rows": rows})
    return out


def _top_tokens(report: Report, key: str, values: Sequence[str]) -> list[dict[str, str]]:
    """The rows of a top-token list (``top_kl``, ``top_ratio``): its file's name, rows, position and ``values``.

    Rows that differ only in their row (the same token of duplicated sequences) are merged, as in analyze's table;
    ``merged`` is then ``"1"``."""
    inputs = report.analysis.inputs
    rows = []
    for record, record_rows in merge_identical_tokens(report.analysis.metrics.get(key) or [], values):
        index = record["file"]
        name = os.path.basename(inputs[index]) if 0 <= index < len(inputs) else str(index)
        rows.append({"file": name, "row": row_ranges(record_rows), "position": str(record["position"]),
                     "merged": "1" if len(record_rows) > 1 else "",
                     **{c: _fmt(record[c]) for c in values if c in record}})
    return rows


def _top_kl(report: Report) -> list[dict[str, str]]:
    return _top_tokens(report, "top_kl", _TOP_KL_VALUES)


def _top_ratio(report: Report) -> dict[str, Any]:
    """``top_ratio``'s rows (the first is ``ratio/max``'s token), the ratio base they use, and why it is missing."""
    base = report.analysis.config.get("ratio_base", "old")
    return {"rows": _top_tokens(report, "top_ratio", _TOP_RATIO_VALUES), "base": base,
            "missing": report.analysis.omitted.get("top_ratio", f"no valid token has a {base}_logp")}


def _stats(report: Report) -> list[tuple[str, str]]:
    metrics = report.analysis.metrics
    stats = [("files", f"{len(report.analysis.inputs):,}")]
    for label, key in (("sequences", "n_sequences"), ("tokens", "n_tokens"), ("valid tokens", "n_valid_tokens")):
        if key in metrics:
            stats.append((label, format_value(metrics[key])))
    groups = report.analysis.groups
    if report.group_by and groups:
        stats.append((f"{report.group_by}s", f"{len(groups):,} ({groups[0]['key']}–{groups[-1]['key']})"))
    skipped = metrics.get("invalid/n_sequences_skipped")
    if skipped:
        stats.append(("invalid sequences skipped", format_value(skipped)))
    return stats


def _settings(report: Report) -> str:
    config, columns = report.analysis.config, report.analysis.columns
    base = "prox_logp" if "prox_logp" in columns else "old_logp" if "old_logp" in columns else "–"
    parts = [f"ε = {config['epsilon']:g}", f"ε_high = {config['epsilon_high']:g}",
             f"temperature {config['temperature']:g}", f"ratio base {base}", f"on_invalid {config['on_invalid']}"]
    if config.get("c_clip") is not None:
        parts.append(f"dual clip c = {config['c_clip']:g}")
    if config.get("rejection_sampling"):
        parts.append("rejection sampling on")
    if report.prox is not None:
        parts.append(f"compare-prox tolerance {report.tolerance:g}")
    return " · ".join(parts)


FINDING_CHARTS = {
    "alignment": "fig-hist-abs-diff", "temperature": "fig-hist-abs-diff", "truncated-sampling": "fig-hist-abs-diff",
    "mismatch": "fig-hist-abs-diff", "weight-sync": "fig-trend-kl", "importance-weights": "fig-hist-ratio",
    "clipping": "fig-trend-clip", "staleness": "fig-heat-staleness", "prox-approximation": "fig-prox-lag",
    "entropy-collapse": "fig-trend-entropy", "length-truncation": "figures", "mask": "figures",
    "advantage": "figures", "no-signal": "figures", "reference": "figures", "duplicates": "figures",
}
"""The chart (or section) of the page that shows each finding category's evidence."""


def _findings(report: Report) -> list[dict[str, Any]]:
    """The findings, most severe first, each with the anchor of the chart that shows it."""
    anchors = {c["id"] for c in _trend_charts(report)} | {"fig-hist-abs-diff", "fig-hist-ratio",
                                                         "fig-heat-staleness", "fig-prox-lag", "figures"}
    out = []
    for finding in report.analysis.findings:
        anchor = FINDING_CHARTS.get(finding["category"], "figures")
        out.append({**finding, "anchor": anchor if anchor in anchors else "figures",
                    "evidence_text": "; ".join(f"{k} = {_fmt(v.get('value'))}"
                                               for k, v in finding["evidence"].items())})
    return out


def _context(report: Report) -> dict[str, Any]:
    from jinja2.utils import htmlsafe_json_dumps

    metrics = report.analysis.metrics
    config = report.analysis.config
    data = htmlsafe_json_dumps(report_data(report), dumps=json.dumps, sort_keys=True, separators=(",", ":"),
                               allow_nan=False, ensure_ascii=False)
    return {
        "version": __version__,
        "inputs": report.analysis.inputs,
        "stats": _stats(report),
        "settings": _settings(report),
        "headline": [{"key": k, "value": _fmt(metrics[k]), "meaning": KEYS[k].meaning if k in KEYS else ""}
                     for k in HEADLINE_KEYS if isinstance(metrics.get(k), (int, float))],
        "verdicts": _verdicts(report),
        "findings": _findings(report),
        "findings_verdict": verdict(report.analysis.findings, int(metrics.get("n_tokens", 0))),
        "config": [(key, json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else
                    format_value(value)) for key, value in config.items()],
        "columns": report.analysis.columns,
        "group_by": report.group_by or "step",
        "trends": _trend_charts(report),
        "distributions": _histogram_charts(report),
        "heatmap": _heatmap(report),
        "prox": _prox(report),
        "top_kl": _top_kl(report),
        "top_kl_missing": report.analysis.omitted.get("top_kl", "no valid token has an old_logp"),
        "top_ratio": _top_ratio(report),
        "figure_sections": _figure_sections(metrics, report.analysis.inputs),
        "omitted": sorted(report.analysis.omitted.items()),
        "data_id": DATA_ELEMENT_ID,
        "data": data,
    }


def render_html(report: Report) -> str:
    """The whole page as one string (UTF-8 text, ends with a newline).

    Charts need matplotlib and the page Jinja2; both are imported here, so commands that make no report never
    load them.
    """
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("grpo_cli.render", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    html = env.get_template("report.html.j2").render(_context(report))
    return html if html.endswith("\n") else html + "\n"
