"""Every family at once: the states by name, one update that runs each family a batch has the columns
for, and every figure."""

from __future__ import annotations

from typing import Any, cast

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.diagnosis._common import LOGP_COLUMNS
from grpo_cli.core.diagnosis.by_step import by_step_compute, by_step_state, by_step_update
from grpo_cli.core.diagnosis.duplicates import duplicates_compute, duplicates_state, duplicates_update
from grpo_cli.core.diagnosis.equality import equality_compute, equality_state, equality_update
from grpo_cli.core.diagnosis.groups import groups_compute, groups_state, groups_update
from grpo_cli.core.diagnosis.lags import lags_compute, lags_state, lags_update
from grpo_cli.core.diagnosis.relation import relation_compute, relation_state, relation_update
from grpo_cli.core.diagnosis.shift import shift_compute, shift_state, shift_update
from grpo_cli.core.diagnosis.zeros import zeros_compute, zeros_state, zeros_update
from grpo_cli.core.keyed_state import KeyedState
from grpo_cli.core.prox import broadcast_current_version
from grpo_cli.core.state import MetricState

__all__ = ["diagnosis_compute", "diagnosis_state", "diagnosis_update"]


def diagnosis_state(device: torch.device | str | None = None, top_k: int = 8) -> dict[str, MetricState]:
    """The states of every family, by name (merge each with its own ``merge_``)."""
    return {
        "shift": shift_state(device, top_k), "relation": relation_state(device, top_k),
        "zeros": zeros_state(device, top_k), "equality": equality_state(device),
        "duplicates": duplicates_state(device), "groups": groups_state(device), "by_step": by_step_state(device),
        "lags": lags_state(device, top_k),
    }


def diagnosis_update(
    states: dict[str, MetricState],
    batch: TokenBatch,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> None:
    """Fold one :class:`~grpo_cli.core.batch.TokenBatch` (whole sequences, boolean ``loss_mask``) into ``states``,
    running each family whose columns the batch has.

    Args:
        states: from :func:`diagnosis_state`.
        batch: whole sequences with every column the dump has.
        epsilon, epsilon_high: the clip range of the per-step clip fraction (``--epsilon``, ``--epsilon-high``).
    """
    rows, fi = batch.rows, batch.file_index
    cu = batch.cu_seqlens
    step = batch.step
    cols = {name: getattr(batch, name) for name in LOGP_COLUMNS}
    zeros_update(states["zeros"], loss_mask=batch.loss_mask, cu_seqlens=cu, columns=cols, versions=batch.versions,
                 file_index=fi, rows=rows, step=step)
    hashed = [batch.new_logp] + ([batch.old_logp] if batch.old_logp is not None else [])
    duplicates_update(cast(KeyedState, states["duplicates"]), cu_seqlens=cu, columns=hashed, seq_id=batch.seq_id,
                      step=step, file_index=fi, rows=rows)
    if batch.old_logp is not None:
        shift_update(states["shift"], new_logp=batch.new_logp, old_logp=batch.old_logp, loss_mask=batch.loss_mask,
                     cu_seqlens=cu, file_index=fi, rows=rows, step=step)
    v = batch.valid()
    vcu = v.cu_seqlens
    equality_update(states["equality"], columns={"new": v.new_logp, "old": v.old_logp, "prox": v.prox_logp,
                                                 "ref": v.ref_logp})
    lag = None
    if v.versions is not None and v.current_version is not None:
        current = broadcast_current_version(v.current_version, v.versions, cu_seqlens=vcu)
        lag = torch.where(v.versions >= 0, current.to(torch.int64) - v.versions.to(torch.int64), -1)
    if v.old_logp is not None:
        relation_update(states["relation"], new_logp=v.new_logp, old_logp=v.old_logp, cu_seqlens=vcu,
                        file_index=fi, rows=rows, step=step)
        if lag is not None:
            lags_update(states["lags"], new_logp=v.new_logp, old_logp=v.old_logp, lag=lag, cu_seqlens=vcu,
                        prox_logp=v.prox_logp, file_index=fi, rows=rows, step=step)
    if batch.rewards is not None and batch.advantages is not None and batch.group_id is not None:
        groups_update(cast(KeyedState, states["groups"]), rewards=batch.rewards, advantages=batch.advantages,
                      loss_mask=batch.loss_mask, cu_seqlens=cu, group_id=batch.group_id, step=step)
    if step is not None:
        base = v.prox_logp if v.prox_logp is not None else v.old_logp
        by_step_update(cast(KeyedState, states["by_step"]), step=step, new_logp=v.new_logp, cu_seqlens=vcu,
                       old_logp=v.old_logp, entropy=v.entropy, lag=lag, eos=v.eos, advantages=v.advantages,
                       base_logp=base, epsilon=epsilon, epsilon_high=epsilon_high, prox_logp=v.prox_logp,
                       rewards=v.rewards)


def diagnosis_compute(states: dict[str, MetricState]) -> dict[str, Any]:
    """Every ``diag/*`` figure the states support."""
    out: dict[str, Any] = {}
    out.update(shift_compute(states["shift"]))
    out.update(relation_compute(states["relation"]))
    out.update(zeros_compute(states["zeros"]))
    out.update(equality_compute(states["equality"]))
    out.update(duplicates_compute(states["duplicates"]))  # type: ignore[arg-type]  # a KeyedState
    out.update(groups_compute(states["groups"]))  # type: ignore[arg-type]  # a KeyedState
    if states["by_step"]["s"].shape[0]:
        out.update(by_step_compute(states["by_step"]))  # type: ignore[arg-type]  # a KeyedState
    out.update(lags_compute(states["lags"]))
    return out
