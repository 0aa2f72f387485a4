"""A :class:`~grpo_cli.core.state.MetricState` that can also hold *keyed tables* (one row per key seen).

Some figures need a value per key whose set is not known in advance, e.g. the min and max reward of every GRPO
group (``groups/zero_std_frac``). A keyed table is a float64 ``[n_keys, 1 + F]`` tensor: column 0 holds the keys
(integers, exact below 2^53), sorted and unique; column ``c`` combines with its own reduce op (``sum``, ``min`` or
``max``). Merging concatenates and reduces rows of equal keys, which is associative and commutative, so tables
merge exactly across batches, ``--workers`` and ranks like every other entry. Memory grows with the number of keys
(32 bytes per key and column set), not with the number of tokens.

Sum columns must hold integer values (counts): their float64 sums are then exact, so the ``scatter_reduce`` order
(atomics on CUDA) cannot change a bit; min and max do not depend on order anyway.

Example:
    >>> s = KeyedState({}, {"g": (Reduce.SUM, Reduce.MIN, Reduce.MAX)})
    >>> s.update(g=torch.tensor([[7.0, 1, 0.5, 0.5], [3.0, 1, 1.0, 1.0], [7.0, 1, 0.0, 0.0]]))
    >>> s["g"].tolist()
    [[3.0, 1.0, 1.0, 1.0], [7.0, 2.0, 0.0, 0.5]]
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_cli.core.state import MetricState, Reduce, StateSpec, _combine, select_top_rows

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["KeyedState", "all_reduce_states", "keyed_combine"]

_SCATTER = {Reduce.SUM: ("sum", 0.0), Reduce.MIN: ("amin", float("inf")), Reduce.MAX: ("amax", float("-inf"))}


def keyed_combine(ops: Sequence[Reduce], current: Tensor, incoming: Tensor) -> Tensor:
    """Rows of ``current`` and ``incoming`` (``[n, 1 + len(ops)]``) with equal keys reduced into one row each."""
    rows = torch.cat([current, incoming.to(dtype=current.dtype, device=current.device)])
    if rows.shape[0] == 0:
        return rows
    keys, inverse = torch.unique(rows[:, 0], sorted=True, return_inverse=True)
    out = torch.empty((keys.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    out[:, 0] = keys
    for column, op in enumerate(ops, start=1):
        how, fill = _SCATTER[op]
        initial = torch.full((keys.numel(),), fill, dtype=rows.dtype, device=rows.device)
        out[:, column] = initial.scatter_reduce(0, inverse, rows[:, column], reduce=how, include_self=True)
    return out


class KeyedState(MetricState):
    """Plain entries as in :class:`MetricState` plus keyed tables named in ``keyed`` with their column ops."""

    def __init__(
        self,
        specs: Mapping[str, StateSpec],
        keyed: Mapping[str, Sequence[Reduce]],
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(specs, device)
        self.keyed: dict[str, tuple[Reduce, ...]] = {name: tuple(ops) for name, ops in keyed.items()}
        for name, ops in self.keyed.items():
            if name in self.specs:
                raise ValueError(f"'{name}' is both a plain and a keyed entry")
            if any(op not in _SCATTER for op in ops):
                raise ValueError(f"keyed columns reduce with sum, min or max, got {ops}")
            width = 1 + len(ops)
            # Declared with a (0, width) shape so code that walks ``specs`` sees the entry; merging is overridden.
            self.specs[name] = StateSpec((0, width), torch.float64, Reduce.SUM)
            self.values[name] = torch.zeros((0, width), dtype=torch.float64, device=device)

    def update(self, **partials: Tensor) -> None:
        plain = {}
        for name, value in partials.items():
            if name in self.keyed:
                self.values[name] = keyed_combine(self.keyed[name], self.values[name], value)
            else:
                plain[name] = value
        super().update(**plain)

    def merge_(self, other: MetricState) -> MetricState:
        if self.specs.keys() != other.specs.keys() or self.keyed != getattr(other, "keyed", None):
            raise ValueError("cannot merge metric states with different entries")
        for name, value in other.values.items():
            value = value.to(self.device)
            if name in self.keyed:
                self.values[name] = keyed_combine(self.keyed[name], self.values[name], value)
            else:
                self.values[name] = _combine(self.specs[name], self.values[name], value)
        return self

    def _copy(self, values: dict[str, Tensor]) -> KeyedState:
        new = copy.copy(self)
        new.specs = dict(self.specs)
        new.keyed = dict(self.keyed)
        new.values = values
        return new

    def clone(self) -> KeyedState:
        return self._copy({name: value.clone() for name, value in self.values.items()})

    def to(self, device: torch.device | str) -> KeyedState:
        return self._copy({name: value.to(device) for name, value in self.values.items()})


def all_reduce_states(states: Sequence[MetricState], group: ProcessGroup | None = None) -> None:
    """All-reduce ``states`` in place over ``torch.distributed`` (``group``: default the world), so every rank holds
    the merged states: the one implementation for ``GRPOMetric`` and the engine's ``torchrun`` runs.

    Plain sum/min/max entries are bucketed by (dtype, op) into one ``all_reduce`` each; top-k tables and keyed
    tables are gathered from every rank in one ``all_gather_object`` and combined in rank order with the functions
    their merges use (:func:`~grpo_cli.core.state.select_top_rows`, :func:`keyed_combine`), so the result equals
    merging the ranks' states in rank order.
    """
    import torch.distributed as dist

    ops = {Reduce.SUM: dist.ReduceOp.SUM, Reduce.MIN: dist.ReduceOp.MIN, Reduce.MAX: dist.ReduceOp.MAX}
    buckets: dict[tuple[torch.dtype, Reduce], list[tuple[MetricState, str]]] = {}
    gathered: list[tuple[MetricState, str]] = []
    for state in states:
        keyed = getattr(state, "keyed", {})
        for name, spec in state.specs.items():
            if name in keyed or spec.reduce is Reduce.TOPK:
                gathered.append((state, name))
            else:
                buckets.setdefault((spec.dtype, spec.reduce), []).append((state, name))
    for (_, reduce), entries in buckets.items():
        values = [state.values[name] for state, name in entries]
        flat = torch.cat([v.reshape(-1) for v in values])
        dist.all_reduce(flat, op=ops[reduce], group=group)
        offset = 0
        for (state, name), value in zip(entries, values):
            state.values[name] = flat[offset:offset + value.numel()].reshape(value.shape).clone()
            offset += value.numel()
    if gathered:
        local = [state.values[name].cpu() for state, name in gathered]
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        for i, (state, name) in enumerate(gathered):
            device = state.values[name].device
            rows = torch.cat([tables[i] for tables in everyone]).to(device)
            keyed = getattr(state, "keyed", {})
            if name in keyed:
                state.values[name] = keyed_combine(keyed[name], rows[:0], rows)
            else:
                state.values[name] = select_top_rows(rows, state.specs[name].shape[0])
