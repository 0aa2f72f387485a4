"""grpo-cli: offline diagnostics for GRPO/PPO rollout dumps.

The public API, importable from here (loaded on first use, so ``grpo-cli --version`` does not pay for torch):

- metrics for training loops: :class:`GRPOMetric`, :class:`GSPOMetric`, :class:`CISPOMetric`;
- loss objects: :class:`GRPOLoss`, :class:`GSPOLoss`, :class:`SAPOLoss`, :class:`CISPOLoss`, :class:`BNPOLoss`,
  :class:`DRGRPOLoss`;
- reading and writing dumps: :class:`RolloutDataset`, :class:`RolloutWriter`;
- the analysis pipeline: :func:`analyze`, :class:`AnalyzeConfig`, :func:`compare_prox`, :class:`CompareProxConfig`.

The pure torch functions (losses, estimators, metric states) live in :mod:`grpo_cli.core`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOMetric": "grpo_cli.metric",
    "GSPOMetric": "grpo_cli.metric",
    "CISPOMetric": "grpo_cli.metric",
    "GRPOLoss": "grpo_cli.loss",
    "GSPOLoss": "grpo_cli.loss",
    "SAPOLoss": "grpo_cli.loss",
    "CISPOLoss": "grpo_cli.loss",
    "BNPOLoss": "grpo_cli.loss",
    "DRGRPOLoss": "grpo_cli.loss",
    "RolloutDataset": "grpo_cli.io",
    "RolloutWriter": "grpo_cli.io",
    "analyze": "grpo_cli.analysis",
    "AnalyzeConfig": "grpo_cli.analysis",
    "compare_prox": "grpo_cli.compare_prox",
    "CompareProxConfig": "grpo_cli.compare_prox",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
