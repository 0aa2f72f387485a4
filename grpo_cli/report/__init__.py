"""``grpo-cli report``: one self-contained, offline HTML page of a dump's figures, charts and health verdicts.

:func:`build_report` computes (one ``analyze`` pass grouped by step, one ``compare-prox`` pass, ``check``'s rules on
those figures); :func:`render_html` lays the result out. matplotlib and Jinja2 are imported only when a page is
rendered. ``docs/report.md`` describes the page.
"""

from __future__ import annotations

from grpo_cli.report.builder import Report, build_report, evaluate_checks, per_step_series, report_configs
from grpo_cli.report.page import DATA_ELEMENT_ID, render_html, report_data

__all__ = [
    "DATA_ELEMENT_ID",
    "Report",
    "build_report",
    "evaluate_checks",
    "per_step_series",
    "render_html",
    "report_configs",
    "report_data",
]
