"""Mergeable metric state: a small set of tensors, each with its reduce op.

Like torchmetrics' ``add_state(..., dist_reduce_fx=...)``: every figure grpo-cli reports is computed from a state
whose entries combine with ``sum`` (counts in int64, sums in float64), ``min``, ``max`` or ``topk`` (a bounded table of
the highest-keyed rows). Merging is associative and commutative, so states from batches, worker processes and
``torch.distributed`` ranks combine in any order into the same result
(:func:`grpo_cli.core.keyed_state.all_reduce_states` all-reduces them).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    pass

__all__ = ["MetricState", "Reduce", "StateSpec", "select_top_rows"]


class Reduce(str, enum.Enum):
    """How two values of one state entry combine."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    TOPK = "topk"
    """A ``[k, F]`` float64 table; rows are ranked by column 0 (descending), ties broken by columns 1.. (ascending).
    Unused rows hold ``-inf`` in column 0."""


@dataclass(frozen=True)
class StateSpec:
    """Declaration of one state entry: its shape, dtype and reduce op."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reduce: Reduce

    def initial(self, device: torch.device | str | None) -> Tensor:
        if self.reduce is Reduce.SUM:
            return torch.zeros(self.shape, dtype=self.dtype, device=device)
        if self.reduce is Reduce.MIN:
            fill = torch.inf if self.dtype.is_floating_point else torch.iinfo(self.dtype).max
            return torch.full(self.shape, fill, dtype=self.dtype, device=device)
        if self.reduce is Reduce.MAX:
            fill = -torch.inf if self.dtype.is_floating_point else torch.iinfo(self.dtype).min
            return torch.full(self.shape, fill, dtype=self.dtype, device=device)
        table = torch.full(self.shape, torch.nan, dtype=self.dtype, device=device)
        table[:, 0] = -torch.inf
        return table


def count(shape: tuple[int, ...] = ()) -> StateSpec:
    """An int64 count (reduced by sum)."""
    return StateSpec(shape, torch.int64, Reduce.SUM)


def total(shape: tuple[int, ...] = ()) -> StateSpec:
    """A float64 sum."""
    return StateSpec(shape, torch.float64, Reduce.SUM)


def maximum(shape: tuple[int, ...] = ()) -> StateSpec:
    """A float64 running maximum (``-inf`` when nothing was seen)."""
    return StateSpec(shape, torch.float64, Reduce.MAX)


def minimum(shape: tuple[int, ...] = ()) -> StateSpec:
    """A float64 running minimum (``+inf`` when nothing was seen)."""
    return StateSpec(shape, torch.float64, Reduce.MIN)


def top_rows(k: int, n_fields: int) -> StateSpec:
    """A ``[k, n_fields]`` float64 table of the rows with the largest column 0."""
    return StateSpec((k, n_fields), torch.float64, Reduce.TOPK)


def select_top_rows(rows: Tensor, k: int) -> Tensor:
    """The ``k`` rows with the largest column 0, deterministically ordered.

    Ties in column 0 are broken by the remaining columns in ascending order, so the result does not depend on the
    order in which rows arrived (which makes ``topk`` merges commutative). Rows with ``-inf`` in column 0 are
    padding and sort last; the result is padded back to ``k`` rows.
    """
    order = torch.arange(rows.shape[0], device=rows.device)
    # Stable sorts from the least to the most significant key give a lexicographic order.
    for column in range(rows.shape[1] - 1, 0, -1):
        keys = torch.nan_to_num(rows[order, column], nan=torch.inf)
        order = order[torch.sort(keys, stable=True).indices]
    order = order[torch.sort(rows[order, 0], descending=True, stable=True).indices]
    top = rows[order[:k]]
    if top.shape[0] < k:
        pad = torch.full((k - top.shape[0], rows.shape[1]), torch.nan, dtype=rows.dtype, device=rows.device)
        pad[:, 0] = -torch.inf
        top = torch.cat([top, pad])
    return top


class MetricState:
    """Named tensors with a reduce op each; the unit of merging and all-reducing.

    Example:
        >>> state = MetricState({"n": count(), "hi": maximum()})
        >>> state.update(n=torch.tensor(3), hi=torch.tensor(0.5))
        >>> other = MetricState({"n": count(), "hi": maximum()})
        >>> other.update(n=torch.tensor(2), hi=torch.tensor(0.9))
        >>> merged = state.merge(other)
        >>> int(merged["n"]), float(merged["hi"])
        (5, 0.9)
    """

    def __init__(self, specs: Mapping[str, StateSpec], device: torch.device | str | None = None) -> None:
        self.specs: dict[str, StateSpec] = dict(specs)
        self.values: dict[str, Tensor] = {name: spec.initial(device) for name, spec in self.specs.items()}

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __contains__(self, name: object) -> bool:
        return name in self.values

    @property
    def device(self) -> torch.device:
        return next(iter(self.values.values())).device if self.values else torch.device("cpu")

    def update(self, **partials: Tensor) -> None:
        """Fold batch partials into the state with each entry's reduce op."""
        for name, value in partials.items():
            self.values[name] = _combine(self.specs[name], self.values[name], value)

    def merge_(self, other: MetricState) -> MetricState:
        """Merge ``other`` into this state in place and return ``self``."""
        if self.specs.keys() != other.specs.keys():
            raise ValueError("cannot merge metric states with different entries")
        for name, value in other.values.items():
            self.values[name] = _combine(self.specs[name], self.values[name], value.to(self.device))
        return self

    def merge(self, other: MetricState) -> MetricState:
        """A new state equal to the merge of ``self`` and ``other``."""
        return self.clone().merge_(other)

    def clone(self) -> MetricState:
        new = MetricState({}, None)
        new.specs = dict(self.specs)
        new.values = {name: value.clone() for name, value in self.values.items()}
        return new

    def to(self, device: torch.device | str) -> MetricState:
        new = MetricState({}, None)
        new.specs = dict(self.specs)
        new.values = {name: value.to(device) for name, value in self.values.items()}
        return new


def _combine(spec: StateSpec, current: Tensor, incoming: Tensor) -> Tensor:
    incoming = incoming.to(dtype=spec.dtype, device=current.device)
    if spec.reduce is Reduce.SUM:
        return current + incoming
    if spec.reduce is Reduce.MIN:
        return torch.minimum(current, incoming)
    if spec.reduce is Reduce.MAX:
        return torch.maximum(current, incoming)
    return select_top_rows(torch.cat([current, incoming]), spec.shape[0])
