"""``check``'s rules: the :class:`Rule` and :class:`RuleSet` types, reading and validating rules files (every
problem of a file in one message), the built-in presets, and the ``analyze``/``compare-prox`` options a rule set
implies. Nothing here reads a dump; :mod:`grpo_cli.commands.check` runs the rules.
"""

from __future__ import annotations

import difflib
import enum
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from grpo_cli import _keys
from grpo_cli.errors import UsageError

PER_COLUMNS = _keys.GROUP_BY_COLUMNS
"""The per-sequence integer columns ``per`` (and ``analyze --group-by``) take by name."""

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from grpo_cli.metrics.config import AnalyzeConfig


BOUND_KEYS = ("min", "max", "max_rel_increase", "max_abs_change")
"""The bounds a rule may set (at least one; several are intersected)."""

RULE_KEYS = ("metric", *BOUND_KEYS, "severity", "per", "name", "hint", "optional")
"""Every key a ``[[rule]]`` table accepts."""


_TABLES = ("rule", "analyze", "compare_prox")
# AnalyzeConfig / CompareProxConfig fields that say how a pass runs, not what a figure is, or that check sets itself.
_NOT_FROM_FILE = frozenset({"device", "batch_tokens", "group_by", "max_groups", "top_k", "methods"})
# Options that select figures or handle invalid rows but never change a figure's definition: a baseline computed


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
    # The generated option tables (grpo_cli/_keys.json): a rules file is validated without importing torch.
    problems.extend(_option_problems("analyze", options["analyze"], _keys.ANALYZE_OPTIONS)[1])
    problems.extend(_option_problems("compare_prox", options["compare_prox"], _keys.COMPARE_PROX_OPTIONS)[1])
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


def _coerce_options(table: str, values: Mapping[str, Any], config_type: type) -> dict[str, Any]:
    """Check ``[table]`` keys against the dataclass fields of ``config_type`` and their declared types."""
    out, problems = _option_problems(table, values, {f.name: str(f.type) for f in fields(config_type)})
    if problems:
        raise UsageError("; ".join(problems))
    return out


def _option_problems(
    table: str, values: Mapping[str, Any], types: Mapping[str, str]
) -> tuple[dict[str, Any], list[str]]:
    """The typed ``[table]`` options and every problem found in them (unknown keys, wrong types); ``types`` maps a
    config's field names to their declared types."""
    allowed = {name: kind for name, kind in types.items() if name not in _NOT_FROM_FILE}
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
        # Unknown names are left to run_check, which lists close matches.
        named = {r.metric.split("/", 1)[1] for r in rule_set.rules
                 if r.metric.startswith("loss/") and r.metric in _keys.KEYS}
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
    known = known_metrics() if known is None else known
    if metric not in known:
        return [f"{where}: unknown metric '{metric}'{_close(metric, known)}"]
    if _keys.KEYS.get(metric) == "table":
        return [f"{where}: '{metric}' is a list (a table of rows), and lists cannot be rules; rules need a "
                "scalar metric"]
    return []


def known_metrics() -> set[str]:
    """Every key a rule may name: the documented keys (``grpo_cli.metrics.registry``) and every ``compare-prox`` key,
    from their torch-free copy ``grpo_cli/_keys.json`` (a test keeps it equal to the declarations)."""
    return {*_keys.KEYS, *_keys.PROX_KEYS}


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

