"""``grpo-cli check``: regression gates on a rollout dump, for CI.

A rule set (a TOML file, ``docs/check.md``, or a built-in preset) names metrics that ``analyze`` (or
``compare-prox``, for ``prox/…`` keys) reports and bounds on them::

    [[rule]]
    metric = "clip/ratio"
    max = 0.2
    per = "step"          # every step must pass; the worst step is reported

    [[rule]]
    metric = "kl/k3"
    max_rel_increase = 0.5   # against --baseline
    severity = "warn"

:func:`run_check` streams the dump (one ``analyze`` pass, grouped by a rule's ``per`` column when asked; one more
pass per further ``per`` column; one ``compare-prox`` pass when a rule names a ``prox/…`` key), evaluates *every*
rule and returns a :class:`CheckReport`. Exit codes (ruff/pytest convention): 0 every error rule passes, 1 an
error rule is violated, 2 for usage errors, unreadable input, unknown metrics, rules on metrics the data cannot
provide, and dumps without a single valid token (an empty dump must never pass).

Example:
    >>> rules = parse_rules('[[rule]]\\nmetric = "kl/k3"\\nmax = 0.05\\n', "rules.toml")
    >>> rule = rules.rules[0]
    >>> result = evaluate_rule(rule, {"kl/k3": 0.07}, {}, None)
    >>> result.status.value, result.message
    ('fail', 'kl/k3 = 0.07 is above max 0.05')
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from grpo_cli.commands._check_baseline import Baseline, is_json_baseline, load_baseline
from grpo_cli.commands._check_evaluate import RuleResult, evaluate_rule, evaluate_rules, finding_results, fmt
from grpo_cli.commands._check_rules import (
    BOUND_KEYS,
    PER_COLUMNS,
    PRESETS,
    RULE_KEYS,
    SANITY_ON_POLICY_DEV_MAX,
    SANITY_RATIO_MAX,
    Rule,
    RuleSet,
    Severity,
    Status,
    _compare_prox_module,
    _is_number,
    analyze_config,
    compare_prox_config,
    known_metrics,
    load_rules,
    metric_problems,
    parse_rules,
    preset,
    sanity_figures,
    valid_input_rule,
)
from grpo_cli.engine.group import MetricGroup, overall_only
from grpo_cli.engine.validate import ValidationGroup
from grpo_cli.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError, UsageError
from grpo_cli.findings import DetectConfig, detector_inputs, selected_codes
from grpo_cli.findings import select as select_findings
from grpo_cli.metrics import default_groups, select_groups
from grpo_cli.metrics.diagnosis import diagnosis_groups

if TYPE_CHECKING:
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.metrics.config import AnalyzeConfig

__all__ = [
    "compare_prox_config",
    "evaluate_rules",
    "finding_results",
    "validate_rules",
    "BOUND_KEYS",
    "PER_COLUMNS",
    "PRESETS",
    "RULE_KEYS",
    "SANITY_ON_POLICY_DEV_MAX",
    "SANITY_RATIO_MAX",
    "Baseline",
    "CheckReport",
    "Rule",
    "RuleResult",
    "RuleSet",
    "Severity",
    "Status",
    "analyze_config",
    "check_groups",
    "dump_baseline",
    "grouped_by",
    "is_json_baseline",
    "evaluate_rule",
    "fmt",
    "known_metrics",
    "load_baseline",
    "load_rules",
    "metric_problems",
    "parse_rules",
    "preset",
    "run_check",
    "sanity_figures",
    "valid_input_rule",
]


@dataclass
class CheckReport:
    """Every rule's result and the figures they were evaluated on (``metrics`` makes the JSON a baseline)."""

    results: list[RuleResult]
    metrics: dict[str, Any]
    omitted: dict[str, str]
    inputs: list[str]
    config: dict[str, Any]
    columns: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    baseline: str | None = None
    warn_only: bool = False
    notes: list[str] = field(default_factory=list)
    """Warnings for stderr (e.g. the baseline was computed with other options)."""
    findings: list[dict[str, Any]] = field(default_factory=list)
    """The findings the built-in detector rules saw (after ``--select``/``--ignore``), most severe first."""

    def count(self, status: Status) -> int:
        return sum(result.status is status for result in self.results)

    @property
    def status(self) -> Status:
        """``fail`` if an error rule is violated, else ``warn`` if a warn rule is, else ``pass``."""
        for status in (Status.FAIL, Status.WARN):
            if self.count(status):
                return status
        return Status.PASS

    @property
    def exit_code(self) -> int:
        return EXIT_CHECK_FAILED if self.status is Status.FAIL and not self.warn_only else EXIT_OK

    @property
    def n_inconclusive(self) -> int:
        """Findings whose estimate is past a warning threshold but whose interval is not (they never fail)."""
        return sum(f["severity"] == "inconclusive" for f in self.findings)

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "exit_code": self.exit_code,
            "n_rules": len(self.results),
            "n_passed": self.count(Status.PASS),
            "n_warnings": self.count(Status.WARN),
            "n_failed": self.count(Status.FAIL),
            "n_skipped": self.count(Status.SKIPPED),
            "n_inconclusive": self.n_inconclusive,
            "warn_only": self.warn_only,
            "rules_from": self.sources,
            "baseline": self.baseline,
        }

    def headline(self) -> str:
        """One line, e.g. ``FAILED — 5 rules: 1 failed (kl/k3 per step), 1 warning(s), 3 passed``."""
        failed = [r.rule.label for r in self.results if r.status is Status.FAIL]
        parts = []
        if failed:
            parts.append(f"{len(failed)} failed ({', '.join(failed)})")
        if self.count(Status.WARN):
            parts.append(f"{self.count(Status.WARN)} warning(s)")
        parts.append(f"{self.count(Status.PASS)} passed")
        if self.count(Status.SKIPPED):
            parts.append(f"{self.count(Status.SKIPPED)} skipped")
        if self.n_inconclusive:
            parts.append(f"{self.n_inconclusive} inconclusive finding(s): more data would settle them")
        word = {Status.FAIL: "FAILED", Status.WARN: "passed with warnings", Status.PASS: "passed"}[self.status]
        if self.status is Status.FAIL and self.warn_only:
            word = "FAILED (--warn-only: exit 0)"
        return f"{word} — {len(self.results)} rules: {', '.join(parts)}"


def validate_rules(
    rules: Sequence[Rule], dataset: RolloutDataset, baseline: Baseline | None, *, baseline_dump: bool = False
) -> None:
    """Everything that can be checked before reading the data (all problems in one exit-2 message);
    ``baseline_dump``: the baseline is a dump, measured later."""
    known = known_metrics()
    problems = []
    for rule in rules:
        problems.extend(metric_problems(rule.metric, rule.source, known))
        if rule.needs_baseline and baseline is None and not baseline_dump:
            problems.append(f"{rule.source} ({rule.metric}): max_rel_increase/max_abs_change need --baseline")
        if rule.per is not None and rule.is_prox:
            problems.append(f"{rule.source} ({rule.metric}): 'per' is not supported for prox/ keys "
                            "(compare-prox reports overall figures only)")
        if rule.per is not None and rule.per in PER_COLUMNS and rule.per not in dataset.columns:
            problems.append(f"{rule.source} ({rule.metric}): per = '{rule.per}' but the dump has no "
                            f"'{rule.per}' column")
        elif rule.per is not None and rule.per not in PER_COLUMNS:
            problem = dataset.group_column_problem(rule.per)
            if problem is not None:
                problems.append(f"{rule.source} ({rule.metric}): per = '{rule.per}': {problem}")
    if problems:
        raise UsageError("; ".join(problems))
    if baseline is not None:
        for rule in rules:
            if rule.needs_baseline:
                baseline.value(rule)




def _prox_figures(
    dataset: RolloutDataset, rules: Sequence[Rule], rule_set: RuleSet, config: AnalyzeConfig, workers: int
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Run ``compare-prox`` for the methods the ``prox/…`` rules name (figures, omitted reasons, its config)."""
    module = _compare_prox_module()
    if module is None:  # known_metrics() had no prox keys, so validate_rules already refused these rules
        raise UsageError("prox/ rules need compare-prox, which this build lacks")
    methods = tuple(dict.fromkeys(r.metric.split("/")[1] for r in rules if r.metric.count("/") >= 2))
    prox_config = compare_prox_config(config, rule_set, methods=methods or None)
    try:
        module.check_columns(dataset, prox_config)
    except InputError as exc:
        # A missing column: every prox key "cannot be computed", with compare-prox's reason.
        return {}, dict.fromkeys(module.expected_keys(prox_config), exc.reason), prox_config.to_json()
    result = module.compare_prox(dataset, prox_config, workers=workers)
    metrics = {k: v for k, v in result.metrics.items() if k.startswith("prox/")}
    omitted = {k: v for k, v in result.omitted.items() if k.startswith("prox/")}
    return metrics, omitted, result.config


class _ValidationOfEveryColumn(ValidationGroup):
    """The validation group, reading ``columns``: the log-prob columns a run validates are the ones it reads, so
    a check computing fewer groups reads every column a full run would, and drops the same invalid sequences."""

    def __init__(self, columns: frozenset[str]) -> None:
        self._columns = columns

    def columns(self) -> frozenset[str]:
        return self._columns


def check_groups(
    rules: Sequence[Rule], select: Sequence[str] | None = None, ignore: Sequence[str] = ()
) -> tuple[list[MetricGroup], list[str]]:
    """The metric groups that compute the rules' metrics and the inputs of the detectors ``select``/``ignore``
    choose (with the detectors that can demote theirs: :func:`grpo_cli.findings.detector_inputs`), and the names of
    the findings-only groups those detectors read.

    Validation, the dump counts and the policy group always run (:func:`grpo_cli.metrics.select_groups`), and
    validation reads every column a full run reads, so the invalid sequences and every figure computed are the
    same as when every group runs.
    """
    every = default_groups()
    keys, diagnosis = detector_inputs(selected_codes(select, ignore))
    patterns = _declared(every, [*(r.metric for r in rules), *keys])
    read = frozenset().union(*(group.columns() for group in [*every, *diagnosis_groups()]))
    chosen = [_ValidationOfEveryColumn(read) if isinstance(group, ValidationGroup) else group
              for group in select_groups(every, list(dict.fromkeys(patterns)))]
    return chosen, diagnosis


def grouped_by(groups: list[MetricGroup] | None, rules: Sequence[Rule], column: str) -> list[MetricGroup] | None:
    """``groups`` for the pass grouped by ``column``: the groups of the metrics its ``per = column`` rules read run
    per value too, every other one over the whole dump only (:func:`~grpo_cli.engine.group.overall_only`: its
    per-value figures would never be read). ``None`` (every group, for ``--save-baseline``) stays ``None``."""
    if groups is None:
        return None
    patterns = _declared(groups, [r.metric for r in rules if r.per == column])
    per_value = {group.name for group in select_groups(groups, list(dict.fromkeys(patterns)))}
    return [group if group.name in per_value else overall_only(group) for group in groups]


def _declared(groups: Sequence[MetricGroup], patterns: Sequence[str]) -> list[str]:
    # Keys no analyze group declares (check's sanity/*, compare-prox's prox/*) name no group; the rules on them are
    # evaluated (or refused) as before.
    declared = [figure.key for group in groups for figure in group.figures]
    return [p for p in patterns if any(fnmatch.fnmatchcase(k, p) for k in declared)]


def dump_baseline(
    base: RolloutDataset,
    dataset: RolloutDataset,
    rules: Sequence[Rule],
    config: AnalyzeConfig,
    metrics: Mapping[str, Any],
    z: float | None = None,
    base_config: AnalyzeConfig | None = None,
    workers: int = 1,
) -> Baseline:
    """A baseline measured from a rollout dump, with each baseline-relative rule's change interval.

    Both runs are streamed once more through the groups of those rules' metrics, split into blocks, and each
    figure's change gets the interval ``grpo-cli diff`` gives it (delete-a-block jackknife over both runs,
    :func:`grpo_cli.commands.diff.measure` and :func:`~grpo_cli.commands.diff.change_interval`, ``z`` default
    :data:`~grpo_cli.commands.diff.DEFAULT_Z`). Figures without an interval (extremes, quantiles, constants) are
    compared as fixed margins. ``metrics`` are this run's figures from the main pass (the values the rules test).
    ``base_config`` (default ``config``) measures the baseline run, as ``diff`` measures each run with its own
    options; ``workers`` as in :func:`run_check`.
    """
    from grpo_cli.commands.diff import DEFAULT_Z, DiffConfig, change_interval, measure

    relative = [r for r in rules if r.needs_baseline and not r.is_prox]
    groups, _ = check_groups(relative, select=[])
    def diff_config(analyze_config: AnalyzeConfig) -> DiffConfig:
        return DiffConfig(**{f.name: getattr(analyze_config, f.name) for f in fields(analyze_config)},
                          z=z or DEFAULT_Z)

    options = diff_config(config)
    base_run = measure(base, options if base_config is None else diff_config(base_config), "baseline", groups=groups,
                       workers=workers)
    new_run = measure(dataset, options, "new", groups=groups, workers=workers)
    base_metrics = dict(base_run.result.metrics)
    base_metrics.update(sanity_figures(base_metrics))
    intervals: dict[str, tuple[float, float]] = {}
    for rule in relative:
        b, n = base_metrics.get(rule.metric), metrics.get(rule.metric)
        if b is None or n is None or not (_is_number(b) and _is_number(n)):
            continue
        change = change_interval(float(b), float(n), base_run.variances.get(rule.metric),
                                 new_run.variances.get(rule.metric), options.z,
                                 dof_base=base_run.n_blocks - 1, dof_new=new_run.n_blocks - 1)
        if change.low is not None and change.high is not None:
            intervals[rule.metric] = (change.low, change.high)
    return Baseline(", ".join(base_run.result.inputs), base_metrics, dict(base_run.result.config),
                    dict(base_run.result.omitted), intervals=intervals, from_dump=True)


def run_check(
    dataset: RolloutDataset,
    rule_set: RuleSet,
    config: AnalyzeConfig,
    *,
    baseline: Baseline | None = None,
    warn_only: bool = False,
    require_valid_input: bool = False,
    progress: Callable[[int], None] | None = None,
    findings: DetectConfig | None = None,
    select: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
    all_figures: bool = False,
    baseline_dump: RolloutDataset | None = None,
    baseline_config: AnalyzeConfig | None = None,
    workers: int = 1,
) -> CheckReport:
    """Compute the figures the rules need, evaluate every rule and run the detectors as built-in rules.

    ``require_valid_input`` (the second value of :func:`analyze_config`) adds :func:`valid_input_rule` first. With
    ``findings`` (default: the detectors' defaults), every detector of :mod:`grpo_cli.findings` whose code or category
    ``select`` names (all when ``None``) and ``ignore`` does not is one more rule: an ``error`` finding fails it, a
    ``warning`` warns (:func:`finding_results`).

    Only the metric groups of the rules' metrics and the chosen detectors' inputs run (:func:`check_groups`), with
    the same rule results and findings as computing everything; ``all_figures`` (``--save-baseline``) computes every
    figure. ``baseline_dump`` (instead of ``baseline``) is a baseline run's rollout dump: the baseline-relative
    bounds then fail only when the change is beyond noise (:func:`dump_baseline`); ``baseline_config`` (default
    ``config``) is the options that run is measured with. ``workers`` (processes and threads, as ``analyze
    --workers``) changes no result.

    Raises:
        UsageError: unknown metrics, bad ``per`` columns, missing baseline values, rules on metrics the dump cannot
            provide (non-optional) — all problems of one kind in one message (exit 2).
        InputError: unreadable data, or no valid token at all (exit 2).
    """
    from grpo_cli.commands.analyze import analyze

    rules = rule_set.rules
    validate_rules(rules, dataset, baseline, baseline_dump=baseline_dump is not None)
    per_columns = list(dict.fromkeys(r.per for r in rules if r.per is not None))
    # One pass per grouping column; the first also gives the overall figures.
    metric_groups, diagnosis = check_groups(rules, select, ignore) if not all_figures else (None, None)
    first = analyze(dataset, replace(config, group_by=per_columns[0] if per_columns else None),
                    groups=grouped_by(metric_groups, rules, per_columns[0]) if per_columns else metric_groups,
                    progress=progress, workers=workers, findings=findings or DetectConfig(), diagnosis=diagnosis)
    groups: dict[str, list[dict[str, Any]]] = {}
    if per_columns:
        groups[per_columns[0]] = first.groups
    for column in per_columns[1:]:
        groups[column] = analyze(dataset, replace(config, group_by=column),
                                 groups=grouped_by(metric_groups, rules, column), workers=workers).groups
    # analyze() has already refused (exit 2) a dump with no rows, no valid token or every sequence invalid.
    metrics, omitted = dict(first.metrics), dict(first.omitted)
    metrics.update(sanity_figures(metrics))
    if require_valid_input and config.on_invalid == "skip":
        rules = [valid_input_rule(metrics), *rules]
    report_config = replace(config, group_by=None).to_json()
    report_config.pop("group_by", None)
    report_config.pop("top_k", None)
    prox_rules = [r for r in rules if r.is_prox]
    if prox_rules:
        prox_metrics, prox_omitted, prox_config = _prox_figures(dataset, prox_rules, rule_set, config, workers)
        metrics.update(prox_metrics)
        omitted.update(prox_omitted)
        report_config["compare_prox"] = prox_config

    if baseline_dump is not None and any(r.needs_baseline for r in rules):
        baseline = dump_baseline(baseline_dump, dataset, rules, config, metrics, base_config=baseline_config,
                                 workers=workers)
    results = evaluate_rules(rules, metrics, groups, baseline, omitted)
    chosen = select_findings(first.findings, select, ignore)
    results = finding_results(chosen) + results

    notes = []
    if baseline is not None and any(r.needs_baseline for r in rules):
        for difference in baseline.config_differences(report_config):
            notes.append(f"--baseline {baseline.path} was computed with other options ({difference}): "
                         "figures that depend on it are not comparable")
    return CheckReport(
        results=results,
        metrics=metrics,
        omitted=omitted,
        inputs=first.inputs,
        config=report_config,
        columns=first.columns,
        sources=rule_set.sources,
        baseline=baseline.path if baseline is not None else None,
        warn_only=warn_only,
        notes=notes,
        findings=chosen,
    )

