"""The rollout schema, version 1 (``docs/schema.md``): column names, kinds and the ``--map`` renaming."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from grpo_cli.errors import UsageError

__all__ = ["COLUMNS", "SCHEMA_VERSION", "ColumnKind", "ColumnSpec", "Layout", "parse_column_map"]

SCHEMA_VERSION = 1


class ColumnKind(str, enum.Enum):
    TOKEN_FLOAT = "per-token float"
    TOKEN_MASK = "per-token bool/int mask"
    TOKEN_INT = "per-token int"
    SEQUENCE_OR_TOKEN_FLOAT = "per-sequence or per-token float"
    SEQUENCE_FLOAT = "per-sequence float"
    SEQUENCE_INT = "per-sequence int"


class Layout(str, enum.Enum):
    SEQUENCE_PER_ROW = "sequence-per-row"
    TOKEN_PER_ROW = "token-per-row"


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: ColumnKind
    meaning: str


COLUMNS: dict[str, ColumnSpec] = {
    spec.name: spec
    for spec in (
        ColumnSpec("new_logp", ColumnKind.TOKEN_FLOAT, "log π_θ(token) from the training forward pass"),
        ColumnSpec("old_logp", ColumnKind.TOKEN_FLOAT, "behaviour-policy (inference engine) log-prob"),
        ColumnSpec("prox_logp", ColumnKind.TOKEN_FLOAT, "recomputed proximal-policy log-prob (decoupled PPO)"),
        ColumnSpec("ref_logp", ColumnKind.TOKEN_FLOAT, "reference-policy log-prob"),
        ColumnSpec("entropy", ColumnKind.TOKEN_FLOAT, "token entropy of π_θ"),
        ColumnSpec("teacher_logp", ColumnKind.TOKEN_FLOAT, "teacher-model log-prob (distillation)"),
        ColumnSpec("loss_mask", ColumnKind.TOKEN_MASK, "1 = response token that enters the loss"),
        ColumnSpec("versions", ColumnKind.TOKEN_INT, "policy version that generated the token; −1 for prompt"),
        ColumnSpec("advantages", ColumnKind.SEQUENCE_OR_TOKEN_FLOAT, "advantage per sequence or per token"),
        ColumnSpec("rewards", ColumnKind.SEQUENCE_FLOAT, "scalar reward of the sequence"),
        ColumnSpec("current_version", ColumnKind.SEQUENCE_INT, "trainer version when the sequence was consumed"),
        ColumnSpec("step", ColumnKind.SEQUENCE_INT, "training step"),
        ColumnSpec("group_id", ColumnKind.SEQUENCE_INT, "GRPO group (prompt) id"),
        ColumnSpec("seq_id", ColumnKind.SEQUENCE_INT, "sequence id (groups rows in the token-per-row layout)"),
        ColumnSpec("eos", ColumnKind.SEQUENCE_INT, "1 = the sequence ended with EOS, 0 = cut off (bool or int)"),
        ColumnSpec("micro_batch", ColumnKind.SEQUENCE_INT, "training micro-batch (forward) the sequence came from"),
    )
}

REQUIRED_COLUMNS = ("new_logp",)


def parse_column_map(items: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``["canonical=actual", ...]`` → ``{canonical: actual}``; unknown canonical names are a usage error."""
    if items is None:
        return {}
    pairs = items.items() if isinstance(items, Mapping) else (_split_pair(item) for item in items)
    mapping: dict[str, str] = {}
    for canonical, actual in pairs:
        if canonical not in COLUMNS:
            known = ", ".join(COLUMNS)
            raise UsageError(f"--map: unknown column '{canonical}' (schema v1 columns: {known})")
        mapping[canonical] = actual
    return mapping


def _split_pair(item: str) -> tuple[str, str]:
    canonical, sep, actual = item.partition("=")
    if not sep or not canonical or not actual:
        raise UsageError(f"--map expects canonical=actual, got '{item}'")
    return canonical.strip(), actual.strip()
