"""What a report shows, computed once: one ``analyze`` pass (per step), one ``compare-prox`` pass, check rules.

The figures come from the library functions the commands use (:func:`grpo_cli.commands.analyze.analyze`,
:func:`grpo_cli.commands.compare_prox.compare_prox`); the health verdicts evaluate ``check``'s rules
(:func:`grpo_cli.commands.check.evaluate_rule`) on those same figures instead of streaming the dump again. Only a
rule with ``per`` on a column other than ``step`` needs one more ``analyze`` pass, grouped by that column (as
``check`` does).

Example:
    >>> from grpo_cli.io.reader import RolloutDataset
    >>> from grpo_cli.commands.check import preset
    >>> rules = [("sanity", preset("sanity"))]
    >>> analyze_config, prox_config, strict = report_configs(rules)  # doctest: +SKIP
    >>> report = build_report(RolloutDataset(["sample_data/rollouts.parquet"]), rules, analyze_config,
    ...                       prox_config, require_valid=strict)  # doctest: +SKIP
    >>> report.checks[0][1].headline()  # doctest: +SKIP
    'passed — 6 rules: 6 passed'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import InputError
from grpo_cli.findings import DetectConfig

if TYPE_CHECKING:
    from grpo_cli.commands.check import CheckReport, RuleSet
    from grpo_cli.commands.compare_prox import CompareProxConfig, CompareProxResult
    from grpo_cli.engine.run import AnalysisResult
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.metrics.config import AnalyzeConfig

__all__ = ["TREND_GROUP_BY", "Report", "build_report", "evaluate_checks", "per_step_series", "report_configs"]

TREND_GROUP_BY = "step"
"""The column the trend charts follow (``analyze --group-by step``)."""


@dataclass
class Report:
    """Everything the page shows; the HTML is a pure function of it (:func:`grpo_cli.render.html.render_html`).

    Attributes:
        analysis: ``analyze``'s result, grouped by :data:`TREND_GROUP_BY` when the dump has that column.
        prox: ``compare-prox``'s result (every method), or ``None`` when the dump cannot support it.
        prox_unavailable: why ``prox`` is ``None`` (compare-prox's own exit-2 message).
        checks: ``(label, report)`` per rule set: ``sanity`` (always) and ``rules`` (``--rules`` files).
        group_by_unavailable: why there are no per-step figures, or ``None``.
        preset: the ``--preset`` the dump was read with, or ``None``.
        baseline: ``--compare``'s run (see the attribute).
    """

    analysis: AnalysisResult
    prox: CompareProxResult | None
    prox_unavailable: str | None
    checks: list[tuple[str, CheckReport]]
    tolerance: float
    group_by_unavailable: str | None = None
    preset: str | None = None
    baseline: AnalysisResult | None = None
    """``report --compare BASE``: the base run's ``analyze`` result with the same options, grouped by
    :data:`TREND_GROUP_BY` when it has that column (drawn on every trend chart)."""
    baseline_label: str = "base"

    @property
    def group_by(self) -> str | None:
        return self.analysis.config.get("group_by")


def report_configs(
    rule_sets: Sequence[tuple[str, RuleSet]],
    *,
    top_k: int = 10,
    tolerance: float | None = None,
    **overrides: Any,
) -> tuple[AnalyzeConfig, CompareProxConfig, bool]:
    """The ``analyze`` and ``compare-prox`` configs of a report, as ``check`` would choose them.

    Defaults, then the rule files' ``[analyze]`` / ``[compare_prox]`` tables, then ``overrides`` (command-line
    options; ``None`` = not given) — :func:`grpo_cli.commands.check.analyze_config` with every figure on and
    ``top_k`` kept.
    Options both commands share (ε, dual clip, rejection sampling, ``current_version``, ``on_invalid``) go to both
    passes, so their figures are defined alike.

    Returns:
        The two configs and whether invalid input must fail the verdicts (``on_invalid`` chosen nowhere: invalid
        sequences are skipped and the rule "input passes validation" is added, as in ``check``).
    """
    from grpo_cli.commands.check import RuleSet, analyze_config, compare_prox_config

    merged = RuleSet()
    for _, rule_set in rule_sets:
        merged = merged.merge(rule_set)
    config, require_valid = analyze_config(merged, all_figures=True, **overrides)
    config = replace(config, top_k=top_k)
    config.validate()
    return config, compare_prox_config(config, merged, tolerance=tolerance), require_valid


def per_step_series(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The scalar per-group figures in columns: ``{"keys": [k...], "series": {metric: [value per key]}}``.

    List-valued per-group figures (histograms, ``by_staleness``, ``top_kl``) are left out: the page embeds this
    compact form (a value is ``null`` where a group lacks the figure).

    Example:
        >>> per_step_series([{"key": 1, "metrics": {"a": 0.5, "h": [1]}}, {"key": 3, "metrics": {"b": 2}}])
        {'keys': [1, 3], 'series': {'a': [0.5, None], 'b': [None, 2]}}
    """
    names: dict[str, None] = {}
    for group in groups:
        names.update(dict.fromkeys(k for k, v in group["metrics"].items() if not isinstance(v, (list, dict))))
    return {
        "keys": [group["key"] for group in groups],
        "series": {name: [group["metrics"].get(name) for group in groups] for name in names},
    }


def evaluate_checks(
    dataset: RolloutDataset,
    rule_set: RuleSet,
    analysis: AnalysisResult,
    prox: CompareProxResult | None,
    prox_omitted: Mapping[str, str],
    config: AnalyzeConfig,
    *,
    require_valid: bool,
    extra_groups: Mapping[str, list[dict[str, Any]]] | None = None,
) -> CheckReport:
    """``check``'s verdict on figures already computed: the same rules, bounds, messages and exit semantics.

    ``analysis`` supplies the overall figures and the groups of its ``group_by`` column; ``extra_groups`` those of
    other ``per`` columns; ``prox`` (or ``prox_omitted``, the reasons when compare-prox cannot run) the ``prox/…``
    figures.

    Raises:
        UsageError: unknown metrics or rules on figures the dump cannot provide, as ``check`` (exit 2).
    """
    from grpo_cli.commands.check import (
        CheckReport,
        evaluate_rules,
        finding_results,
        sanity_figures,
        valid_input_rule,
        validate_rules,
    )

    rules = list(rule_set.rules)
    validate_rules(rules, dataset, None)  # check's own up-front validation (unknown metrics, bad per columns)
    metrics, omitted = dict(analysis.metrics), dict(analysis.omitted)
    metrics.update(sanity_figures(metrics))
    if prox is not None:
        metrics.update({k: v for k, v in prox.metrics.items() if k.startswith("prox/")})
        omitted.update({k: v for k, v in prox.omitted.items() if k.startswith("prox/")})
    omitted.update(prox_omitted)
    if require_valid and config.on_invalid == "skip":
        rules = [valid_input_rule(metrics), *rules]
    groups: dict[str, list[dict[str, Any]]] = dict(extra_groups or {})
    if analysis.config.get("group_by") is not None:
        groups[analysis.config["group_by"]] = analysis.groups
    results = finding_results(analysis.findings) + evaluate_rules(rules, metrics, groups, None, omitted)
    report_config = dict(analysis.config)
    report_config.pop("group_by", None)
    report_config.pop("top_k", None)
    return CheckReport(
        results=results,
        metrics=metrics,
        omitted=omitted,
        inputs=analysis.inputs,
        config=report_config,
        columns=analysis.columns,
        sources=rule_set.sources,
        findings=list(analysis.findings),
    )


def build_report(
    dataset: RolloutDataset,
    rule_sets: Sequence[tuple[str, RuleSet]],
    analyze_config: AnalyzeConfig,
    prox_config: CompareProxConfig,
    *,
    require_valid: bool,
    progress: Callable[[int], None] | None = None,
    preset: str | None = None,
    findings: DetectConfig | None = None,
    baseline: RolloutDataset | None = None,
    baseline_config: AnalyzeConfig | None = None,
    workers: int = 1,
) -> Report:
    """Run the passes a report needs and evaluate every rule set on their figures.

    ``baseline`` (``report --compare``) is another run analysed with ``baseline_config`` (default: the same
    options); its per-step figures are drawn on every trend chart. ``workers`` (processes and threads, as
    ``analyze --workers``) changes no figure.

    Raises:
        UsageError, InputError: as ``analyze`` / ``check`` (exit 2).
    """
    from grpo_cli.commands.analyze import analyze
    from grpo_cli.commands.compare_prox import check_columns, compare_prox, expected_keys

    group_by = TREND_GROUP_BY if TREND_GROUP_BY in dataset.columns else None
    unavailable = None if group_by else f"the dump has no '{TREND_GROUP_BY}' column (per-step trends need it)"
    analysis = analyze(dataset, replace(analyze_config, group_by=group_by), progress=progress, workers=workers,
                       findings=findings or DetectConfig())

    prox: CompareProxResult | None = None
    prox_unavailable = None
    prox_omitted: dict[str, str] = {}
    try:
        check_columns(dataset, prox_config)
    except InputError as exc:
        prox_unavailable = exc.reason
        prox_omitted = dict.fromkeys(expected_keys(prox_config), exc.reason)
    else:
        prox = compare_prox(dataset, prox_config, workers=workers)

    # Rules grouped by a column other than the trends' need that grouping (one pass per column, as check).
    per_columns = {r.per for _, rs in rule_sets for r in rs.rules if r.per is not None and r.per != group_by}
    extra_groups = {
        column: analyze(dataset, replace(analyze_config, group_by=column, top_k=0), workers=workers).groups
        for column in sorted(per_columns)
        if column in dataset.columns  # otherwise evaluate_checks reports the rule's missing column
    }
    checks = [
        (label, evaluate_checks(dataset, rule_set, analysis, prox, prox_omitted, analyze_config,
                                require_valid=require_valid, extra_groups=extra_groups))
        for label, rule_set in rule_sets
    ]
    base_analysis = None
    if baseline is not None:
        # The same options as this run's pass unless given (its own dump's recorded options), so the base's lines
        # on the charts are the same figures.
        base_group_by = TREND_GROUP_BY if TREND_GROUP_BY in baseline.columns else None
        base_analysis = analyze(baseline, replace(baseline_config or analyze_config, group_by=base_group_by,
                                                  top_k=0), workers=workers)
    return Report(
        analysis=analysis,
        baseline=base_analysis,
        prox=prox,
        prox_unavailable=prox_unavailable,
        checks=checks,
        tolerance=prox_config.tolerance,
        group_by_unavailable=unavailable,
        preset=preset,
    )
