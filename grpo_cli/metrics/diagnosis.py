"""The statistics the findings layer needs beyond the reported figures (``diag/*``, :mod:`grpo_cli.core.diagnosis`),
one group per family so each keeps its own mergeable state.

These groups are *findings-only*: their ``diag/*`` values are the evidence of :mod:`grpo_cli.findings` and never
appear among a command's metrics. They run over the whole dump, not per ``--group-by`` value (the families that need
steps keep their own per-step tables). Log-probs are used as dumped: the temperature test needs raw values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.diagnosis import (
    LOGP_COLUMNS,
    by_step_compute,
    by_step_state,
    by_step_update,
    duplicates_compute,
    duplicates_retire_,
    duplicates_state,
    duplicates_update,
    equality_compute,
    equality_state,
    equality_update,
    groups_compute,
    groups_state,
    groups_update,
    lags_compute,
    lags_state,
    lags_update,
    shift_compute,
    shift_state,
    shift_update,
    zeros_compute,
    zeros_state,
    zeros_update,
)
from grpo_cli.core.diagnosis.pairs import N_BLOCKS, pairs_compute, pairs_state, pairs_update
from grpo_cli.core.prox import broadcast_current_version
from grpo_cli.core.state import MetricState
from grpo_cli.engine.blocks import block_keys
from grpo_cli.engine.group import MetricGroup

__all__ = ["diagnosis_groups"]


def _lag(valid: TokenBatch) -> Tensor | None:
    """Each valid token's lag ``current_version − version`` (−1 for prompt tokens), computed once per batch."""
    if valid.versions is None or valid.current_version is None:
        return None
    versions, current_version, cu_seqlens = valid.versions, valid.current_version, valid.cu_seqlens

    def compute() -> Tensor:
        current = broadcast_current_version(current_version, versions, cu_seqlens=cu_seqlens)
        return torch.where(versions >= 0, current.to(torch.int64) - versions.to(torch.int64), -1)

    return valid.memoised("diag_lag", compute)


class _DiagGroup(MetricGroup):
    findings_only = True


class ShiftGroup(_DiagGroup):
    """Agreement of ``new_logp`` with ``old_logp`` shifted by −1/0/+1 token, per sequence (alignment)."""

    name = "diag/shift"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "versions", "current_version", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return shift_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        if batch.old_logp is not None:
            # Lag-0 tokens only where versions tell: a stale token of a fast-moving policy can agree better with a
            # neighbour by chance; at lag 0 only a real shift does.
            lag = _lag(batch)
            mask = batch.loss_mask if lag is None else batch.loss_mask.to(torch.bool) & (lag == 0)
            shift_update(state, new_logp=batch.new_logp, old_logp=batch.old_logp, loss_mask=mask,
                         cu_seqlens=batch.cu_seqlens, file_index=batch.file_index, rows=batch.rows, step=batch.step)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return shift_compute(state)


class ZerosGroup(_DiagGroup):
    """Exact zeros under the mask, prompt tokens in the loss, response tokens out of it (mask)."""

    name = "diag/zeros"

    def columns(self) -> frozenset[str]:
        return frozenset({*LOGP_COLUMNS, "versions", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return zeros_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        zeros_update(state, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                     columns={name: getattr(batch, name) for name in LOGP_COLUMNS}, versions=batch.versions,
                     file_index=batch.file_index, rows=batch.rows, step=batch.step)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return zeros_compute(state)


class EqualityGroup(_DiagGroup):
    """Bitwise-equal log-prob columns (a reference that is another column)."""

    name = "diag/equality"

    def columns(self) -> frozenset[str]:
        return frozenset(LOGP_COLUMNS)

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return equality_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        equality_update(state, columns={"new": valid.new_logp, "old": valid.old_logp, "prox": valid.prox_logp,
                                        "ref": valid.ref_logp})

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return equality_compute(state)


class DuplicatesGroup(_DiagGroup):
    """Sequences written more than once: repeated (step, seq_id) keys and repeated contents."""

    name = "diag/duplicates"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "seq_id", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return duplicates_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        hashed = [batch.new_logp] + ([batch.old_logp] if batch.old_logp is not None else [])
        duplicates_update(state, cu_seqlens=batch.cu_seqlens, columns=hashed,  # type: ignore[arg-type]  # a KeyedState
                          seq_id=batch.seq_id, step=batch.step, file_index=batch.file_index, rows=batch.rows)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return duplicates_compute(state)  # type: ignore[arg-type]  # a KeyedState, from init_state

    def retire(self, state: MetricState, before_file: int) -> None:
        duplicates_retire_(state, before_file)  # type: ignore[arg-type]  # a KeyedState, from init_state


class GroupsGroup(_DiagGroup):
    """Advantages against rewards within GRPO groups: sign, centring, scale."""

    name = "diag/groups"

    def columns(self) -> frozenset[str]:
        return frozenset({"rewards", "advantages", "group_id", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return groups_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        if batch.rewards is not None and batch.advantages is not None and batch.group_id is not None:
            groups_update(state, rewards=batch.rewards, advantages=batch.advantages,  # type: ignore[arg-type]  # a KeyedState
                          loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens, group_id=batch.group_id,
                          step=batch.step)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return groups_compute(state)  # type: ignore[arg-type]  # a KeyedState, from init_state


class ByStepGroup(_DiagGroup):
    """Per-step series: lag-0 disagreement, entropy, EOS, lags, clipping (trends over training)."""

    name = "diag/by_step"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions", "current_version",
                          "eos", "advantages", "rewards", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return by_step_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        if batch.step is None:
            return
        by_step_update(state, step=batch.step, new_logp=valid.new_logp,  # type: ignore[arg-type]  # a KeyedState
                       cu_seqlens=valid.cu_seqlens, old_logp=valid.old_logp, entropy=valid.entropy, lag=_lag(valid),
                       eos=valid.eos, advantages=valid.advantages, base_logp=valid.ratio_base_logp,
                       epsilon=config.epsilon, epsilon_high=config.epsilon_high, prox_logp=valid.prox_logp,
                       rewards=valid.rewards, ref_logp=valid.ref_logp)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        if state["s"].shape[0] == 0:
            return {}
        return by_step_compute(state)  # type: ignore[arg-type]  # a KeyedState, from init_state


class LagsGroup(_DiagGroup):
    """Per lag: disagreement and the log-linear proximal approximation's error; the lag-0 figures (mismatch)."""

    name = "diag/lags"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "versions", "current_version", "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return lags_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        lag = _lag(valid)
        if valid.old_logp is not None and lag is not None:
            lags_update(state, new_logp=valid.new_logp, old_logp=valid.old_logp, lag=lag,
                        cu_seqlens=valid.cu_seqlens, prox_logp=valid.prox_logp, file_index=batch.file_index,
                        rows=batch.rows, step=batch.step)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return lags_compute(state)


class PairsGroup(_DiagGroup):
    """Behaviour against same-weights training log-probs: temperature, truncation, mismatch, re-tokenisation,
    proximal recompute, each with its interval over blocks of GRPO groups."""

    name = "diag/pairs"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "entropy", "versions", "current_version", "group_id",
                          "step"})

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return pairs_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        if valid.old_logp is not None:
            pairs_update(state, new_logp=valid.new_logp, old_logp=valid.old_logp, prox_logp=valid.prox_logp,
                         entropy=valid.entropy, cu_seqlens=valid.cu_seqlens, block=block_keys(batch, N_BLOCKS),
                         lag=_lag(valid), file_index=batch.file_index, rows=batch.rows, step=batch.step)

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return pairs_compute(state)


def diagnosis_groups() -> list[MetricGroup]:
    """The findings-only groups, one per family of :mod:`grpo_cli.core.diagnosis`."""
    return [ShiftGroup(), ZerosGroup(), EqualityGroup(), DuplicatesGroup(), GroupsGroup(),
            ByStepGroup(), LagsGroup(), PairsGroup()]
