"""``grpo-cli analyze``: every figure of a dump in one streaming pass, and the findings they support."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from grpo_cli.commands.advantages import per_token_advantages
from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.run import AnalysisResult, run
from grpo_cli.findings import DetectConfig, diagnose
from grpo_cli.io.reader import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig, default_groups, select_groups
from grpo_cli.metrics.diagnosis import diagnosis_groups

__all__ = ["AnalysisResult", "AnalyzeConfig", "analyze"]


def analyze(
    dataset: RolloutDataset,
    config: AnalyzeConfig,
    *,
    groups: Sequence[MetricGroup] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    findings: DetectConfig | None = None,
    select: Sequence[str] = (),
    diagnosis: Sequence[str] | None = None,
) -> AnalysisResult:
    """Run every metric group (default: :func:`~grpo_cli.metrics.default_groups`) over the whole dataset in one
    streaming pass (see :func:`grpo_cli.engine.run.run`); with ``findings`` (what the run corrects for), also the
    findings-only statistics and the findings they support (``result.findings``); ``select`` (group names or key
    patterns, :func:`~grpo_cli.metrics.select_groups`) computes only those groups, and ``diagnosis`` (names of
    findings-only groups, default all) only those of the findings' statistics.

    Example:
        >>> from grpo_cli import AnalyzeConfig, RolloutDataset, analyze
        >>> result = analyze(RolloutDataset(["sample_data/rollouts.parquet"]), AnalyzeConfig())  # doctest: +SKIP
        >>> round(result.metrics["kl/k3"], 4)  # doctest: +SKIP
        0.0257
    """
    if config.peer() == "trl" and "advantages" in dataset.columns:
        # TRL averages its sequence-level clip ratios over sequences or tokens by the advantages' shape.
        config = dataclasses.replace(config, advantages_per_token=per_token_advantages(dataset))
    groups = default_groups() if groups is None else list(groups)
    if select:
        groups = select_groups(groups, select)  # compute only what is asked
    if findings is not None:
        groups = [*groups, *(g for g in diagnosis_groups() if diagnosis is None or g.name in diagnosis)]
    result = run(dataset, groups, config, progress=progress, workers=workers)
    result.config["ratio_base"] = ratio_base(dataset)
    if findings is not None:
        result.findings = diagnose(result.metrics, result.evidence, findings)
    return result


def ratio_base(dataset: RolloutDataset) -> str:
    """Which log-prob the PPO ratio r = π_θ / π_base of ``ratio/*``, ``clip/*`` and ``top_ratio`` is taken against:
    ``"prox"`` when the dump has ``prox_logp`` (decoupled PPO, AReaL's proximal policy), else ``"old"``."""
    return "prox" if "prox_logp" in dataset.columns else "old"
