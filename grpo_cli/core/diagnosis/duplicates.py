"""The **duplicates** family: keyed tables of sequence content hashes and of (step, seq_id) keys."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import locations
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.packing import lengths_from_cu_seqlens, segment_ids
from grpo_cli.core.state import Reduce, count

__all__ = ["duplicates_compute", "duplicates_retire_", "duplicates_state", "duplicates_update", "sequence_hash"]

_HASH_P = 2_147_483_647  # 2^31 − 1
_LOC_SCALE = 2.0**32


def _mix(values: Tensor, salt: int) -> Tensor:
    """A position-free mixing of int64 values in [0, 2^32) into [0, _HASH_P); overwrites ``values``."""
    mixed = (values >> 16).mul_(40503 + salt)
    return mixed.add_(values.bitwise_and_(0xFFFF), alpha=65599 + 7 * salt).add_(12345 + salt).remainder_(_HASH_P)


def sequence_hash(bits: list[Tensor], cu_seqlens: Tensor) -> Tensor:
    """A float64 key in [0, 2^52) per sequence from the float32 bit patterns of its per-token values.

    Args:
        bits: ``[N]`` float tensors (each viewed as float32 bits) to hash together.
        cu_seqlens: ``[B + 1]`` offsets.

    Each token contributes ``mix(bits) · m(position)`` modulo the prime 2³¹ − 1 with a position multiplier
    ``m(p) = (p + 1)·2654435761 mod (2³¹ − 1)``; the per-sequence sum modulo 2³¹ − 1 is combined with the length
    (mod 2²¹), so two keys collide by chance with probability about 2⁻⁵², and equal sequences always agree.
    """
    n = bits[0].numel()
    n_seq = cu_seqlens.numel() - 1
    device = bits[0].device
    seq = segment_ids(cu_seqlens, n).to(device)
    # In place throughout: on a CPU these int64 passes cost their allocations more than their arithmetic.
    mult = torch.arange(1, n + 1, device=device).sub_(cu_seqlens[:-1].to(device).index_select(0, seq))
    mult.mul_(2654435761).remainder_(_HASH_P)
    acc = torch.zeros(n, dtype=torch.int64, device=device)
    for salt, values in enumerate(bits):
        raw = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
        acc.add_(_mix(raw, salt).mul_(mult).remainder_(_HASH_P))
    # One reduction of the token terms instead of one per column: the same residues, and the per-sequence sums of
    # terms below 2^31 stay far below 2^63.
    acc.remainder_(_HASH_P)
    sums = torch.zeros(n_seq, dtype=torch.int64, device=device).index_add_(0, seq, acc).remainder_(_HASH_P)
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(device) % (1 << 21)
    return (sums + _HASH_P * lengths).to(torch.float64)


def duplicates_state(device: torch.device | str | None = None) -> KeyedState:
    """An empty state for :func:`duplicates_update`: keyed tables ``content`` and ``ids`` with columns
    (count, first location, last location), a location being ``file·2³² + row``, and what
    :func:`duplicates_retire_` folded out of each: the sequences (``content_retired``, ``ids_retired``) and the
    repeats among them (``content_extra_retired``, ``ids_extra_retired``)."""
    ops = (Reduce.SUM, Reduce.MIN, Reduce.MAX)
    retired = {f"{name}{part}_retired": count() for name in ("content", "ids") for part in ("", "_extra")}
    return KeyedState(retired, {"content": ops, "ids": ops}, device)


def duplicates_retire_(state: KeyedState, before_file: int) -> None:
    """Fold the rows last seen in a file before ``before_file`` out of the tables into the ``*_retired`` counts:
    memory then holds the keys of the recent files only.

    :func:`duplicates_compute` gives the same fractions and counts as without retiring unless a sequence repeats one
    retired before it (a copy more than the window apart, which is then not counted); ``diag/dup_where`` names
    repeats among the kept rows only. The online
    :class:`~grpo_cli.commands.diagnoser.Diagnoser` calls it with each step as a file.

    Example:
        >>> state = duplicates_state()
        >>> cu = torch.tensor([0, 2, 4])
        >>> duplicates_update(state, cu_seqlens=cu, columns=[torch.tensor([-1.0, -2.0, -1.0, -2.0])])
        >>> duplicates_update(state, cu_seqlens=cu[:2], columns=[torch.tensor([-3.0, -4.0])], file_index=1)
        >>> duplicates_retire_(state, 1)
        >>> state["content"].shape[0], int(state["content_retired"]), duplicates_compute(state)["diag/dup_content_frac"]
        (1, 2, 0.3333333333333333)
        >>> duplicates_retire_(state, 2)
        >>> state["content"].shape[0], int(state["content_retired"]), duplicates_compute(state)["diag/dup_content_frac"]
        (0, 3, 0.3333333333333333)
    """
    for name in ("content", "ids"):
        table = state[name]
        old = table[:, 3] < before_file * _LOC_SCALE
        if bool(old.any()):
            n = table[old, 1]
            state.values[f"{name}_retired"] = state[f"{name}_retired"] + n.sum().to(torch.int64)
            state.values[f"{name}_extra_retired"] = state[f"{name}_extra_retired"] + (n - 1).sum().to(torch.int64)
            state.values[name] = table[~old]


def duplicates_update(
    state: KeyedState,
    *,
    cu_seqlens: Tensor,
    columns: list[Tensor],
    seq_id: Tensor | None = None,
    step: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
) -> None:
    """Fold one batch of whole sequences into ``state``.

    Args:
        state: from :func:`duplicates_state`.
        cu_seqlens: ``[B + 1]`` offsets.
        columns: ``[N]`` per-token columns to hash (e.g. ``new_logp`` and ``old_logp`` over all tokens).
        seq_id, step: ``[B]`` ids, or ``None``; the ``ids`` table is keyed by (step, seq_id) (seq_id alone without
            a step column).
        file_index, rows: locations.

    Memory: one row (4 float64) per distinct sequence in each table, 64 bytes per sequence in all: 64 MB for a
    million sequences. The tables are exact; no bounded sketch is used because a duplicate must be located.
    """
    n_seq = cu_seqlens.numel() - 1
    if n_seq == 0:
        return
    device = columns[0].device
    file, row = locations(file_index, rows, n_seq, device)
    loc = file * _LOC_SCALE + row
    ones = torch.ones(n_seq, dtype=torch.float64, device=device)
    key = sequence_hash(columns, cu_seqlens)
    state.update(content=torch.stack([key, ones, loc, loc], dim=1))
    if seq_id is not None:
        ids = seq_id.to(device=device, dtype=torch.int64)
        if step is not None:
            st = step.to(device=device, dtype=torch.int64)
            k = ((ids % _HASH_P) * 1_000_003 + (st % _HASH_P) * 998_244_353) % _HASH_P
            k = k + _HASH_P * ((ids // _HASH_P + st * 31) % (1 << 21))
        else:
            k = ids
        state.update(ids=torch.stack([k.to(torch.float64), ones, loc, loc], dim=1))


def _dups(table: Tensor, retired: int = 0, extra_retired: int = 0, limit: int = 8
          ) -> tuple[int, int, list[dict[str, int]]]:
    if table.shape[0] == 0:
        return extra_retired, retired, []
    counts = table[:, 1]
    rep = counts > 1
    extra = int((counts[rep] - 1).sum()) + extra_retired
    where = []
    for r in table[rep][:limit].tolist():
        first, last = int(r[2]), int(r[3])
        where.append({"count": int(r[1]), "file": first >> 32, "row": first & 0xFFFFFFFF,
                      "other_file": last >> 32, "other_row": last & 0xFFFFFFFF})
    return extra, int(counts.sum()) + retired, where


def duplicates_compute(state: KeyedState) -> dict[str, Any]:
    """``diag/dup_content_extra`` (sequences whose hashed content repeats an earlier one: Σ(count − 1)),
    ``diag/dup_content_frac`` (that over all sequences), ``diag/dup_id_extra`` and ``diag/dup_id_frac`` for
    (step, seq_id) keys, and ``diag/dup_where`` (up to 8 repeated keys with two of their locations)."""
    out: dict[str, Any] = {}
    extra, total_seq, where = _dups(state["content"], int(state["content_retired"]),
                                    int(state["content_extra_retired"]))
    if total_seq:
        out["diag/dup_content_extra"] = extra
        out["diag/dup_content_frac"] = extra / total_seq
    id_extra, id_total, id_where = _dups(state["ids"], int(state["ids_retired"]), int(state["ids_extra_retired"]))
    if id_total:
        out["diag/dup_id_extra"] = id_extra
        out["diag/dup_id_frac"] = id_extra / id_total
    out["diag/dup_where"] = id_where or where
    return out
