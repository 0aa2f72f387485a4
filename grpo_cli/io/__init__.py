"""Reading (and, later, writing) schema-v1 rollout dumps. Importing this package pulls in no CLI code."""

from __future__ import annotations

from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS, RolloutDataset, Shard, expand_paths
from grpo_cli.io.schema import COLUMNS, SCHEMA_VERSION, Layout, parse_column_map

__all__ = [
    "COLUMNS",
    "DEFAULT_BATCH_TOKENS",
    "SCHEMA_VERSION",
    "Layout",
    "RolloutDataset",
    "Shard",
    "expand_paths",
    "parse_column_map",
]
