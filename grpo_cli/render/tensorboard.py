"""``analyze --tensorboard DIR``: the per-step figures as TensorBoard scalars, the run's config and notes as text.

Uses ``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package: the optional extra
``grpo-cli[tensorboard]``); without it the option is a usage error naming the extra. Scalars are tagged
``grpo_cli/<key>`` with the dump's ``step`` as the global step, so a dumped run lines up with the trainer's own
curves (TensorBoard docs: "add_scalar(tag, scalar_value, global_step)").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_cli.errors import UsageError

__all__ = ["write_tensorboard"]

EXTRA_HINT = "pip install 'grpo-cli[tensorboard]' (or pip install tensorboard)"


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
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(f"--tensorboard needs the optional 'tensorboard' extra: {EXTRA_HINT}") from None
    series = [(int(group["key"]), group["metrics"]) for group in groups] or [(0, metrics)]
    written = 0
    writer = SummaryWriter(log_dir=str(directory))
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
