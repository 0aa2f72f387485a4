"""``analyze --tensorboard DIR``: the per-step figures as TensorBoard scalars, the run's config and notes as text.

Uses ``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package: the optional extra
``grpo-cli[tensorboard]``); without it the option is a usage error naming the extra. Scalars are tagged
``grpo_cli/<key>`` with the dump's ``step`` as the global step, so a dumped run lines up with the trainer's own
curves (TensorBoard docs: "add_scalar(tag, scalar_value, global_step)").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import UsageError

if TYPE_CHECKING:
    from grpo_cli.engine.run import AnalysisResult
    from grpo_cli.metrics.config import AnalyzeConfig

__all__ = ["export_tensorboard", "require_tensorboard", "with_step_split", "write_tensorboard"]

EXTRA_HINT = "pip install 'grpo-cli[tensorboard]' (or pip install tensorboard)"


def require_tensorboard() -> type:
    """``torch.utils.tensorboard.SummaryWriter``; called before the analysis, so that a missing extra is a usage
    error at once rather than after the whole dump has been read.

    Raises:
        UsageError: the ``tensorboard`` package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(f"--tensorboard needs the optional 'tensorboard' extra: {EXTRA_HINT}") from None
    return SummaryWriter


def with_step_split(config: AnalyzeConfig, columns: Collection[str]) -> tuple[AnalyzeConfig, bool]:
    """The config that also computes the per-step figures TensorBoard's curves need, and whether that split was
    added for TensorBoard alone (no ``--group-by`` asked for, and the dump has a ``step`` column)."""
    if config.group_by is None and "step" in columns:
        return dataclasses.replace(config, group_by="step"), True
    return config, False


def export_tensorboard(
    directory: str | os.PathLike[str], result: AnalysisResult, *, split_added: bool, notes: Sequence[str] = ()
) -> int:
    """Write ``result``'s per-step figures (or, without a step split, the whole dump's at step 0) and its findings
    (after ``notes``) to ``directory``; a split :func:`with_step_split` added for TensorBoard alone is then taken out
    of ``result`` (``groups`` and ``config["group_by"]``), so every other output is as without ``--tensorboard``.
    Returns the scalars written."""
    steps = result.groups if split_added or result.config.get("group_by") == "step" else []
    findings = [f"{f['code']} {f['severity']} [{f['category']}]: {f['title']}" for f in result.findings]
    written = write_tensorboard(directory, groups=steps, metrics=result.metrics, config=result.config,
                                notes=[*notes, *findings])
    if split_added:
        result.groups = []
        result.config["group_by"] = None
    return written


def _scalars(metrics: Mapping[str, Any]) -> list[tuple[str, float]]:
    out = []
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # tables and flags have no curve
        if math.isfinite(float(value)):
            out.append((key, float(value)))
    return out


def write_tensorboard(
    directory: str | os.PathLike[str],
    *,
    groups: Sequence[Mapping[str, Any]],
    metrics: Mapping[str, Any],
    config: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> int:
    """Write one scalar per figure and step (``groups``: the ``--group-by step`` groups; without steps the whole
    dump's figures at step 0), the config and ``notes`` (findings, warnings) as text; returns the scalars written.

    Raises:
        UsageError: the ``tensorboard`` package is not installed.
    """
    summary_writer = require_tensorboard()
    series = [(int(group["key"]), group["metrics"]) for group in groups] or [(0, metrics)]
    written = 0
    writer = summary_writer(log_dir=str(directory))
    try:
        for step, values in series:
            for key, value in _scalars(values):
                writer.add_scalar(f"grpo_cli/{key}", value, global_step=step)
                written += 1
        writer.add_text("grpo_cli/config", "```\n" + json.dumps(dict(config), indent=1, default=str) + "\n```", 0)
        if notes:
            writer.add_text("grpo_cli/findings", "\n\n".join(notes), 0)
    finally:
        writer.close()
    return written
