"""Blocks of a dump for resampling intervals: a deterministic block per sequence, and the delete-a-block jackknife
over per-block :class:`~grpo_cli.engine.group.Accumulator` states.

States merge exactly, so the figures of "the dump without block *k*" come from merging every block's states but
*k*'s; no figure needs to know it is being resampled. The delete-a-group jackknife (Efron & Stein 1981, "The
jackknife estimate of variance", Ann. Statist. 9(3); Efron 1982, "The Jackknife, the Bootstrap and Other Resampling
Plans", ch. 2-3) then gives a variance for every scalar figure::

    var = (K − 1) / K · Σ_k (θ_(k) − θ_(·))²

with θ_(k) the figure without block *k* and θ_(·) their mean. It assumes the blocks are independent and
exchangeable; it is unreliable for non-smooth figures (extremes, quantiles: Efron 1982 §3.4).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.state import MetricState
from grpo_cli.engine.group import MetricGroup

__all__ = ["DEFAULT_BLOCKS", "block_keys", "jackknife_variances", "leave_one_out", "merge_contiguous"]

DEFAULT_BLOCKS = 20
"""Hash blocks per dump when it has no step column (K ≈ 20: enough degrees of freedom, K leave-one-out figures)."""

_GOLDEN = 2654435761  # Knuth's multiplicative hash constant (TAOCP vol. 3, §6.4), < 2**32


def block_keys(batch: TokenBatch, n_blocks: int) -> Tensor:
    """``[B]`` int64 block in ``[0, n_blocks)`` per sequence: a hash of (file, group_id) when the batch has
    ``group_id`` (a prompt's group stays in one block: its sequences are correlated), else of (file, row).

    Depends on where a sequence is in the dump only, never on batching, workers or ranks.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    where = batch.sequence_keys()  # [B, 2] (file, row)
    second = batch.group_id if batch.group_id is not None else where[:, 1]
    key = (where[:, 0] * 1_000_003 + second) % (1 << 31)
    mixed = (key * _GOLDEN) % (1 << 32)  # < 2**63: no int64 overflow
    return (mixed >> 8) % n_blocks


def leave_one_out(blocks: Sequence[Sequence[MetricState]]) -> list[list[MetricState]]:
    """For each block, the merged states of every other block (prefix and suffix merges: 3K merges, not K²)."""
    k = len(blocks)
    if k < 2:
        return []
    prefix: list[list[MetricState]] = [[s.clone() for s in blocks[0]]]
    for i in range(1, k - 1):
        prefix.append([mine.clone().merge_(theirs) for mine, theirs in zip(prefix[-1], blocks[i])])
    suffix: list[list[MetricState]] = [[s.clone() for s in blocks[-1]]]
    for i in range(k - 2, 0, -1):
        suffix.append([mine.clone().merge_(theirs) for mine, theirs in zip(suffix[-1], blocks[i])])
    suffix.reverse()  # suffix[i] = blocks i+1 .. k-1
    out = [suffix[0]]
    for i in range(1, k - 1):
        out.append([mine.clone().merge_(theirs) for mine, theirs in zip(prefix[i - 1], suffix[i])])
    out.append(prefix[-1])
    return out


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def jackknife_variances(
    groups: Sequence[MetricGroup], config: Any, blocks: Sequence[Sequence[MetricState]], keys: Sequence[str]
) -> dict[str, float]:
    """The delete-a-block jackknife variance of every scalar figure in ``keys`` (those whose leave-one-out values
    are all finite numbers; the others are left out)."""
    k = len(blocks)
    if k < 2:
        return {}
    values: dict[str, list[float]] = {key: [] for key in keys}
    for states in leave_one_out(blocks):
        figures: dict[str, Any] = {}
        for group, state in zip(groups, states):
            figures.update(group.compute(state, config))
        for key, seen in values.items():
            seen.append(_scalar(figures.get(key)))  # type: ignore[arg-type]  # None: no figure in that block
    out: dict[str, float] = {}
    for key, seen in values.items():
        if any(v is None for v in seen):
            continue
        mean = math.fsum(seen) / k
        out[key] = (k - 1) / k * math.fsum((v - mean) ** 2 for v in seen)
    return out


def merge_contiguous(blocks: Sequence[Sequence[MetricState]], n_blocks: int) -> list[list[MetricState]]:
    """``blocks`` (in order, e.g. by step) merged into at most ``n_blocks`` contiguous runs of near-equal length."""
    if len(blocks) <= n_blocks:
        return [list(b) for b in blocks]
    bounds = [round(i * len(blocks) / n_blocks) for i in range(n_blocks + 1)]
    out: list[list[MetricState]] = []
    for a, b in itertools.pairwise(bounds):
        merged = [s.clone() for s in blocks[a]]
        for states in blocks[a + 1:b]:
            for mine, theirs in zip(merged, states):
                mine.merge_(theirs)
        out.append(merged)
    return out


