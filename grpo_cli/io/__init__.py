"""Reading and writing schema-v1 rollout dumps. Importing this package pulls in no CLI code (typer, rich) and no torch:
the reader and the writer are loaded on first use (``grpo-cli schema`` and ``--version`` stay torch-free)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grpo_cli.io.schema import COLUMNS, SCHEMA_VERSION, Layout, parse_column_map

if TYPE_CHECKING:
    from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset, Shard, expand_paths
    from grpo_cli.io.writer import RolloutWriter, read_metadata

__all__ = [
    "COLUMNS",
    "DEFAULT_BATCH_TOKENS",
    "SCHEMA_VERSION",
    "Layout",
    "RolloutDataset",
    "RolloutWriter",
    "Shard",
    "expand_paths",
    "parse_column_map",
    "read_metadata",
]

_LAZY = {
    "DEFAULT_BATCH_TOKENS": "grpo_cli.io.reader",
    "RolloutDataset": "grpo_cli.io.reader",
    "Shard": "grpo_cli.io.reader",
    "expand_paths": "grpo_cli.io.reader",
    "RolloutWriter": "grpo_cli.io.writer",
    "read_metadata": "grpo_cli.io.writer",
}


def __getattr__(name: str) -> Any:
    # PEP 562 module __getattr__: the torch-backed names are imported when first used.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo_cli.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
