"""grpo-cli: offline diagnostics for GRPO/PPO rollout dumps.

The public API, importable from here (each name is loaded on first use, so ``import grpo_cli`` imports no torch):

- metrics for training loops: :class:`GRPOMetric`, :class:`GSPOMetric`, :class:`CISPOMetric`;
- loss objects: :class:`GRPOLoss`, :class:`GSPOLoss`, :class:`SAPOLoss`, :class:`CISPOLoss`, :class:`BNPOLoss`,
  :class:`DRGRPOLoss`;
- reading and writing dumps: :class:`RolloutDataset`, :class:`RolloutWriter`;
- the analysis pipeline: :func:`analyze`, :class:`AnalyzeConfig`, :func:`compare_prox`, :class:`CompareProxConfig`;
- findings while training: :class:`Diagnoser` (``analyze``'s detectors fed per batch, judged per step).

The pure torch functions (losses, estimators, metric states) live in :mod:`grpo_cli.core`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOMetric": "grpo_cli.core.metric",
    "GSPOMetric": "grpo_cli.core.metric",
    "CISPOMetric": "grpo_cli.core.metric",
    "GRPOLoss": "grpo_cli.core.loss_objects",
    "GSPOLoss": "grpo_cli.core.loss_objects",
    "SAPOLoss": "grpo_cli.core.loss_objects",
    "CISPOLoss": "grpo_cli.core.loss_objects",
    "BNPOLoss": "grpo_cli.core.loss_objects",
    "DRGRPOLoss": "grpo_cli.core.loss_objects",
    "RolloutDataset": "grpo_cli.io",
    "RolloutWriter": "grpo_cli.io",
    "analyze": "grpo_cli.commands.analyze",
    "AnalyzeConfig": "grpo_cli.commands.analyze",
    "compare_prox": "grpo_cli.commands.compare_prox",
    "CompareProxConfig": "grpo_cli.commands.compare_prox",
    "Diagnoser": "grpo_cli.commands.diagnoser",
}

if TYPE_CHECKING:  # what type checkers and IDEs see for the lazy names above
    from grpo_cli.commands.analyze import AnalyzeConfig, analyze
    from grpo_cli.commands.compare_prox import CompareProxConfig, compare_prox
    from grpo_cli.commands.diagnoser import Diagnoser
    from grpo_cli.core.loss_objects import BNPOLoss, CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, SAPOLoss
    from grpo_cli.core.metric import CISPOMetric, GRPOMetric, GSPOMetric
    from grpo_cli.io import RolloutDataset, RolloutWriter

__all__ = [
    "BNPOLoss",
    "CISPOLoss",
    "CISPOMetric",
    "CompareProxConfig",
    "DRGRPOLoss",
    "Diagnoser",
    "GRPOLoss",
    "GRPOMetric",
    "GSPOLoss",
    "GSPOMetric",
    "RolloutDataset",
    "RolloutWriter",
    "SAPOLoss",
    "AnalyzeConfig",
    "__version__",
    "analyze",
    "compare_prox",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
