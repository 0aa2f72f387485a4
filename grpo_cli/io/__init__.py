"""Reading and writing schema-v1 rollout dumps. Importing this package pulls in no CLI code (typer, rich)."""

from __future__ import annotations

from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset, Shard, expand_paths
from grpo_cli.io.schema import COLUMNS, SCHEMA_VERSION, Layout, parse_column_map
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
