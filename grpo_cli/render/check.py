"""Renderings of a :class:`~grpo_cli.commands.check.CheckReport`: the rule table, JSON, JUnit XML, GitHub workflow
commands and the Markdown step summary. Pure functions of the report (the CLI writes the strings where they go).

Kept next to :mod:`grpo_cli.render.tables`, whose console, number format and JSON envelope they reuse.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from grpo_cli.commands.check import CheckReport, RuleResult, Status, fmt
from grpo_cli.render.documents import json_document
from grpo_cli.render.findings import render_findings

__all__ = [
    "check_document",
    "github_commands",
    "junit_xml",
    "markdown_summary",
    "render_check_table",
]

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIPPED: "dim"}
_MARK = {Status.PASS: "✅", Status.WARN: "⚠️", Status.FAIL: "❌", Status.SKIPPED: "⏭️"}


def _value(result: RuleResult) -> str:
    return "–" if result.value is None else fmt(result.value)


def render_check_table(console: Console, report: CheckReport) -> None:
    """One row per rule (status, rule, value, bound, worst group), then each non-passing rule's message."""
    inputs = report.inputs
    console.print(Text(f"grpo-cli check — {len(inputs)} file(s): {', '.join(inputs[:3])}"
                       f"{' …' if len(inputs) > 3 else ''}"))
    # Without --rules/--rules-preset there is no rules file to name (only check's own validation rule runs).
    details = ([f"rules: {', '.join(report.sources)}"] if report.sources else []) + (
        [f"baseline: {report.baseline}"] if report.baseline is not None else [])
    if details:
        console.print(Text("; ".join(details), style="dim"))
    if report.findings:
        render_findings(console, report.findings, n_tokens=int(report.metrics.get("n_tokens", 0)), inputs=inputs)
    table = Table(title_justify="left", expand=False)
    table.add_column("status", no_wrap=True)
    table.add_column("rule", style="cyan")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("bound")
    table.add_column("worst group")
    for result in report.results:
        table.add_row(
            Text(result.status.value.upper(), style=_STYLE[result.status]),
            result.rule.label,
            _value(result),
            result.bound,
            result.where,
        )
    console.print(table)
    for result in report.results:
        if result.status is not Status.PASS:
            console.print(Text(f"{result.status.value.upper()}: {result.rule.label}: {result.message}",
                               style=_STYLE[result.status]))
    console.print(Text(report.headline(), style=_STYLE[report.status]))


def check_document(report: CheckReport) -> dict[str, Any]:
    """The ``--format json`` document: the shared envelope (``schema_version``, ``metrics`` — so it can serve as a
    ``--baseline``), ``rules`` (one entry per rule) and ``summary``."""
    return json_document(
        command="check",
        inputs=report.inputs,
        config=report.config,
        metrics=report.metrics,
        omitted=report.omitted,
        extra={
            "columns": report.columns,
            "rules": [result.to_json() for result in report.results],
            "summary": report.summary(),
            "findings": report.findings,
        },
    )


def junit_xml(report: CheckReport, *, elapsed: float = 0.0) -> str:
    """JUnit XML (pytest ``--junitxml`` conventions): one ``testcase`` per rule, a ``failure`` for each violated
    error rule, ``skipped`` for skipped rules; warnings are passing testcases with the message in ``system-out``."""
    n_failed, n_skipped = report.count(Status.FAIL), report.count(Status.SKIPPED)
    counts = {"tests": str(len(report.results)), "failures": str(n_failed), "errors": "0",
              "skipped": str(n_skipped), "time": f"{elapsed:.3f}"}
    suites = ET.Element("testsuites", {"name": "grpo-cli check", **counts})
    suite = ET.SubElement(suites, "testsuite", {"name": "grpo-cli check", **counts})
    properties = ET.SubElement(suite, "properties")
    for name, value in (("inputs", ", ".join(report.inputs)), ("rules", ", ".join(report.sources)),
                        ("baseline", report.baseline or "")):
        ET.SubElement(properties, "property", {"name": name, "value": value})
    for result in report.results:
        case = ET.SubElement(suite, "testcase", {"classname": "grpo-cli.check", "name": result.rule.label,
                                                 "time": "0"})
        text = (f"{result.message}\nmetric: {result.rule.metric}\nvalue: {_value(result)}\n"
                f"bound: {result.bound}\nseverity: {result.rule.severity.value}\nsource: {result.rule.source}")
        if result.rule.per is not None:
            text += f"\nworst group: {result.where}"
        if result.status is Status.FAIL:
            ET.SubElement(case, "failure", {"message": result.message, "type": "threshold"}).text = text
        elif result.status is Status.SKIPPED:
            ET.SubElement(case, "skipped", {"message": result.message})
        ET.SubElement(case, "system-out").text = (
            f"warning: {text}" if result.status is Status.WARN else text
        )
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _escape_data(text: str) -> str:
    # GitHub workflow commands: the message is "data" (escape %, CR, LF) ...
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    # ... and a property value additionally escapes ':' and ','.
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_commands(report: CheckReport) -> str:
    """``::error``/``::warning`` workflow commands for violated error/warn rules, then the headline."""
    lines = []
    for result in report.results:
        if result.status is Status.FAIL:
            command = "error"
        elif result.status is Status.WARN:
            command = "warning"
        else:
            continue
        title = _escape_property(f"grpo-cli check: {result.rule.label}")
        lines.append(f"::{command} title={title}::{_escape_data(result.message)}")
    lines.append(f"grpo-cli check: {report.headline()}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown_summary(report: CheckReport) -> str:
    """A Markdown section for ``$GITHUB_STEP_SUMMARY``: the headline and one table row per rule."""
    inputs = ", ".join(f"`{name}`" for name in report.inputs[:3]) + (" …" if len(report.inputs) > 3 else "")
    lines = [
        f"### {_MARK[report.status]} grpo-cli check: {_cell(report.headline())}",
        "",
        f"Inputs: {inputs}" + (f"; rules: {_cell(', '.join(report.sources))}" if report.sources else "")
        + (f"; baseline: `{report.baseline}`" if report.baseline else ""),
        "",
        "| status | rule | value | bound | worst group | message |",
        "|---|---|---:|---|---|---|",
    ]
    for result in report.results:
        lines.append(
            f"| {_MARK[result.status]} {result.status.value} | {_cell(result.rule.label)} | {_value(result)} "
            f"| {_cell(result.bound)} | {_cell(result.where)} | {_cell(result.message)} |"
        )
    return "\n".join(lines) + "\n\n"
