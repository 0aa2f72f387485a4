"""The metric groups: every figure grpo-cli reports, each computed by one group from one mergeable state.

:func:`default_groups` lists ``analyze``'s groups in report order; :class:`AnalyzeConfig` holds the options that
change a figure. The math is in :mod:`grpo_cli.core`; the streaming run that feeds the groups is
:mod:`grpo_cli.engine`.
"""

from __future__ import annotations

from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.validate import ValidationGroup
from grpo_cli.metrics.actor import ActorStatsGroup
from grpo_cli.metrics.config import LOSS_NAMES, AnalyzeConfig
from grpo_cli.metrics.distill import DistillGroup
from grpo_cli.metrics.loss import LossGroup
from grpo_cli.metrics.offpolicy import offpolicy_groups
from grpo_cli.metrics.peers import peer_groups
from grpo_cli.metrics.policy import CountsGroup, PolicyGroup

__all__ = ["LOSS_NAMES", "AnalyzeConfig", "default_groups"]


def default_groups() -> list[MetricGroup]:
    """The metric groups ``analyze`` runs, in report order."""
    return [
        ValidationGroup(), CountsGroup(), PolicyGroup(), LossGroup(), *offpolicy_groups(), DistillGroup(),
        ActorStatsGroup(), *peer_groups(),
    ]
