"""The unit the engine runs: a :class:`MetricGroup` (a family of figures over one mergeable state) and the
:class:`Accumulator` that holds one state per group for a dump (and per ``--group-by`` value)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.state import MetricState
from grpo_cli.engine.figures import Figure, omitted_reasons

__all__ = ["Accumulator", "MetricGroup", "overall_only", "per_key"]


class MetricGroup:
    """A family of figures computed from one mergeable state (the torchmetrics pattern, over ``grpo_cli.core``).

    Subclasses call the core's pure ``*_state`` / ``*_update`` / ``*_compute`` functions; they never read files
    or print. ``config`` is the command's config (``AnalyzeConfig``, ``CompareProxConfig``), read for the options
    that change a figure.
    """

    name: str = ""
    findings_only: bool = False
    """True for groups whose values are evidence for the findings layer, never reported as metrics; they run over
    the whole dump only, not per ``--group-by`` value."""
    keyed: bool = True
    """False for a group whose figures a command reads for the whole dump only (:func:`overall_only`): it does not
    run per ``--group-by`` value either."""
    figures: tuple[Figure, ...] = ()
    """Every figure the group can report, declared once (:class:`~grpo_cli.engine.figures.Figure`)."""

    def columns(self) -> frozenset[str]:
        """Canonical columns this group reads when present."""
        return frozenset()

    def omitted(self, columns: frozenset[str], config: Any) -> dict[str, str]:
        """Keys this group cannot report for a dump with ``columns``, each with the reason (from the declared
        figures' requirements: missing columns first, then options that are off)."""
        return omitted_reasons(self.figures, columns, config)

    def expected_keys(self, config: Any) -> list[str]:
        """The keys this group reports under ``config`` when the dump has what they need."""
        return [figure.key for figure in self.figures if figure.is_enabled(config)]

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        raise NotImplementedError

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        """Fold one batch (``valid`` = its loss-mask tokens) into ``state``."""
        raise NotImplementedError

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def retire(self, state: MetricState, before_file: int) -> None:
        """Forget per-sequence rows of ``state`` last seen in a file before ``before_file`` where the group's figures
        allow it (the online :class:`~grpo_cli.commands.diagnoser.Diagnoser` calls it with each step as a file, to
        keep its memory bounded); by default nothing is forgotten."""


@dataclass
class Accumulator:
    """One state per metric group for the whole dump, and (with ``group_by``) one set per key value."""

    overall: list[MetricState]
    by_key: dict[int, list[MetricState]] = field(default_factory=dict)

    def merge_(self, other: Accumulator, *, take: bool = False) -> Accumulator:
        """Merge ``other`` into this accumulator in place and return it. With ``take`` (``other`` is not used
        afterwards) the states of keys new to this one are taken from ``other`` rather than copied."""
        for mine, theirs in zip(self.overall, other.overall):
            mine.merge_(theirs)
        for key, states in other.by_key.items():
            if key in self.by_key:
                for mine, theirs in zip(self.by_key[key], states):
                    mine.merge_(theirs)
            else:
                self.by_key[key] = states if take else [state.clone() for state in states]
        return self

    def dumps(self) -> bytes:
        """The accumulator, moved to the CPU, as bytes for another process (:meth:`loads`).

        Each tensor travels as a numpy array: pickled as a tensor, torch rebuilds it through ``torch.load`` (an
        archive per tensor, about 0.1 ms), and a grouped run holds some 170 state tensors per key, so a worker's
        accumulator took longer to load than to compute. The values, dtypes and shapes are the same.
        """
        buffer = io.BytesIO()
        _StatePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(self.to(torch.device("cpu")))
        return buffer.getvalue()

    @staticmethod
    def loads(blob: bytes) -> Accumulator:
        """The accumulator :meth:`dumps` wrote."""
        acc = pickle.loads(blob)
        assert isinstance(acc, Accumulator)
        return acc

    def to(self, device: torch.device) -> Accumulator:
        """Every state moved to ``device`` (the same object when nothing moves)."""
        states = [*self.overall, *(s for v in self.by_key.values() for s in v)]
        if all(state.device == device for state in states):
            return self
        return Accumulator([s.to(device) for s in self.overall], {k: [s.to(device) for s in v]
                                                                    for k, v in self.by_key.items()})


class _StatePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype in _AS_NUMPY:
            return torch.from_numpy, (obj.detach().numpy(),)
        return NotImplemented  # everything else, other tensor dtypes included, as pickle does it


_AS_NUMPY = (torch.float64, torch.float32, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)


def per_key(groups: Sequence[MetricGroup]) -> list[MetricGroup]:
    """The groups that also run per ``--group-by`` value (all but the findings-only and :func:`overall_only` ones)."""
    return [group for group in groups if group.keyed and not group.findings_only]


def overall_only(group: MetricGroup) -> MetricGroup:
    """A copy of ``group`` that runs over the whole dump only, not per ``--group-by`` value: for a command that
    reads some groups' figures per value and the others' only overall (``check``'s ``per`` rules)."""
    alone = copy.copy(group)
    alone.keyed = False
    return alone
