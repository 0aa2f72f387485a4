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

import difflib
import enum
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from grpo_cli.engine.config import GROUP_BY_COLUMNS as PER_COLUMNS  # the columns `analyze --group-by` accepts
from grpo_cli.errors import EXIT_CHECK_FAILED, EXIT_OK, InputError, UsageError
from grpo_cli.findings import CODES, SEVERITIES, DetectConfig
from grpo_cli.findings import select as select_findings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

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
    "evaluate_rule",
    "fmt",
    "known_metrics",
    "load_baseline",
    "load_rules",
    "parse_rules",
    "preset",
    "run_check",
    "sanity_figures",
    "valid_input_rule",
]

BOUND_KEYS = ("min", "max", "max_rel_increase", "max_abs_change")
"""The bounds a rule may set (at least one; several are intersected)."""

RULE_KEYS = ("metric", *BOUND_KEYS, "severity", "per", "name", "hint", "optional")
"""Every key a ``[[rule]]`` table accepts."""


_TABLES = ("rule", "analyze", "compare_prox")
# AnalyzeConfig / CompareProxConfig fields that say how a pass runs, not what a figure is, or that check sets itself.
_NOT_FROM_FILE = frozenset({"device", "batch_tokens", "group_by", "max_groups", "top_k", "methods"})
# Options that select figures or handle invalid rows but never change a figure's definition: a baseline computed
# with other values is still comparable.
_CONFIG_NOT_COMPARED = frozenset({"top_k", "group_by", "methods", "max_groups", "losses", "on_invalid"})


class Severity(str, enum.Enum):
    """What a violated rule does: ``error`` fails the check (exit 1), ``warn`` only reports."""

    ERROR = "error"
    WARN = "warn"


class Status(str, enum.Enum):
    """A rule's outcome. ``skipped``: an ``optional`` rule whose metric this dump cannot provide."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Rule:
    """One bound on one metric.

    Attributes:
        metric: a key ``analyze`` or ``compare-prox`` reports (``docs/metrics.md``).
        min, max: absolute bounds (inclusive).
        max_rel_increase: ``(value − base) / |base| ≤ this`` with ``base`` the baseline's value (0.5 = +50 %).
        max_abs_change: ``|value − base| ≤ this``.
        severity: ``error`` (fails the check) or ``warn``.
        per: a per-sequence integer column (``step``, ``current_version``, ``group_id``, ``seq_id``): the bound
            must hold in every group; the worst group is reported.
        name: how reports name the rule (default: the metric, plus ``per …``).
        hint: appended to the violation message (what to look at).
        optional: report the rule as ``skipped`` instead of exiting 2 when the dump cannot provide the metric.
        source: where the rule came from (file and index, or preset), for error messages.
    """

    metric: str
    min: float | None = None
    max: float | None = None
    max_rel_increase: float | None = None
    max_abs_change: float | None = None
    severity: Severity = Severity.ERROR
    per: str | None = None
    name: str | None = None
    hint: str | None = None
    optional: bool = False
    source: str = "rule"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"'metric' must be a non-empty string, got {self.metric!r}")
        for key in BOUND_KEYS:
            value = getattr(self, key)
            if value is not None and not _is_number(value):
                raise ValueError(f"'{key}' must be a number, got {value!r}")
            if value is not None and not math.isfinite(value):
                raise ValueError(f"'{key}' must be finite, got {value!r}")
        if all(getattr(self, key) is None for key in BOUND_KEYS):
            raise ValueError(f"no bound: set at least one of {', '.join(BOUND_KEYS)}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        if self.max_abs_change is not None and self.max_abs_change < 0:
            raise ValueError(f"'max_abs_change' must be >= 0, got {self.max_abs_change}")
        try:
            object.__setattr__(self, "severity", Severity(self.severity))
        except ValueError:
            raise ValueError(f"'severity' must be 'error' or 'warn', got {self.severity!r}") from None
        if self.per is not None and (not isinstance(self.per, str) or not self.per):
            raise ValueError(f"'per' must be a per-sequence column name ({', '.join(PER_COLUMNS)}, or any other "
                             f"such as a task string), got {self.per!r}")
        for key in ("name", "hint"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ValueError(f"'{key}' must be a string, got {getattr(self, key)!r}")
        if not isinstance(self.optional, bool):
            raise ValueError(f"'optional' must be true or false, got {self.optional!r}")

    @property
    def label(self) -> str:
        """The rule's name in reports."""
        if self.name:
            return self.name
        return self.metric if self.per is None else f"{self.metric} per {self.per}"

    @property
    def needs_baseline(self) -> bool:
        return self.max_rel_increase is not None or self.max_abs_change is not None

    @property
    def is_prox(self) -> bool:
        """A ``compare-prox`` key (computed by :func:`grpo_cli.commands.compare_prox.compare_prox`)."""
        return self.metric.startswith("prox/")

    def bounds_json(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in BOUND_KEYS if getattr(self, key) is not None}


@dataclass
class RuleSet:
    """Rules plus the ``[analyze]`` / ``[compare_prox]`` options they were written for."""

    rules: list[Rule] = field(default_factory=list)
    analyze: dict[str, Any] = field(default_factory=dict)
    compare_prox: dict[str, Any] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def merge(self, other: RuleSet) -> RuleSet:
        """Both rule lists; options set in both must agree (else exit 2)."""
        for table in ("analyze", "compare_prox"):
            mine, theirs = getattr(self, table), getattr(other, table)
            for key in mine.keys() & theirs.keys():
                if mine[key] != theirs[key]:
                    raise UsageError(
                        f"[{table}] {key}: {', '.join(self.sources)} set {mine[key]!r} but "
                        f"{', '.join(other.sources)} sets {theirs[key]!r}"
                    )
        return RuleSet(
            rules=[*self.rules, *other.rules],
            analyze={**self.analyze, **other.analyze},
            compare_prox={**self.compare_prox, **other.compare_prox},
            sources=[*self.sources, *other.sources],
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(name: str, choices: Sequence[str] | set[str]) -> str:
    matches = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


# -- parsing ---------------------------------------------------------------------------------------------------------


def parse_rules(text: str, source: str = "rules") -> RuleSet:
    """Parse a rules file's TOML ``text``; every problem is collected and raised as one :class:`UsageError`.

    Example:
        >>> rs = parse_rules('[analyze]\\nepsilon = 0.28\\n[[rule]]\\nmetric = "clip/ratio"\\nmax = 0.2\\n')
        >>> rs.analyze, rs.rules[0].label, rs.rules[0].severity.value
        ({'epsilon': 0.28}, 'clip/ratio', 'error')
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML ({exc})") from None
    problems: list[str] = []
    for key in data:
        if key not in _TABLES:
            problems.append(f"unknown top-level key '{key}'{_close(key, _TABLES)} (allowed: {', '.join(_TABLES)})")
    tables = data.get("rule", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        problems.append("'rule' must be an array of tables: write each rule under [[rule]]")
        tables = []
    rules: list[Rule] = []
    known = known_metrics() if tables else set()
    for index, table in enumerate(tables, start=1):
        where = f"rule {index}" + (f" ({table['metric']})" if isinstance(table.get("metric"), str) else "")
        unknown = [key for key in table if key not in RULE_KEYS]
        for key in unknown:
            problems.append(f"{where}: unknown key '{key}'{_close(key, RULE_KEYS)}")
        if "metric" not in table:
            problems.append(f"{where}: 'metric' is required")
            continue
        # The known keys are still checked (bounds, severity, …): every problem of a file in one message.
        if isinstance(table["metric"], str):
            problems.extend(metric_problems(table["metric"], where, known))
        try:
            rule = Rule(**{k: v for k, v in table.items() if k in RULE_KEYS}, source=f"{source} {where}")
        except (ValueError, TypeError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not unknown:
            rules.append(rule)
    options: dict[str, dict[str, Any]] = {}
    for table in ("analyze", "compare_prox"):
        values = data.get(table, {})
        if not isinstance(values, dict):
            problems.append(f"'{table}' must be a table: write [{table}]")
            values = {}
        options[table] = values
    problems.extend(_option_problems("analyze", options["analyze"], _analyze_config_type())[1])
    prox_module = _compare_prox_module()
    if prox_module is not None:
        problems.extend(_option_problems("compare_prox", options["compare_prox"], prox_module.CompareProxConfig)[1])
    if problems:
        raise UsageError(f"{source}: " + "; ".join(problems))
    return RuleSet(rules, options["analyze"], options["compare_prox"], [source])


def load_rules(path: str | Path) -> RuleSet:
    """Read and parse a rules file (exit 2 when unreadable or invalid)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--rules {path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--rules {path}: not UTF-8 text") from None
    return parse_rules(text, str(path))


SANITY_RATIO_MAX = 1e4
"""``ratio/max`` bound of the sanity preset: exp(9.2). A shifted or mis-tokenised log-prob column gives ratios far
beyond it; genuine staleness in a healthy run stays orders of magnitude below (the sample run's largest is 209)."""

SANITY_ON_POLICY_DEV_MAX = 0.2
"""``sanity/on_policy_ratio_dev`` bound of the sanity preset (a warning): on-policy tokens should have r ≈ 1."""


def _sanity() -> list[Rule]:
    src = "preset sanity"
    return [
        Rule("n_valid_tokens", min=1, name="sanity: at least one valid token", source=src,
             hint="loss_mask is 0 everywhere: check the mask column (or --map loss_mask=...)"),
        Rule("sanity/n_nonfinite_logp", max=0, name="sanity: no NaN/inf log-prob", source=src,
             hint="`grpo-cli analyze --on-invalid error` names the first one's file, row and token"),
        Rule("sanity/n_positive_logp", max=0, name="sanity: log-probs <= 0", source=src,
             hint="positive log-probs are usually negative log-likelihoods or logits dumped as log-probs"),
        Rule("ratio/max", max=SANITY_RATIO_MAX, name="sanity: ratio/max below 1e4", optional=True, source=src,
             hint="a huge ratio usually means new/old log-probs are misaligned (shifted by one token?)"),
        Rule("sanity/on_policy_ratio_dev", max=SANITY_ON_POLICY_DEV_MAX, severity=Severity.WARN, optional=True,
             name="sanity: on-policy ratio near 1", source=src,
             hint="trainer and inference engine disagree on tokens of the current policy (dtype, kernels, sampling "
             "parameters such as temperature or top-p)"),
    ]


PRESETS: dict[str, Callable[[], list[Rule]]] = {"sanity": _sanity}
"""Built-in rule sets (``--rules-preset NAME``); ``docs/check.md`` documents each rule."""


def preset(name: str) -> RuleSet:
    """A built-in rule set by name (exit 2 for an unknown name)."""
    if name not in PRESETS:
        raise UsageError(f"--rules-preset: unknown preset '{name}'{_close(name, list(PRESETS))} "
                         f"(available: {', '.join(PRESETS)})")
    return RuleSet(PRESETS[name](), sources=[f"preset {name}"])


def _analyze_config_type() -> type:
    from grpo_cli.metrics.config import AnalyzeConfig

    return AnalyzeConfig


def _coerce_options(table: str, values: Mapping[str, Any], config_type: type) -> dict[str, Any]:
    """Check ``[table]`` keys against the dataclass fields of ``config_type`` and their declared types."""
    out, problems = _option_problems(table, values, config_type)
    if problems:
        raise UsageError("; ".join(problems))
    return out


def _option_problems(table: str, values: Mapping[str, Any], config_type: type) -> tuple[dict[str, Any], list[str]]:
    """The typed ``[table]`` options and every problem found in them (unknown keys, wrong types)."""
    allowed = {f.name: str(f.type) for f in fields(config_type) if f.name not in _NOT_FROM_FILE}
    out: dict[str, Any] = {}
    problems = []
    for key, value in values.items():
        if key not in allowed:
            problems.append(f"[{table}] unknown option '{key}'{_close(key, list(allowed))} "
                            f"(allowed: {', '.join(allowed)})")
            continue
        kind = allowed[key]
        if "tuple" in kind and isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[key] = tuple(value)
            continue
        fits = {
            "float": _is_number(value),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
        }
        if not any(fits[name] for name in fits if name in kind):
            problems.append(f"[{table}] {key} must be of type {kind}, got {value!r}")
            continue
        out[key] = float(value) if "float" in kind and _is_number(value) else value
    return out, problems


def analyze_config(rule_set: RuleSet, *, all_figures: bool = False, **overrides: Any) -> tuple[AnalyzeConfig, bool]:
    """The ``AnalyzeConfig`` for a check: defaults, then the rules' ``[analyze]`` table, then ``overrides``
    (command-line options; ``None`` means "not given").

    Unless ``all_figures`` (``--save-baseline``) or the rules file sets ``losses``, only the ``loss/*`` figures the
    rules name are computed: the loss objects are the most expensive figures, and a gate needs only its own.

    Returns:
        The config, and whether invalid input must fail the check: when ``on_invalid`` is chosen nowhere, check
        validates with ``skip`` (so every rule is still evaluated, on the valid sequences) and adds the rule
        :func:`valid_input_rule`; an explicit ``skip`` accepts dropped sequences, an explicit ``error`` stops at the
        first invalid value (exit 2).
    """
    from grpo_cli.metrics.config import AnalyzeConfig

    values = _coerce_options("analyze", rule_set.analyze, AnalyzeConfig)
    values.update({key: value for key, value in overrides.items() if value is not None})
    require_valid = "on_invalid" not in values
    values.setdefault("on_invalid", "skip")
    if not all_figures and "losses" not in values:
        from grpo_cli.metrics.registry import KEYS

        # Unknown names are left to run_check, which lists close matches.
        named = {r.metric.split("/", 1)[1] for r in rule_set.rules if r.metric.startswith("loss/") and r.metric in KEYS}
        if "clip/dual" in {rule.metric for rule in rule_set.rules}:
            named.add("ppo")  # the dual-clip count comes with AReaL's PPO loss
        values["losses"] = tuple(sorted(named))
    values["top_k"] = 0  # top_kl is a list, never a rule's metric: skip the work
    config = AnalyzeConfig(**values)
    config.validate()
    return config, require_valid


def valid_input_rule(metrics: Mapping[str, Any]) -> Rule:
    """``invalid/n_sequences_skipped ≤ 0``: the rule check adds unless ``on_invalid`` was chosen explicitly; its
    hint lists what the validation found (``invalid/<reason>`` counts)."""
    reasons = ", ".join(f"{k.removeprefix('invalid/')}: {v}" for k, v in metrics.items()
                        if k.startswith("invalid/") and k not in _SKIP_TOTALS)
    hint = ("sequences failed validation and are left out of every other figure"
            + (f" ({reasons})" if reasons else "")
            + "; --on-invalid error names the first offender's file, row and token, --on-invalid skip accepts them")
    return Rule("invalid/n_sequences_skipped", max=0, name="input passes validation", hint=hint,
                source="check (--on-invalid not set)")


_SKIP_TOTALS = ("invalid/n_sequences_skipped", "invalid/n_tokens_skipped")


def sanity_figures(metrics: Mapping[str, Any]) -> dict[str, int]:
    """``sanity/n_nonfinite_logp`` and ``sanity/n_positive_logp`` from the validation counts.

    They are the sequences dropped for a NaN/±inf (resp. > tolerance) log-prob at a valid token, summed over the
    log-prob columns (a sequence bad in two columns counts twice). Under ``--on-invalid error`` any such value stops
    the run, so a finished run has 0; absent ``invalid/<reason>`` keys mean 0 (the validation reports non-zero
    reasons only).

    Example:
        >>> sanity_figures({"invalid/new_logp_not_finite": 2, "invalid/old_logp_positive": 1})
        {'sanity/n_nonfinite_logp': 2, 'sanity/n_positive_logp': 1}
    """
    from grpo_cli.core.logp_sanity import LOGP_COLUMNS

    def total(suffix: str) -> int:
        return sum(int(metrics.get(f"invalid/{column}_{suffix}", 0) or 0) for column in LOGP_COLUMNS)

    return {"sanity/n_nonfinite_logp": total("not_finite"), "sanity/n_positive_logp": total("positive")}


# -- metric names and baselines --------------------------------------------------------------------------------------


def _compare_prox_module() -> ModuleType | None:
    """``grpo_cli.commands.compare_prox`` when this build has it (imported lazily: only ``prox/…`` rules need it)."""
    try:
        import grpo_cli.commands.compare_prox as module
    except ModuleNotFoundError as exc:
        if exc.name != "grpo_cli.commands.compare_prox":
            raise
        return None
    return module


def metric_problems(metric: str, where: str, known: set[str] | None = None) -> list[str]:
    """What is wrong with a rule's ``metric`` before any data is read: an unknown key (with close matches) or a
    key whose value is a list or table (``top_kl``): rules compare one number against bounds."""
    from grpo_cli.metrics.registry import KEYS

    known = known_metrics() if known is None else known
    if metric not in known:
        return [f"{where}: unknown metric '{metric}'{_close(metric, known)}"]
    figure = KEYS.get(metric)
    if figure is not None and figure.reduce == "table":
        return [f"{where}: '{metric}' is a list (a table of rows), and lists cannot be rules; rules need a "
                "scalar metric"]
    return []


def known_metrics() -> set[str]:
    """Every key a rule may name: the documented keys (``grpo_cli.metrics.registry``) and every ``compare-prox`` key."""
    from grpo_cli.metrics.registry import KEYS

    known = set(KEYS)
    module = _compare_prox_module()
    if module is not None:
        known |= set(module.expected_keys(module.CompareProxConfig()))
    return known


@dataclass
class Baseline:
    """The ``metrics`` (and ``config``) of an earlier ``analyze``/``check``/``compare-prox --format json``."""

    path: str
    metrics: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    omitted: dict[str, str] = field(default_factory=dict)

    def value(self, rule: Rule) -> float:
        """The baseline's figure for ``rule`` (exit 2 when it has none)."""
        if rule.metric not in self.metrics:
            why = self.omitted.get(rule.metric)
            raise UsageError(
                f"{rule.source}: --baseline {self.path} has no '{rule.metric}'"
                + (f" (not computed there: {why})" if why else " (record baselines with `analyze --format json` "
                   "or `check --save-baseline`, which hold every figure)")
            )
        value = self.metrics[rule.metric]
        if value is None:
            raise UsageError(f"{rule.source}: --baseline {self.path}: '{rule.metric}' is null (it was not finite)")
        if not _is_number(value):
            raise UsageError(f"{rule.source}: --baseline {self.path}: '{rule.metric}' is not a number")
        return value

    def config_differences(self, config: Mapping[str, Any]) -> list[str]:
        """Options set differently here and in the baseline (figures computed with them are not comparable)."""
        return [
            f"{key}: baseline {self.config[key]!r}, this run {config[key]!r}"
            for key in sorted(self.config.keys() & config.keys())
            if key not in _CONFIG_NOT_COMPARED and self.config[key] != config[key]
        ]


def load_baseline(path: str | Path) -> Baseline:
    """Read a grpo-cli JSON report as a baseline (exit 2 when it is unreadable or has no ``metrics`` object)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the baseline ({exc.strerror or exc})", file=str(path)) from None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"the baseline is not JSON ({exc})", file=str(path)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), dict):
        raise InputError(
            "not a grpo-cli JSON report: no 'metrics' object (use the output of `analyze --format json` "
            "or `check --format json`)",
            file=str(path),
        )
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    omitted = doc.get("omitted") if isinstance(doc.get("omitted"), dict) else {}
    return Baseline(str(path), doc["metrics"], cast("dict[str, Any]", config), cast("dict[str, str]", omitted))


# -- evaluation ------------------------------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    """Numbers as reports show them (``grpo_cli._format.format_value``, without thousands separators)."""
    from grpo_cli._format import format_value

    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return format_value(value)


@dataclass(frozen=True)
class _Limit:
    value: float
    text: str
    derived: bool = False  # from the baseline: the message also shows the resulting number


def _limits(rule: Rule, base: float | None) -> tuple[_Limit | None, _Limit | None, list[str]]:
    """The binding lower and upper limits of ``rule`` and how the baseline-derived ones were formed.

    ``max_rel_increase`` r: (v − b)/|b| ≤ r ⇔ v ≤ b + r·|b|. With b = 0 this is v ≤ 0 (any increase from 0 is
    infinitely large). ``max_abs_change`` c: b − c ≤ v ≤ b + c.
    """
    lows: list[_Limit] = []
    highs: list[_Limit] = []
    notes: list[str] = []
    if rule.min is not None:
        lows.append(_Limit(rule.min, f"min {fmt(rule.min)}"))
    if rule.max is not None:
        highs.append(_Limit(rule.max, f"max {fmt(rule.max)}"))
    if base is not None and rule.max_rel_increase is not None:
        r = rule.max_rel_increase
        text = f"baseline {fmt(base)} {'+' if r >= 0 else '−'}{fmt(abs(r) * 100)}%"
        highs.append(_Limit(base + r * abs(base), text, derived=True))
        notes.append(text)
    if base is not None and rule.max_abs_change is not None:
        c = rule.max_abs_change
        lows.append(_Limit(base - c, f"baseline {fmt(base)} − {fmt(c)}", derived=True))
        highs.append(_Limit(base + c, f"baseline {fmt(base)} + {fmt(c)}", derived=True))
        notes.append(f"baseline {fmt(base)} ± {fmt(c)}")
    low = max(lows, key=lambda limit: limit.value) if lows else None
    high = min(highs, key=lambda limit: limit.value) if highs else None
    return low, high, notes


def _bound_text(low: _Limit | None, high: _Limit | None, notes: list[str]) -> str:
    if low is not None and high is not None:
        text = f"in [{fmt(low.value)}, {fmt(high.value)}]"
    elif high is not None:
        text = f"≤ {fmt(high.value)}"
    else:
        assert low is not None
        text = f"≥ {fmt(low.value)}"
    return f"{text} ({'; '.join(notes)})" if notes else text


def _excess(value: Any, low: _Limit | None, high: _Limit | None) -> float:
    """How far ``value`` lies outside [low, high] (> 0: violated; ≤ 0: inside, by that margin).

    A non-finite or null value violates every rule (no figure grpo-cli reports is healthy at NaN or ±inf, and
    ``null`` means the figure has no value, e.g. ``max_safe_lag`` when no lag is safe): +inf.
    """
    if value is None:
        return math.inf
    v = float(value)
    if not math.isfinite(v):
        return math.inf
    below = low.value - v if low is not None else -math.inf
    above = v - high.value if high is not None else -math.inf
    return max(below, above)


def _describe(metric: str, value: Any, low: _Limit | None, high: _Limit | None) -> str:
    """``metric = v is above max 0.05`` (and ``= limit`` when the limit came from the baseline)."""
    if value is None:
        return f"{metric} has no value (null)"
    v = float(value)
    if math.isnan(v):
        return f"{metric} is NaN"
    if not math.isfinite(v):
        return f"{metric} is {'+' if v > 0 else '-'}inf"
    if low is not None and v < low.value:
        side, limit = "below", low
    else:
        assert high is not None
        side, limit = "above", high
    tail = f" = {fmt(limit.value)}" if limit.derived else ""
    return f"{metric} = {fmt(value)} is {side} {limit.text}{tail}"


@dataclass
class RuleResult:
    """A rule's outcome. With ``per``, ``value``/``group`` are the worst group's (the one furthest outside the
    bound, or nearest to it when all pass) and ``violations`` lists every violating group, worst first."""

    rule: Rule
    status: Status
    value: float | int | None = None
    group: int | None = None
    bound: str = ""
    low: float | None = None
    high: float | None = None
    baseline: float | None = None
    change: float | None = None
    """``value − baseline`` with a baseline, computed as ``diff`` does
    (:func:`~grpo_cli.commands.diff.relative_change`); ``rel_change`` divides it by ``|baseline|``."""
    rel_change: float | None = None
    message: str = ""
    n_groups: int | None = None
    violations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def where(self) -> str:
        """``step 82`` with the count of violating groups, or ``""`` without ``per``."""
        if self.rule.per is None or self.group is None:
            return ""
        text = f"{self.rule.per} {self.group}"
        if self.violations:
            return f"{text} ({len(self.violations)}/{self.n_groups} violate)"
        return f"{text} (closest of {self.n_groups})"

    def to_json(self) -> dict[str, Any]:
        rule = self.rule
        return {
            "name": rule.label,
            "metric": rule.metric,
            "severity": rule.severity.value,
            "status": self.status.value,
            "value": self.value,
            "bound": self.bound,
            "limits": {"min": self.low, "max": self.high},
            "bounds": rule.bounds_json(),
            "baseline": self.baseline,
            "change": self.change,
            "rel_change": self.rel_change,
            "per": rule.per,
            "group": self.group,
            "n_groups": self.n_groups,
            "violations": self.violations,
            "message": self.message,
            "source": rule.source,
        }


_PLURAL = {"step": "steps", "current_version": "versions", "group_id": "groups", "seq_id": "sequences"}


def _with_hint(rule: Rule, message: str) -> str:
    return f"{message} — {rule.hint}" if rule.hint else message


def evaluate_rule(
    rule: Rule,
    metrics: Mapping[str, Any],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: Baseline | None,
    *,
    omitted: Mapping[str, str] | None = None,
) -> RuleResult:
    """Evaluate one rule against overall ``metrics`` or, with ``rule.per``, against ``groups[rule.per]``
    (``[{"key": k, "metrics": {...}}, ...]`` as :class:`~grpo_cli.engine.run.AnalysisResult.groups`).

    A metric the figures lack gives ``skipped`` for an ``optional`` rule and raises :class:`UsageError` (exit 2)
    otherwise, with the reason from ``omitted``.
    """
    base = baseline.value(rule) if baseline is not None and rule.needs_baseline else None
    if rule.needs_baseline and baseline is None:
        raise UsageError(f"{rule.source} ({rule.metric}): max_rel_increase/max_abs_change need --baseline")
    low, high, notes = _limits(rule, base)
    bound = _bound_text(low, high, notes)
    result = RuleResult(rule, Status.PASS, bound=bound, low=low.value if low else None,
                        high=high.value if high else None, baseline=base)

    if rule.per is None:
        candidates = [(None, metrics[rule.metric])] if rule.metric in metrics else []
    else:
        candidates = [(g["key"], g["metrics"][rule.metric]) for g in groups.get(rule.per, ())
                      if rule.metric in g["metrics"]]
    if not candidates:
        if rule.per is not None and rule.metric in metrics:
            reason = f"it is reported for the whole dump only, not per {rule.per}"
        else:
            reason = (omitted or {}).get(rule.metric, "not reported for this dump")
        if rule.optional:
            result.status = Status.SKIPPED
            subject = rule.metric if rule.per is None else f"{rule.metric} per {rule.per}"
            result.message = f"{subject} not computed: {reason}"
            return result
        raise UsageError(f"{rule.source}: '{rule.metric}' cannot be computed for this dump: {reason}")
    for _, value in candidates:
        if value is not None and not _is_number(value):
            kind = "a list or table" if isinstance(value, (list, dict)) else type(value).__name__
            raise UsageError(f"{rule.source}: '{rule.metric}' is not a number ({kind}); rules need a scalar metric")

    excess = [_excess(value, low, high) for _, value in candidates]
    worst = max(range(len(candidates)), key=lambda i: excess[i])  # first of equals: the smallest group key
    result.group, result.value = candidates[worst]
    if base is not None and _is_number(result.value):
        from grpo_cli.commands.diff import relative_change

        result.change, result.rel_change = relative_change(float(base), float(result.value))
    violated = [i for i in sorted(range(len(candidates)), key=lambda i: -excess[i]) if excess[i] > 0]
    if rule.per is not None:
        result.n_groups = len(candidates)
        result.violations = [{"group": candidates[i][0], "value": candidates[i][1]} for i in violated]
    if not violated:
        if rule.per is None:
            result.message = f"{rule.metric} = {fmt(result.value)}, {bound}"
        else:
            plural = _PLURAL.get(rule.per, f"{rule.per} groups")
            result.message = (f"{rule.metric} {bound} in all {len(candidates)} {plural} "
                              f"(closest: {rule.per} {result.group}, {fmt(result.value)})")
        return result

    result.status = Status.FAIL if rule.severity is Severity.ERROR else Status.WARN
    message = _describe(rule.metric, result.value, low, high)
    if rule.per is not None:
        shown = ", ".join(str(candidates[i][0]) for i in violated[:8]) + (", …" if len(violated) > 8 else "")
        plural = _PLURAL.get(rule.per, f"{rule.per} groups")
        message = (f"{message} at {rule.per} {result.group}; "
                   f"{len(violated)} of {len(candidates)} {plural} violate: {shown}")
    result.message = _with_hint(rule, message)
    return result


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

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "exit_code": self.exit_code,
            "n_rules": len(self.results),
            "n_passed": self.count(Status.PASS),
            "n_warnings": self.count(Status.WARN),
            "n_failed": self.count(Status.FAIL),
            "n_skipped": self.count(Status.SKIPPED),
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
        word = {Status.FAIL: "FAILED", Status.WARN: "passed with warnings", Status.PASS: "passed"}[self.status]
        if self.status is Status.FAIL and self.warn_only:
            word = "FAILED (--warn-only: exit 0)"
        return f"{word} — {len(self.results)} rules: {', '.join(parts)}"


def validate_rules(rules: Sequence[Rule], dataset: RolloutDataset, baseline: Baseline | None) -> None:
    """Everything that can be checked before reading the data (all problems in one exit-2 message)."""
    known = known_metrics()
    problems = []
    for rule in rules:
        problems.extend(metric_problems(rule.metric, rule.source, known))
        if rule.needs_baseline and baseline is None:
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


def compare_prox_config(
    config: AnalyzeConfig,
    rule_set: RuleSet,
    *,
    methods: Sequence[str] | None = None,
    tolerance: float | None = None,
) -> Any:
    """The ``compare-prox`` config that goes with an ``analyze`` config and a rule set (validated).

    Options both commands have (ε, dual clip, rejection sampling, ``current_version``, ``on_invalid``, …) come from
    the analyze config, so both passes define figures alike; the rules' ``[compare_prox]`` table sets the rest and
    may override them; ``methods`` / ``tolerance`` (command line) override both.
    """
    from grpo_cli.commands.compare_prox import CompareProxConfig

    shared = {f.name for f in fields(CompareProxConfig)} - {"methods", "tolerance"}
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name in shared}
    values.update(_coerce_options("compare_prox", rule_set.compare_prox, CompareProxConfig))
    if methods:
        values["methods"] = tuple(methods)
    if tolerance is not None:
        values["tolerance"] = tolerance
    prox_config = CompareProxConfig(**values)
    prox_config.validate()
    return prox_config


def _prox_figures(
    dataset: RolloutDataset, rules: Sequence[Rule], rule_set: RuleSet, config: AnalyzeConfig
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
    result = module.compare_prox(dataset, prox_config)
    metrics = {k: v for k, v in result.metrics.items() if k.startswith("prox/")}
    omitted = {k: v for k, v in result.omitted.items() if k.startswith("prox/")}
    return metrics, omitted, result.config


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
) -> CheckReport:
    """Compute the figures the rules need, evaluate every rule and run the detectors as built-in rules.

    ``require_valid_input`` (the second value of :func:`analyze_config`) adds :func:`valid_input_rule` first. With
    ``findings`` (default: the detectors' defaults), every detector of :mod:`grpo_cli.findings` whose code or category
    ``select`` names (all when ``None``) and ``ignore`` does not is one more rule: an ``error`` finding fails it, a
    ``warning`` warns (:func:`finding_results`).

    Raises:
        UsageError: unknown metrics, bad ``per`` columns, missing baseline values, rules on metrics the dump cannot
            provide (non-optional) — all problems of one kind in one message (exit 2).
        InputError: unreadable data, or no valid token at all (exit 2).
    """
    from grpo_cli.commands.analyze import analyze

    rules = rule_set.rules
    validate_rules(rules, dataset, baseline)
    per_columns = list(dict.fromkeys(r.per for r in rules if r.per is not None))
    # One pass per grouping column; the first also gives the overall figures.
    first = analyze(dataset, replace(config, group_by=per_columns[0] if per_columns else None),
                    progress=progress, findings=findings or DetectConfig())
    groups: dict[str, list[dict[str, Any]]] = {}
    if per_columns:
        groups[per_columns[0]] = first.groups
    for column in per_columns[1:]:
        groups[column] = analyze(dataset, replace(config, group_by=column)).groups
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
        prox_metrics, prox_omitted, prox_config = _prox_figures(dataset, prox_rules, rule_set, config)
        metrics.update(prox_metrics)
        omitted.update(prox_omitted)
        report_config["compare_prox"] = prox_config

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


def evaluate_rules(
    rules: Sequence[Rule],
    metrics: Mapping[str, Any],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: Baseline | None,
    omitted: Mapping[str, str],
) -> list[RuleResult]:
    """Evaluate every rule (:func:`evaluate_rule`, never stopping at the first); the problems that make rules
    impossible to evaluate are raised together as one :class:`UsageError` (exit 2). ``check`` and ``report`` both
    evaluate their rules here."""
    results: list[RuleResult] = []
    problems: list[str] = []
    for rule in rules:
        try:
            results.append(evaluate_rule(rule, metrics, groups, baseline, omitted=omitted))
        except UsageError as exc:
            problems.append(str(exc))
    if problems:
        raise UsageError("; ".join(problems))
    return results


_FINDING_STATUS = {"error": Status.FAIL, "warning": Status.WARN}


def finding_results(findings: Sequence[Mapping[str, Any]]) -> list[RuleResult]:
    """One rule per detector code with a finding at ``warning`` or ``error``: it fails on an ``error`` (exit 1) and
    warns on a ``warning``; ``info`` findings stay in the report's ``findings`` without a rule row."""
    results = []
    for code, (category, name) in CODES.items():
        mine = [f for f in findings if f["code"] == code and f["severity"] in _FINDING_STATUS]
        if not mine:
            continue
        worst = max(mine, key=lambda f: SEVERITIES.index(f["severity"]))
        rule = Rule(code, max=0, name=f"{code} {name}", source=f"findings (grpo-cli explain {code})",
                    hint=worst.get("fix"))
        message = f"{code} [{category}] {worst['severity']}: {worst['title']}"
        results.append(RuleResult(rule, _FINDING_STATUS[worst["severity"]], bound=worst["severity"],
                                  message=_with_hint(rule, message)))
    return results
