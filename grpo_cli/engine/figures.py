"""How a figure is declared: its key, section, meaning, reduction, what it needs and its names in peer frameworks.

Each metric group declares its figures once (``MetricGroup.figures``); the key registry, the reasons a figure is
omitted, ``--names`` and the checks on ``docs/metrics.md`` all derive from those declarations.

Example:
    >>> fig = Figure("logp/old_mean", "mean behaviour log-prob", needs=(column("old_logp"),),
    ...              peers={"twinkle": "train/mean_old_logp"})
    >>> fig.section, fig.reduce, fig.missing(frozenset({"new_logp"}), None)
    ('logp', 'mean', "needs an 'old_logp' column")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Figure",
    "TRANSFORMS",
    "PeerName",
    "Requirement",
    "any_column",
    "column",
    "columns",
    "neg",
    "omitted_reasons",
    "option",
    "square",
]


TRANSFORMS: tuple[str, ...] = ("", "neg", "square")
"""How grpo-cli's value converts into a peer's: ``""`` the same, ``"neg"`` the peer logs −ours (verl's
``actor/ppo_kl`` = mean(old − new)), ``"square"`` the peer logs ours squared (AReaL's ``squared_error`` where we
report the rmse)."""


@dataclass(frozen=True)
class PeerName:
    """A peer framework's key for a figure and how our value converts to theirs (one of :data:`TRANSFORMS`)."""

    key: str
    transform: str = ""

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")

    def convert(self, value: Any) -> Any:
        """Our value as the peer logs it (non-numbers, bools and None pass through)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if self.transform == "neg":
            return -value
        if self.transform == "square":
            return value * value
        return value


def neg(key: str) -> PeerName:
    """The peer logs −ours under ``key``."""
    return PeerName(key, "neg")


def square(key: str) -> PeerName:
    """The peer logs ours squared under ``key``."""
    return PeerName(key, "square")


@dataclass(frozen=True)
class Requirement:
    """Something a figure needs: a column of the dump (``kind="column"``) or an option (``kind="option"``).

    ``met(columns, config)`` says whether it holds; ``reason`` is what ``omitted`` says when it does not.
    """

    reason: str
    met: Callable[[frozenset[str], Any], bool]
    kind: str = "column"


def column(name: str) -> Requirement:
    """The dump has column ``name``."""
    return Requirement(f"needs an '{name}' column" if name[0] in "aeiou" else f"needs a '{name}' column",
                       lambda columns, _: name in columns)


def columns(*names: str, reason: str | None = None) -> Requirement:
    """The dump has every column of ``names``."""
    quoted = " and ".join(f"'{n}'" for n in sorted(names))
    return Requirement(reason or f"needs {quoted} columns", lambda cols, _: set(names) <= cols)


def any_column(*names: str, reason: str | None = None) -> Requirement:
    """The dump has at least one column of ``names``."""
    quoted = " or ".join(f"'{n}'" for n in names)
    return Requirement(reason or f"needs {quoted}", lambda cols, _: bool(set(names) & cols))


def option(test: Callable[[Any], bool], reason: str) -> Requirement:
    """``test(config)`` holds (an option is on)."""
    return Requirement(reason, lambda _, config: bool(test(config)), kind="option")


_REDUCTIONS = (("_frac", "fraction"), ("/ratio", "fraction"), ("_mean", "mean"), ("_max", "max"), ("_min", "min"),
               ("_std", "std"), ("/mean", "mean"), ("/max", "max"), ("/min", "min"), ("/std", "std"))


def _reduction(key: str) -> str:
    last = key.rsplit("/", 1)[-1]
    if last.startswith("n_") or key.startswith("n_"):
        return "count"
    if last in ("hist", "by_staleness", "top_kl") or key == "by_staleness":
        return "table"
    if last[:1] == "p" and last[1:].isdigit():
        return "quantile"
    for suffix, reduce in _REDUCTIONS:
        if key.endswith(suffix):
            return reduce
    return "mean"


@dataclass(frozen=True)
class Figure:
    """One figure a metric group reports.

    Attributes:
        key: the key in the JSON ``metrics`` (a contract: never renamed without a ``schema_version`` bump).
        meaning: one line, shown beside the value in tables.
        section: the table it is shown in (default: the key's prefix before ``/``).
        needs: requirements in order; the first that fails is the ``omitted`` reason. Column requirements are
            listed before option requirements in the group's ``omitted``.
        enabled: ``enabled(config)`` false means the figure was not asked for (e.g. a ``--loss`` not selected): it
            is neither reported nor listed as omitted.
        reduce: how the per-token (or per-sequence) values become the figure: ``mean``, ``max``, ``min``,
            ``std``, ``count``, ``fraction``, ``quantile``, ``table`` (a list), or a short phrase.
        peers: ``{framework: PeerName}`` — the key each peer logs for the same figure (``--names``).
    """

    key: str
    meaning: str
    section: str | None = None
    needs: tuple[Requirement, ...] = ()
    enabled: Callable[[Any], bool] | None = None
    reduce: str | None = None
    peers: Mapping[str, PeerName | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.section is None:
            object.__setattr__(self, "section", self.key.split("/", 1)[0] if "/" in self.key else "other")
        if self.reduce is None:
            object.__setattr__(self, "reduce", _reduction(self.key))
        object.__setattr__(self, "peers", {fw: PeerName(p) if isinstance(p, str) else p
                                           for fw, p in self.peers.items()})

    def is_enabled(self, config: Any) -> bool:
        return self.enabled is None or bool(self.enabled(config))

    def missing(self, present: frozenset[str], config: Any, kind: str | None = None) -> str | None:
        """The reason this figure cannot be reported (first failing requirement of ``kind``), else ``None``."""
        for need in self.needs:
            if (kind is None or need.kind == kind) and not need.met(present, config):
                return need.reason
        return None


def omitted_reasons(figures: Sequence[Figure], present: frozenset[str], config: Any) -> dict[str, str]:
    """``{key: reason}`` for the enabled ``figures`` a dump with columns ``present`` cannot give: missing columns
    first (in declaration order), then options that are off."""
    out: dict[str, str] = {}
    enabled = [f for f in figures if f.is_enabled(config)]
    for kind in ("column", "option"):
        for figure in enabled:
            if figure.key not in out and (reason := figure.missing(present, config, kind)) is not None:
                out[figure.key] = reason
    return out
