"""The metric groups: every figure grpo-cli reports, each computed by one group from one mergeable state.

:func:`default_groups` lists ``analyze``'s groups in report order; :class:`AnalyzeConfig` holds the options that
change a figure. The math is in :mod:`grpo_cli.core`; the streaming run that feeds the groups is
:mod:`grpo_cli.engine`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.validate import ValidationGroup
from grpo_cli.errors import UsageError
from grpo_cli.metrics.actor import ActorStatsGroup
from grpo_cli.metrics.config import LOSS_NAMES, AnalyzeConfig
from grpo_cli.metrics.distill import DistillGroup
from grpo_cli.metrics.loss import LossGroup
from grpo_cli.metrics.offpolicy import offpolicy_groups
from grpo_cli.metrics.peers import peer_groups
from grpo_cli.metrics.policy import CountsGroup, PolicyGroup

__all__ = ["LOSS_NAMES", "AnalyzeConfig", "default_groups", "select_groups"]


def default_groups() -> list[MetricGroup]:
    """The metric groups ``analyze`` runs, in report order."""
    return [
        ValidationGroup(), CountsGroup(), PolicyGroup(), LossGroup(), *offpolicy_groups(), DistillGroup(),
        ActorStatsGroup(), *peer_groups(),
    ]


_ALWAYS = ("invalid", "counts", "policy")
"""Groups every selection keeps: validation, the dump counts and ``n_valid_tokens`` (which every report needs)."""


def select_groups(groups: Sequence[MetricGroup], patterns: Sequence[str]) -> list[MetricGroup]:
    """The groups ``--select`` names, by group name (``loss``, ``staleness``) or by a key pattern (``is/*``,
    ``kl/k3``) matching one of a group's declared figures; validation, counts and the policy group always run.

    Raises:
        UsageError: a pattern that names no group and matches no figure (exit 2).
    """
    chosen: list[MetricGroup] = []
    unknown = []
    for pattern in patterns:
        hits = [g for g in groups if g.name == pattern
                or any(fnmatch.fnmatchcase(f.key, pattern) for f in g.figures)]
        if not hits:
            unknown.append(pattern)
        chosen.extend(h for h in hits if h not in chosen)
    if unknown:
        names = ", ".join(g.name for g in groups)
        raise UsageError(f"--select: {', '.join(unknown)} names no group ({names}) and matches no figure key")
    return [g for g in groups if g.name in _ALWAYS or g in chosen]
