"""What the parts of :mod:`grpo_cli.core.prox_compare` share: the lag bins' size, the method names and
two masked reductions."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from grpo_cli.core._loss_common import fill_outside
from grpo_cli.core.prox import PROX_APPROX_METHODS
from grpo_cli.core.staleness import MAX_LAG as STALENESS_MAX_LAG
from grpo_cli.core.state import MetricState

__all__ = ["DEFAULT_MAX_LAG", "bin_counts", "check_methods", "masked_max", "state_methods"]

DEFAULT_MAX_LAG = STALENESS_MAX_LAG
"""Lags 0..``max_lag`` − 1 get a ``by_staleness`` row each, as in ``analyze``'s ``by_staleness``
(:data:`grpo_cli.core.staleness.MAX_LAG`); lags ≥ ``max_lag`` share one overflow row and negative lags
(v_b > v_θ) another. The state holds ``max_lag + 2`` bins per method whatever the dump."""


def check_methods(methods: Iterable[str] | None) -> tuple[str, ...]:
    """The requested methods (default all of :data:`~grpo_cli.core.prox.PROX_APPROX_METHODS`), checked, once each."""
    names = PROX_APPROX_METHODS if methods is None else ((methods,) if isinstance(methods, str) else tuple(methods))
    bad = [m for m in names if m not in PROX_APPROX_METHODS]
    if bad or not names:
        raise ValueError(f"unknown proximal approximation method(s) {bad or names!r}; valid: {PROX_APPROX_METHODS}")
    return tuple(dict.fromkeys(names))


def state_methods(state: MetricState) -> tuple[str, ...]:
    """The methods a state was made for, in :data:`~grpo_cli.core.prox.PROX_APPROX_METHODS` order."""
    return tuple(m for m in PROX_APPROX_METHODS if f"{m}/abs_error" in state)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """float64 max of ``values`` over ``mask`` (−inf when nothing is selected)."""
    if values.numel() == 0:
        return torch.full((), -math.inf, dtype=torch.float64, device=values.device)
    return fill_outside(mask, values.to(torch.float64), -math.inf).amax()


def bin_counts(bins: Tensor, mask: Tensor, n_bins: int) -> Tensor:
    """Tokens per bin over ``mask`` (an unweighted integer ``bincount``: deterministic on every device).

    Tokens outside ``mask`` are counted in a spare bin ``n_bins`` that is then dropped, which avoids compacting
    ``bins`` (a boolean index costs a full search of the mask)."""
    return torch.bincount(bins.masked_fill(~mask, n_bins), minlength=n_bins + 1)[:n_bins]
