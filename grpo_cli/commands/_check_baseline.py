"""``check --baseline``: the figures of an earlier run that baseline-relative bounds (``max_rel_increase``,
``max_abs_change``) compare against — from a JSON report (fixed margins), or measured from a rollout dump with each
change's jackknife interval (:func:`grpo_cli.commands.check.run_check`), so a bound fails only beyond noise."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from grpo_cli.commands._check_rules import Rule, _is_number
from grpo_cli.errors import InputError, UsageError

# with other values is still comparable.
_CONFIG_NOT_COMPARED = frozenset({"top_k", "group_by", "methods", "max_groups", "losses", "on_invalid"})


@dataclass
class Baseline:
    """The ``metrics`` (and ``config``) of an earlier ``analyze``/``check``/``compare-prox --format json``."""

    path: str
    metrics: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    omitted: dict[str, str] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    """A dump baseline's ``{metric: (low, high)}``: the interval of ``value − baseline`` (``grpo-cli diff``'s
    jackknife, :func:`~grpo_cli.commands.diff.change_interval`) for the figures that have one; empty for JSON."""
    from_dump: bool = False

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


def is_json_baseline(paths: Sequence[str | Path]) -> bool:
    """Whether ``--baseline`` names a JSON report (one ``.json`` file) rather than a rollout dump."""
    return len(paths) == 1 and Path(paths[0]).suffix.lower() == ".json"


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

