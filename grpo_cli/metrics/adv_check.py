"""The metric groups of ``grpo-cli advantages``, run by :func:`grpo_cli.engine.run.run` in passes.

1. :class:`AdvSequencesGroup` collects the per-sequence scalars (reward, response length, ``group_id``, training
   batch, ``eos``) into a keyed table, one row per sequence (O(n_sequences), merged exactly across batches,
   ``--workers`` and ``torchrun`` ranks); the command turns it into group statistics and per-sequence advantages
   (:mod:`grpo_cli.metrics.adv_recompute`).
2. :class:`AdvMomentsGroup` (GAE with ``adv_norm``, REINFORCE++ whitening only) folds the float64 batch/group
   moments of the token advantages, once per moment the normalisation needs.
3. :class:`AdvCheckGroup` recomputes each batch's advantages and compares them with the dump's: the declared
   ``adv_check/*`` figures, plus, for the per-sequence estimators, one mismatch count per common variant.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor

from grpo_cli.core.adv_check import adv_diff_compute, adv_diff_state, adv_diff_update, adv_mismatch
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import KeyedState, keyed_combine
from grpo_cli.core.packing import segment_ids, segment_sum
from grpo_cli.core.state import MetricState, Reduce, count, maximum, total
from grpo_cli.engine.figures import Figure
from grpo_cli.engine.group import MetricGroup
from grpo_cli.errors import InputError
from grpo_cli.metrics.adv_config import AdvantageCheckConfig
from grpo_cli.metrics.adv_recompute import Recompute, Sequences, Variant

__all__ = [
    "ADV_CHECK_FIGURES",
    "AdvCheckGroup",
    "AdvMomentsGroup",
    "AdvSequencesGroup",
    "sequences_from",
    "stash_advantages",
]

_F64 = torch.float64
_EXACT = 1 << 53
"""Integers the float64 sequence table holds exactly."""
_SEQ_FIELDS = ("rewards", "response_len", "group_id", "batch_key", "eos")
"""Columns of the per-sequence table after its key ``file·2³² + row`` (float64: exact for ints below 2⁵³)."""


class _SequenceTable(KeyedState):
    """A keyed table with one row per sequence, combined lazily: a batch's rows are queued and folded in with one
    :func:`~grpo_cli.core.keyed_state.keyed_combine` when the table is read or merged (a combine per batch would
    copy the whole table every batch). Every column reduces with ``max`` over a single row: the value itself."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.__dict__["_pending"] = []
        super().__init__({}, {"seq": (Reduce.MAX,) * len(_SEQ_FIELDS)}, device)

    @property
    def values(self) -> dict[str, Tensor]:
        pending = self.__dict__["_pending"]
        if pending:
            table = self.__dict__["_values"]
            table["seq"] = keyed_combine(self.keyed["seq"], table["seq"], torch.cat(pending))
            self.__dict__["_pending"] = []
        return self.__dict__["_values"]

    @values.setter
    def values(self, value: dict[str, Tensor]) -> None:
        self.__dict__["_values"] = value
        self.__dict__["_pending"] = []

    def update(self, **partials: Tensor) -> None:
        self.__dict__["_pending"].append(partials["seq"].to(_F64))


class AdvSequencesGroup(MetricGroup):
    """Pass 1: the per-sequence scalars of every (valid) sequence, keyed by (file, row)."""

    name = "adv_sequences"

    def __init__(self, batch_by: str | None) -> None:
        self.batch_by = batch_by

    def columns(self) -> frozenset[str]:
        return frozenset({"rewards", "loss_mask", "group_id", "eos"} | ({self.batch_by} if self.batch_by else set()))

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        return _SequenceTable(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        for name in ("group_id", self.batch_by):
            value = getattr(batch, name) if name else None
            if value is not None and value.numel() and int(value.abs().max()) >= _EXACT:
                raise InputError(f"{name} values of 2^53 or more are not supported by advantages (float64 table)",
                                 column=name)
        keys = batch.sequence_keys()
        zeros = torch.zeros(batch.n_sequences, dtype=torch.int64, device=keys.device)
        columns = [
            (keys[:, 0] * (1 << 32) + keys[:, 1]).to(_F64),
            cast(Tensor, batch.rewards).to(_F64),  # a required column
            segment_sum(batch.loss_mask.to(torch.int64), batch.cu_seqlens).to(_F64),
            *(
                (zeros if value is None else value).to(_F64)
                for value in (batch.group_id, getattr(batch, self.batch_by) if self.batch_by else None, batch.eos)
            ),
        ]
        state.update(seq=torch.stack(columns, dim=1))

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return {"sequences": state["seq"]}  # not a figure: the command builds the recomputation from it


def sequences_from(table: Tensor, columns: frozenset[str], batch_by: str | None, device: torch.device) -> Sequences:
    """The :class:`~grpo_cli.metrics.adv_recompute.Sequences` of :class:`AdvSequencesGroup`'s merged table."""
    table = table.to(device)
    key = table[:, 0].to(torch.int64)
    ints = {name: table[:, i].to(torch.int64) for i, name in enumerate(_SEQ_FIELDS, start=1) if name != "rewards"}
    return Sequences(
        file_index=key >> 32,
        rows=key & ((1 << 32) - 1),
        rewards=table[:, 1],
        response_len=ints["response_len"],
        group_id=ints["group_id"] if "group_id" in columns else None,
        batch_key=ints["batch_key"] if batch_by is not None else None,
        eos=ints["eos"] if "eos" in columns else None,
    )


def _index(recompute: Recompute, batch: TokenBatch, dataset_files: tuple[str, ...]) -> Tensor:
    idx = recompute.seqs.index_of(batch)
    if idx is None:
        # Every pass reads and validates the same rows; a sequence the first pass did not see means the files changed.
        raise InputError("the dump changed while it was being read", file=dataset_files[batch.file_index])
    return idx


class AdvMomentsGroup(MetricGroup):
    """A token pass of the batch/group normalisation: the float64 moments of pass ``phase`` (1 means, 2 stds) of
    :class:`~grpo_cli.core.adv_check.StreamingNormalization` / :class:`~grpo_cli.core.adv_check.StreamingWhiten`.

    The streaming state adds each batch into its moment tensors in place (``index_add_``); here those tensors are
    the group's mergeable state, so units, ``--workers`` and ranks sum them exactly like every other figure."""

    name = "adv_moments"

    def __init__(self, recompute: Recompute, phase: int, files: tuple[str, ...]) -> None:
        self.recompute, self.phase, self.files = recompute, phase, files

    def columns(self) -> frozenset[str]:
        return frozenset(self.recompute.columns())

    def init_state(self, config: Any, device: torch.device | str) -> MetricState:
        moments, _ = self.recompute.moments(self.phase)
        n = moments.count.numel()
        return MetricState({"count": total((n,)), "sum": total((n,)), "sum_sq": total((n,))}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: Any) -> None:
        moments, written = self.recompute.moments(self.phase)
        for name in written:
            setattr(moments, name, state[name])
        self.recompute.update(self.phase, batch, _index(self.recompute, batch, self.files))

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        return {"moments": {name: state[name] for name in state}}

    def load(self, merged: dict[str, Tensor]) -> None:
        """Point the normalisation at the merged moments of this pass (before the next pass runs)."""
        moments, written = self.recompute.moments(self.phase)
        for name in written:
            setattr(moments, name, merged[name])


def stash_advantages(batch: TokenBatch) -> TokenBatch:
    """A dataset transform for the comparison pass: the dump's advantages ride in ``positions``.

    The dumped advantages are what ``advantages`` checks, not input to a figure: a NaN there is a mismatch to report
    (``adv_check/n_nonfinite``), not an invalid value for ``--on-invalid`` to refuse or drop. The validator checks
    ``advantages`` but never ``positions`` (a per-token slot that :meth:`TokenBatch.select_sequences` and
    :meth:`TokenBatch.to` carry along and only valid views set), so the values pass through it untouched.
    """
    if batch.advantages is None:
        return batch
    return replace(batch, advantages=None, positions=batch.advantages)


class AdvCheckGroup(MetricGroup):
    """The last pass: each batch's recomputed advantages against the dump's (``adv_check/*``), and the mismatches of
    each common variant of the per-sequence estimators (:func:`~grpo_cli.metrics.adv_recompute.sequence_variants`)."""

    name = "adv_check"
    figures: tuple[Figure, ...] = (
        Figure("adv_check/max_abs_diff", "largest |recomputed − dumped| over compared tokens"),
        Figure("adv_check/mean_abs_diff", "mean |recomputed − dumped| over compared tokens"),
        Figure("adv_check/n_sequences", "sequences read"),
        Figure("adv_check/n_sequences_compared", "sequences with at least one compared token"),
        Figure("adv_check/n_sequences_mismatch", "sequences with a token beyond the tolerance"),
        Figure("adv_check/n_tokens_compared", "tokens compared (valid, or all per-token)"),
        Figure("adv_check/n_tokens_mismatch", "compared tokens beyond the tolerance"),
        Figure("adv_check/n_masked_tokens_compared", "compared tokens with loss_mask = 0"),
        Figure("adv_check/n_masked_tokens_mismatch", "mismatches at loss_mask = 0 (prompt tokens)"),
        Figure("adv_check/n_nonfinite", "compared tokens where either value is NaN/±inf"),
        Figure("adv_check/worst", "the sequences that disagree most (file, row, position, values)", reduce="table"),
    )

    def __init__(
        self, recompute: Recompute, variants: list[Variant], *, compare_all: bool, files: tuple[str, ...]
    ) -> None:
        self.recompute, self.compare_all, self.files = recompute, compare_all, files
        self.variant_options = [v.options for v in variants]
        self.variant_advantages = torch.stack([v.advantages.to(_F64) for v in variants]) if variants else None

    def columns(self) -> frozenset[str]:
        return frozenset(self.recompute.columns() | {"advantages"})

    def init_state(self, config: AdvantageCheckConfig, device: torch.device | str) -> MetricState:
        base = adv_diff_state(config.top_k, device)
        n = len(self.variant_options)
        specs = {**base.specs, "n_valid_tokens": count(), "variant_sequences": count((n,)),
                 "variant_tokens": count((n,)), "variant_max": maximum((n,))}
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AdvantageCheckConfig) -> None:
        idx = _index(self.recompute, batch, self.files)
        seqs = self.recompute.seqs
        expected = self.recompute.expected(batch, idx)
        dumped = batch.positions  # stash_advantages
        assert dumped is not None
        compare = torch.ones_like(batch.loss_mask) if self.compare_all else batch.loss_mask
        adv_diff_update(
            state,
            expected=expected,
            dumped=dumped,
            compare=compare,
            loss_mask=batch.loss_mask,
            cu_seqlens=batch.cu_seqlens,
            sequence_keys=batch.sequence_keys(),
            group_id=None if seqs.group_id is None else seqs.group_id[idx],
            step=None if seqs.batch_key is None else seqs.batch_key[idx],
            atol=config.atol,
            rtol=config.rtol,
        )
        state.update(n_valid_tokens=batch.loss_mask.sum())
        if self.variant_advantages is not None:
            self._update_variants(state, batch, idx, dumped, compare, config)

    def _update_variants(
        self,
        state: MetricState,
        batch: TokenBatch,
        idx: Tensor,
        dumped: Tensor,
        compare: Tensor,
        config: AdvantageCheckConfig,
    ) -> None:
        assert self.variant_advantages is not None
        seq = segment_ids(batch.cu_seqlens, batch.n_tokens)
        table = self.variant_advantages.to(dumped.device)
        expected = torch.where(batch.loss_mask, table[:, idx][:, seq], 0.0)  # [V, N], as ``Recompute.expected``
        diff, finite, bad = adv_mismatch(expected, dumped, compare, config.atol, config.rtol)
        n_variants = table.shape[0]
        bad_seq = torch.zeros((n_variants, batch.n_sequences), dtype=torch.int64, device=bad.device)
        bad_seq.index_add_(1, seq, bad.to(torch.int64))
        largest = torch.where(compare & finite, diff, -math.inf)
        state.update(
            variant_sequences=(bad_seq > 0).sum(dim=1),
            variant_tokens=bad.sum(dim=1),
            variant_max=largest.amax(dim=1) if batch.n_tokens else torch.full((n_variants,), -math.inf),
        )

    def compute(self, state: MetricState, config: Any) -> dict[str, Any]:
        out = adv_diff_compute(state)
        out["n_valid_tokens"] = int(state["n_valid_tokens"])
        out["variants"] = [
            {
                "options": options,
                "n_sequences_mismatch": int(state["variant_sequences"][i]),
                "n_tokens_mismatch": int(state["variant_tokens"][i]),
                "max_abs_diff": float(state["variant_max"][i]) if out["adv_check/n_tokens_compared"] else None,
            }
            for i, options in enumerate(self.variant_options)
        ]
        return out


ADV_CHECK_FIGURES: tuple[Figure, ...] = AdvCheckGroup.figures
"""The ``adv_check/*`` figures (the key registry lists them beside ``analyze``'s)."""
