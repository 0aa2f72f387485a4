"""Sequence and group figures as a functional core.

- ``adv/*``: advantages over valid tokens (per-sequence advantages are broadcast, so sequences weigh by length, as
  AReaL's ``advantages`` stat over ``n_valid_tokens``): mean, population std, fractions > 0, < 0 and = 0.
- ``seq/len_*``: valid (loss-mask) tokens per sequence — the response length — over *all* sequences, empty ones
  included.
- ``reward/*``: one reward per sequence, mean and population std over sequences.
- ``groups/*``: GRPO groups by ``group_id`` (over the whole dump: rows of a group may sit anywhere). A group whose
  rewards are all equal — a singleton included — has zero reward std, hence zero group-normalised advantages and no
  learning signal (TRL ``frac_reward_zero_std``, slime ``zero_std/count_*``). Kept exactly in a keyed table (one row
  per group: count, min reward, max reward), see :mod:`grpo_cli.core.keyed_state`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import lengths_from_cu_seqlens
from grpo_cli.core.state import Reduce, count, maximum, minimum, total

__all__ = ["sequence_stats_compute", "sequence_stats_state", "sequence_stats_update"]


def sequence_stats_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`sequence_stats_update`."""
    specs = {
        "n_seq": count(),
        "sum_len": count(),
        "min_len": minimum(),
        "max_len": maximum(),
        "n_adv": count(),
        "adv_s1": total(),
        "adv_s2": total(),
        "adv_pos": count(),
        "adv_neg": count(),
        "adv_zero": count(),
        "n_reward": count(),
        "reward_s1": total(),
        "reward_s2": total(),
    }
    return KeyedState(specs, {"groups": (Reduce.SUM, Reduce.MIN, Reduce.MAX)}, device)


def sequence_stats_update(
    state: KeyedState,
    *,
    cu_seqlens: Tensor,
    advantages: Tensor | None = None,
    rewards: Tensor | None = None,
    group_id: Tensor | None = None,
) -> None:
    """Fold one batch into ``state``.

    Args:
        state: from :func:`sequence_stats_state`.
        cu_seqlens: ``[B + 1]`` offsets of the *valid* tokens (lengths = response lengths).
        advantages: ``[N]`` advantages of the valid tokens, or ``None``.
        rewards: ``[B]`` rewards, or ``None``.
        group_id: ``[B]`` int group ids (with ``rewards``: the group figures), or ``None``.
    """
    lengths = lengths_from_cu_seqlens(cu_seqlens)
    n_seq = lengths.numel()
    state.update(n_seq=torch.tensor(n_seq), sum_len=lengths.sum())
    if n_seq:
        state.update(min_len=lengths.min(), max_len=lengths.max())
    if advantages is not None and advantages.numel():
        a = advantages.to(torch.float64)
        state.update(
            n_adv=torch.tensor(a.numel()),
            adv_s1=a.sum(),
            adv_s2=(a * a).sum(),
            adv_pos=(advantages > 0).sum(),
            adv_neg=(advantages < 0).sum(),
            adv_zero=(advantages == 0).sum(),
        )
    if rewards is not None and n_seq:
        r = rewards.to(torch.float64)
        state.update(n_reward=torch.tensor(n_seq), reward_s1=r.sum(), reward_s2=(r * r).sum())
        if group_id is not None:
            rows = torch.stack([group_id.to(torch.float64), torch.ones_like(r), r, r], dim=1)
            state.update(groups=rows)


def _std(s1: float, s2: float, n: int) -> float:
    mean = s1 / n
    return math.sqrt(max(s2 / n - mean * mean, 0.0))


def sequence_stats_compute(state: KeyedState) -> dict[str, Any]:
    """``seq/len_{mean,min,max}``, ``adv/{mean,std,pos_frac,neg_frac,zero_frac}``, ``reward/{mean,std}``,
    ``groups/{n,zero_std_frac}`` as far as their inputs were seen."""
    s = state
    out: dict[str, Any] = {}
    n_seq = int(s["n_seq"])
    if n_seq:
        out["seq/len_mean"] = int(s["sum_len"]) / n_seq
        out["seq/len_min"] = int(s["min_len"])
        out["seq/len_max"] = int(s["max_len"])
    n = int(s["n_adv"])
    if n:
        out["adv/mean"] = float(s["adv_s1"]) / n
        out["adv/std"] = _std(float(s["adv_s1"]), float(s["adv_s2"]), n)
        out["adv/pos_frac"] = int(s["adv_pos"]) / n
        out["adv/neg_frac"] = int(s["adv_neg"]) / n
        out["adv/zero_frac"] = int(s["adv_zero"]) / n
    n = int(s["n_reward"])
    if n:
        out["reward/mean"] = float(s["reward_s1"]) / n
        out["reward/std"] = _std(float(s["reward_s1"]), float(s["reward_s2"]), n)
    table = s["groups"]
    if table.shape[0]:
        out["groups/n"] = int(table.shape[0])
        # min == max ⇔ every reward of the group is equal (a NaN reward never compares equal: counted as spread).
        out["groups/zero_std_frac"] = int((table[:, 2] == table[:, 3]).sum()) / table.shape[0]
    return out
