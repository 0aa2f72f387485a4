"""What the peer-exact groups (:mod:`grpo_cli.metrics.peers`) share: requirements, the ``--names`` gate and
AReaL-style ``avg``/``min``/``max`` folds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total
from grpo_cli.engine.figures import Requirement, column, columns, option

__all__ = ["DECOUPLED", "F64", "LAGS", "REF", "REJECTION_SAMPLING", "f64", "fold_stat", "stat_out", "stat_specs",
           "under"]

F64 = torch.float64
DECOUPLED = columns("old_logp", "prox_logp", reason="needs 'prox_logp' and 'old_logp' columns (decoupled PPO)")
REF = column("ref_logp")
REJECTION_SAMPLING = option(lambda c: c.rejection_sampling() is not None,
                            "rejection sampling is off (set an --rs-* option)")
LAGS = (column("versions"), Requirement("needs a 'current_version' column or --current-version",
                                        lambda cols, c: "current_version" in cols or c.current_version is not None))


def under(peer: str) -> Callable[[Any], bool]:
    """A figure's ``enabled``: on only under ``--names peer``."""
    return lambda config: getattr(config, "names", None) == peer


def f64(x: Tensor) -> Tensor:
    """``x`` detached, in float64."""
    return x.detach().to(F64)


def fold_stat(state: MetricState, name: str, values: Tensor) -> None:
    """Fold AReaL-style ``avg``/``min``/``max`` (Σ, count, extrema) of ``values`` (all of them count)."""
    if values.numel() == 0:
        return
    v = f64(values)
    state.update(**{f"{name}:sum": v.sum(), f"{name}:n": torch.tensor(v.numel()), f"{name}:min": v.min(),
                    f"{name}:max": v.max()})


def stat_specs(name: str) -> dict[str, StateSpec]:
    return {f"{name}:sum": total(), f"{name}:n": count(), f"{name}:min": minimum(), f"{name}:max": maximum()}


def stat_out(state: MetricState, name: str, key: str, out: dict[str, Any]) -> None:
    n = int(state[f"{name}:n"])
    if n:  # AReaL drops a reduction whose denominator is empty
        out[f"{key}/avg"] = float(state[f"{name}:sum"]) / n
        out[f"{key}/min"] = float(state[f"{name}:min"])
        out[f"{key}/max"] = float(state[f"{name}:max"])
