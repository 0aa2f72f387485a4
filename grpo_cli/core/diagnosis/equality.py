"""The **equality** family: valid tokens where two log-prob columns are bitwise equal, per pair."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.state import MetricState, count

__all__ = ["equality_compute", "equality_state", "equality_update"]

_PAIRS = (
    ("new", "old"), ("new", "prox"), ("new", "ref"), ("old", "prox"), ("old", "ref"), ("prox", "ref"),
)


def equality_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`equality_update`."""
    specs = {}
    for a, b in _PAIRS:
        specs[f"n_{a}_{b}"] = count()
        specs[f"eq_{a}_{b}"] = count()
    return MetricState(specs, device)


def equality_update(state: MetricState, *, columns: dict[str, Tensor | None]) -> None:
    """Fold one batch of **valid tokens** into ``state``.

    Args:
        state: from :func:`equality_state`.
        columns: ``{"new": …, "old": …, "prox": …, "ref": …}`` valid-token log-probs or ``None`` (absent).

    Equality is exact (``a == b`` in the stored dtype; two NaNs are never equal). Tokens where both are exactly 0
    do not count as equal: zeros say nothing about which policy produced a column (padding, or certain tokens),
    and :func:`zeros_update` reports them.
    """
    for a, b in _PAIRS:
        x, y = columns.get(a), columns.get(b)
        if x is None or y is None or x.numel() == 0:
            continue
        state.update(**{f"n_{a}_{b}": torch.tensor(x.numel()), f"eq_{a}_{b}": ((x == y) & (x != 0)).sum()})


def equality_compute(state: MetricState) -> dict[str, Any]:
    """``diag/equal_frac/<a>_<b>``: the fraction of valid tokens where columns a and b are bitwise equal and not 0,
    for each pair of ``new``, ``old``, ``prox``, ``ref`` the dump has."""
    out: dict[str, Any] = {}
    for a, b in _PAIRS:
        n = int(state[f"n_{a}_{b}"])
        if n:
            out[f"diag/equal_frac/{a}_{b}"] = int(state[f"eq_{a}_{b}"]) / n
    return out
