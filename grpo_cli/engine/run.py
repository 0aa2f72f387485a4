"""One streaming run: ``run(dataset, groups, config)`` validates the options, folds the dump (all cores, or this
rank's share under ``torchrun``) and computes every group's figures with the omitted keys and their reasons.

Groups never do I/O and the reader never computes a figure; because states merge exactly, the same code serves one
process, ``--workers`` processes and ``torchrun`` ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_cli.core.state import MetricState
from grpo_cli.engine.config import coded_group_by
from grpo_cli.engine.group import Accumulator, MetricGroup, per_key
from grpo_cli.engine.parallel import accumulate, one_torch_thread
from grpo_cli.engine.validate import require_data
from grpo_cli.io.reader import RolloutDataset

__all__ = ["AnalysisResult", "compute_figures", "finalize", "run"]


@dataclass
class AnalysisResult:
    """What every output format renders."""

    metrics: dict[str, Any]
    omitted: dict[str, str]
    inputs: list[str]
    config: dict[str, Any]
    columns: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    """With ``group_by``: ``[{"key": value, "metrics": {...}}, ...]`` in ascending key order."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """The findings-only groups' values (``diag/*``): what the findings layer reads beside ``metrics``."""
    findings: list[dict[str, Any]] = field(default_factory=list)
    """The findings (:mod:`grpo_cli.findings`), most severe first; filled by the commands that diagnose."""


def compute_figures(
    columns: frozenset[str], config: Any, groups: Sequence[MetricGroup], states: Sequence[MetricState]
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Every group's figures from merged ``states`` of data with ``columns``: ``(metrics, omitted, evidence)``.

    ``omitted`` maps each key the data cannot support to its reason (the declarations'); ``evidence`` holds the
    findings-only groups' ``diag/*`` values. :func:`finalize` and the online
    :class:`~grpo_cli.commands.diagnoser.Diagnoser` both compute through here.
    """
    with _one_cpu_thread():
        metrics, omitted = _figures(columns, config, groups, states)
        evidence: dict[str, Any] = {}
        for group, state in zip(groups, states):
            if group.findings_only:
                evidence.update(group.compute(state, config))
    return metrics, omitted, evidence


def _figures(
    columns: frozenset[str], config: Any, groups: Sequence[MetricGroup], states: Sequence[MetricState],
    omitted_by_group: Sequence[dict[str, str]] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    # omitted_by_group: each group's omitted(columns, config), when the caller computes it once for many keys
    metrics: dict[str, Any] = {}
    omitted: dict[str, str] = {}
    for i, (group, state) in enumerate(zip(groups, states)):
        if group.findings_only:
            continue
        reasons = group.omitted(columns, config) if omitted_by_group is None else omitted_by_group[i]
        figures = group.compute(state, config)
        metrics.update({k: v for k, v in figures.items() if k not in reasons})
        omitted.update(reasons)
    if metrics.get("n_valid_tokens", 0) == 0:
        hidden = [k for k in metrics if "/" in k and not k.startswith("invalid/")]
        omitted.update(dict.fromkeys(hidden, "no valid tokens (loss_mask is 0 everywhere)"))
        metrics = {k: v for k, v in metrics.items() if k not in hidden}
    return metrics, omitted


def finalize(
    dataset: RolloutDataset,
    config: Any,
    groups: Sequence[MetricGroup],
    acc: Accumulator,
) -> AnalysisResult:
    """Compute every group's figures from merged states and collect the omitted keys with reasons."""
    metrics, omitted, evidence = compute_figures(dataset.columns, config, groups, acc.overall)
    require_data(metrics, [str(p) for p in dataset.files])  # zero rows / all skipped / no valid tokens: exit 2
    keyed = per_key(groups)
    # A coded --group-by column (strings, …) reports each code's value; codes sort like the values.
    values = dataset.group_values(config.group_by) if coded_group_by(getattr(config, "group_by", None)) else None
    reasons = [group.omitted(dataset.columns, config) for group in keyed]  # the same for every key
    with _one_cpu_thread():
        by_key = [
            {"key": key if values is None else values[int(key)],
             "metrics": _without_skip_counts(_figures(dataset.columns, config, keyed, acc.by_key[key], reasons)[0])}
            for key in sorted(acc.by_key)
        ]
    return AnalysisResult(
        metrics=metrics,
        omitted=omitted,
        inputs=[str(p) for p in dataset.files],
        config=config.to_json(),
        columns=sorted(dataset.columns),
        groups=by_key,
        evidence=evidence,
    )


def _one_cpu_thread() -> contextlib.AbstractContextManager[None]:
    # Figures are computed from small state tensors, one key at a time: with torch's intra-op pool each tiny op pays
    # the pool's wake-up (12 ms instead of 0.4 ms per display histogram on a busy 2-core machine, which made a
    # thousand-step --group-by spend most of its time here), and one thread keeps the bits independent of the cores.
    return one_torch_thread(torch.device("cpu"))


def _without_skip_counts(metrics: dict[str, Any]) -> dict[str, Any]:
    # Sequences are dropped before they are split by key, so skip counts exist for the whole dump only.
    return {k: v for k, v in metrics.items() if not k.startswith("invalid/")}


def run(
    dataset: RolloutDataset,
    groups: Sequence[MetricGroup],
    config: Any,
    *,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> AnalysisResult:
    """Validate ``config``, stream ``dataset`` once through ``groups`` and compute their figures.

    ``workers`` processes share the (file, row-group) units of the dump; under ``torchrun`` each rank takes its
    share and the states are all-reduced (:func:`grpo_cli.engine.parallel.accumulate`). No figure depends on either.
    """
    config.validate()
    acc = accumulate(dataset, config, groups, workers=workers, progress=progress)
    return finalize(dataset, config, groups, acc)
