"""Hooks that write schema-v1 dumps, and feed the online findings (:class:`grpo_cli.Diagnoser`), from inside
training frameworks.

Each submodule imports its framework when it is imported itself (``grpo_cli.integrations.trl`` imports ``trl``);
importing :mod:`grpo_cli` or this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
