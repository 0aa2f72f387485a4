"""Peer conventions: one keyword, ``convention``, selects whose definition a core function computes.

Several figures are defined differently by the peers, or by two releases of one peer. Every core function with
such a difference takes ``convention: str | None``:

- ``None`` (the default) keeps grpo-cli's own definition, the one its existing figures and tests use;
- a bare peer name (``"verl"``, ``"trl"``, ``"areal"``, ``"twinkle"``) is that peer's pinned current release
  (:data:`PEER_RELEASES`); figures shown under a peer's name (``--names <peer>``) pass it;
- ``"<peer><=<version>"`` (for example ``"verl<=0.6"``) is an older release whose definition differs and that
  users still run; each function lists the ones it accepts.

A function raises ``ValueError`` for a convention it does not know, so a typo never falls back silently.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PEER_RELEASES", "check_convention"]

PEER_RELEASES: dict[str, str] = {"verl": "0.9.1", "trl": "1.16.0", "areal": "1.0.4", "twinkle": "0.5.1"}
"""The peer releases the bare names stand for (the versions the conformance tier runs, ``docs/peers.md``)."""


def check_convention(convention: str | None, accepted: Sequence[str], what: str) -> str | None:
    """Return ``convention`` if it is ``None`` or one of ``accepted``; raise ``ValueError`` otherwise.

    Args:
        convention: the caller's ``convention`` argument.
        accepted: the conventions ``what`` distinguishes (besides ``None``).
        what: the function or figure, for the error message.

    Raises:
        TypeError: ``convention`` is not a string or None.
        ValueError: an unknown convention.

    Example:
        >>> check_convention("verl", ("verl", "verl<=0.6"), "aggregate_loss")
        'verl'
    """
    if convention is None:
        return None
    if not isinstance(convention, str):
        raise TypeError(f"convention must be a string or None, got {type(convention).__name__}")
    if convention not in accepted:
        choices = ", ".join(repr(c) for c in accepted)
        raise ValueError(f"Unknown convention {convention!r} for {what}; choose None (grpo-cli) or one of {choices}")
    return convention
