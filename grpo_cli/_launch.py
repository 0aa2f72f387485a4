"""What a ``torchrun`` (or any ``torch.distributed`` launcher) put in the environment, read without importing torch
(the CLI decides before it loads anything heavy whether this process writes the report)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DistributedEnv", "distributed_env", "is_secondary_rank"]


@dataclass(frozen=True)
class DistributedEnv:
    """What a ``torchrun`` (or any ``torch.distributed`` launcher) put in the environment."""

    rank: int
    world_size: int
    local_rank: int


def distributed_env() -> DistributedEnv | None:
    """The launch described by ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, or ``None`` outside a multi-process launch."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in os.environ:
        return None
    return DistributedEnv(rank, world, local)


def is_secondary_rank() -> bool:
    """True on every ``torchrun`` rank but 0: those write no report and no messages."""
    env = distributed_env()
    return env is not None and env.rank != 0
