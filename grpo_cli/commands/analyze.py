"""``grpo-cli analyze``: every figure of a dump in one streaming pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.run import AnalysisResult, run
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups

__all__ = ["AnalysisResult", "AnalyzeConfig", "analyze"]


def analyze(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    *,
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> AnalysisResult:
    """Run every metric group (default: :func:`~grpo_cli.metrics.default_groups`) over the whole dataset in one
    streaming pass; see :func:`grpo_cli.engine.run.run`.

    Example:
        >>> from grpo_cli import AnalyzeConfig, RolloutDataset, analyze
        >>> result = analyze(RolloutDataset(["sample_data/rollouts.parquet"]), AnalyzeConfig())  # doctest: +SKIP
        >>> round(result.metrics["kl/k3"], 4)  # doctest: +SKIP
        0.0257
    """
    groups = default_groups() if groups is None else list(groups)
    return run(dataset, groups, config, progress=progress, workers=workers)
