"""The recomputation behind ``grpo-cli advantages``: the dump's per-sequence scalars (collected by a first streaming
pass, :class:`~grpo_cli.metrics.adv_check.AdvSequencesGroup`) turned into rewards, per-sequence advantages and the
per-batch token recomputation (``docs/advantages.md``).

Group statistics need whole groups, which streaming by row group may split, so reward shaping, ``reward_norm`` and
the per-sequence estimators (GRPO, Dr.GRPO, RLOO) run on the O(n_sequences) table at once; per-token estimators whose
result is normalised over a training batch (GAE with ``adv_norm``, REINFORCE++'s whitening) accumulate float64
batch/group statistics in token passes of their own (:class:`~grpo_cli.metrics.adv_check.AdvMomentsGroup`).

Training batches: batch-level statistics (AReaL ``batch`` levels, REINFORCE++ whitening) and groups are taken per
value of ``batch_by`` (default: the ``step`` column when the dump has one, else the whole dump is one batch); group
keys are ``(batch, group_id)``, so reused group ids in different steps never merge.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor

from grpo_cli.core.adv_check import StreamingNormalization, StreamingWhiten
from grpo_cli.core.advantages import (
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    normalize,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    roll_to_next_token,
    token_weighted_grpo_advantages,
)
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.packing import segment_ids
from grpo_cli.core.rewards import kl_regularized_rewards, reward_overlong_penalty, shape_rewards
from grpo_cli.io.align import unroll_next_token
from grpo_cli.metrics.adv_config import PER_SEQUENCE_ESTIMATORS, AdvantageCheckConfig

__all__ = ["Recompute", "Sequences", "Variant", "sequence_variants"]

_F64 = torch.float64


@dataclass
class Sequences:
    """One entry per sequence of the dump, in stream order (O(n_sequences))."""

    file_index: Tensor
    rows: Tensor
    rewards: Tensor
    response_len: Tensor
    group_id: Tensor | None
    batch_key: Tensor | None
    eos: Tensor | None
    batch_index: Tensor = field(init=False)
    group_index: Tensor | None = field(init=False)
    keys: Tensor = field(init=False)
    """``[S]`` int64 ``file·2³² + row``, ascending: where a streamed sequence sits in this table."""

    def __post_init__(self) -> None:
        n = self.rewards.numel()
        device = self.rewards.device
        self.keys = self.file_index * (1 << 32) + self.rows
        if self.batch_key is None:
            self.batch_index = torch.zeros(n, dtype=torch.int64, device=device)
        else:
            self.batch_index = torch.unique(self.batch_key, return_inverse=True)[1].to(torch.int64)
        if self.group_id is None:
            self.group_index = None
        else:
            pairs = torch.stack([self.batch_index, self.group_id], dim=1)
            self.group_index = torch.unique(pairs, dim=0, return_inverse=True)[1].to(torch.int64)

    @property
    def n(self) -> int:
        return self.rewards.numel()

    def index_of(self, batch: TokenBatch) -> Tensor | None:
        """``[B]`` positions of the batch's sequences in this table, or None when one is not in it."""
        keys = batch.sequence_keys().to(self.keys.device)
        wanted = keys[:, 0] * (1 << 32) + keys[:, 1]
        idx = torch.searchsorted(self.keys, wanted)
        if idx.numel() and (bool((idx >= self.n).any()) or not torch.equal(self.keys[idx], wanted)):
            return None
        return idx


def _segments_in_order(index: Tensor) -> Iterator[Tensor]:
    """The positions of each value of ``index`` (ascending values), each in stream order."""
    if index.numel() == 0:
        return
    order = torch.sort(index, stable=True).indices
    sizes = torch.bincount(index).tolist()
    start = 0
    for size in sizes:
        if size:
            yield order[start : start + size]
        start += size


def _scores(seqs: Sequences, cfg: AdvantageCheckConfig) -> Tensor:
    """AReaL's order: overlong penalty → bias/scaling/clip → ``reward_norm`` per training batch (float64)."""
    scores = seqs.rewards
    if cfg.overlong_tokens is not None:
        scores = reward_overlong_penalty(
            scores,
            seqs.response_len,
            overlong_tokens=cfg.overlong_tokens,
            overlong_penalty_factor=float(cast(float, cfg.overlong_penalty_factor)),  # set with overlong_tokens
            max_response_length=cfg.max_new_tokens or 1024,
        )
    scores = shape_rewards(
        scores, reward_bias=cfg.reward_bias, reward_scaling=cfg.reward_scaling, reward_clip=cfg.reward_clip
    )
    if cfg.reward_norm is not None:
        out = torch.empty_like(scores)
        for idx in _segments_in_order(seqs.batch_index):  # AReaL normalises each training batch on its own
            ids = None if seqs.group_id is None else seqs.group_id[idx]
            out[idx] = normalize(scores[idx], None, cfg.reward_norm, group_ids=ids)
        scores = out
    return scores


def _no_eos(seqs: Sequences, cfg: AdvantageCheckConfig) -> Tensor:
    """Per sequence "cut off without EOS": the ``eos`` column, else ``response length ≥ --max-new-tokens``."""
    if seqs.eos is not None:
        return seqs.eos == 0
    if cfg.max_new_tokens is not None:
        return seqs.response_len >= cfg.max_new_tokens
    return torch.zeros(seqs.n, dtype=torch.bool, device=seqs.rewards.device)


# ----------------------------------------------------------------------------------------------------
# per-token recomputation
# ----------------------------------------------------------------------------------------------------


class Recompute:
    """Per-batch recomputation of the advantages, in token alignment, from the per-sequence table."""

    def __init__(self, seqs: Sequences, cfg: AdvantageCheckConfig) -> None:
        self.seqs, self.cfg = seqs, cfg
        self.scores = _scores(seqs, cfg)
        self.no_eos = _no_eos(seqs, cfg)
        self.per_sequence: Tensor | None = None
        self.norm: StreamingNormalization | StreamingWhiten | None = None
        est = cfg.estimator
        if est in PER_SEQUENCE_ESTIMATORS:
            assert seqs.group_index is not None
            if est == "grpo":
                self.per_sequence = grpo_advantages(
                    self.scores, seqs.group_index, eps=float(cast(float, cfg.eps)), std_unbiased=cfg.std_unbiased
                )
            elif est == "drgrpo":
                self.per_sequence = drgrpo_advantages(self.scores, seqs.group_index)
            else:
                self.per_sequence = rloo_advantages(
                    self.scores, seqs.group_index, singleton=cast(Literal["keep", "zero"], cfg.rloo_singleton)
                )
        elif est == "gae" and cfg.adv_norm is not None:
            self.norm = StreamingNormalization(cfg.adv_norm, seqs.batch_index, seqs.group_index)
        elif est == "reinforce_pp":
            self.norm = StreamingWhiten(seqs.batch_index, eps=float(cast(float, cfg.eps)))

    def columns(self) -> set[str]:
        """Token columns the recomputation reads (besides the per-sequence ones already collected)."""
        if self.cfg.estimator == "gae" and self.cfg.kl_ctl != 0:
            return {"loss_mask", "old_logp", "ref_logp"}
        return {"loss_mask"}

    def raw(self, batch: TokenBatch, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(un-normalised token advantages, their mask) in the estimator's own alignment."""
        cfg, cu = self.cfg, batch.cu_seqlens
        mask = batch.loss_mask
        if cfg.estimator == "reinforce_pp":
            token_rewards = outcome_to_token_rewards(self.scores[idx], mask, cu_seqlens=cu)
            _, returns = reinforce_pp_advantages(token_rewards, mask, gamma=cfg.discount, cu_seqlens=cu)
            return returns.to(_F64), mask
        old, ref = batch.old_logp, batch.ref_logp
        if cfg.alignment == "token":  # AReaL works on next-token-aligned tensors; the dump is token-aligned
            mask = roll_to_next_token(mask, cu_seqlens=cu)
            old = None if old is None else roll_to_next_token(old, cu_seqlens=cu)
            ref = None if ref is None else roll_to_next_token(ref, cu_seqlens=cu)
        no_eos = self.no_eos[idx]
        tot_rewards, _ = kl_regularized_rewards(
            self.scores[idx],
            old,
            ref,
            mask,
            kl_ctl=cfg.kl_ctl,
            kl_estimator=cfg.kl_estimator,
            cu_seqlens=cu,
            no_eos=no_eos,
            mask_no_eos_with_zero=cfg.mask_no_eos_with_zero,
        )
        adv, _ = gae_advantages(
            tot_rewards.to(_F64), None, mask, discount=cfg.discount, gae_lambda=cfg.gae_lambda, no_eos=no_eos,
            cu_seqlens=cu,
        )
        return adv, mask

    def update_first(self, batch: TokenBatch, idx: Tensor) -> None:
        if self.norm is None or not _needs_first(self.norm):
            return
        values, mask = self.raw(batch, idx)
        self.norm.update_mean(values, mask, idx, batch.cu_seqlens)

    def update_second(self, batch: TokenBatch, idx: Tensor) -> None:
        if self.norm is None or not _needs_second(self.norm):
            return
        values, mask = self.raw(batch, idx)
        if isinstance(self.norm, StreamingWhiten):
            self.norm.update_var(values, mask, idx, batch.cu_seqlens)
        else:
            self.norm.update_std(values, mask, idx, batch.cu_seqlens)

    def passes(self) -> int:
        """Token passes before the final one (0, 1 or 2)."""
        if self.norm is None:
            return 0
        return int(_needs_first(self.norm)) + int(_needs_second(self.norm))

    def phases(self) -> list[int]:
        """The token passes the normalisation needs before the final one: 1 (means), 2 (stds) or both."""
        if self.norm is None:
            return []
        return [p for p, needed in ((1, _needs_first(self.norm)), (2, _needs_second(self.norm))) if needed]

    def update(self, phase: int, batch: TokenBatch, idx: Tensor) -> None:
        """Fold one batch into the moments of token pass ``phase``."""
        (self.update_first if phase == 1 else self.update_second)(batch, idx)

    def moments(self, phase: int) -> tuple[Any, tuple[str, ...]]:
        """(the float64 segment moments token pass ``phase`` folds into, the tensors it writes there).

        The streaming states of :mod:`grpo_cli.core.adv_check` keep them as attributes ``count``/``sum``/``sum_sq``;
        the metric group points those at its mergeable state while a pass runs and at the merged totals after it.
        """
        norm = self.norm
        if isinstance(norm, StreamingWhiten):
            return norm._moments, (("count", "sum") if phase == 1 else ("sum_sq",))
        assert norm is not None
        if phase == 1:
            return norm._mean, ("count", "sum")
        return norm._std, ("count", "sum_sq")

    def expected(self, batch: TokenBatch, idx: Tensor) -> Tensor:
        """``[N]`` float64 recomputed advantages of the batch, token-aligned like the dump's columns."""
        cu = batch.cu_seqlens
        if self.per_sequence is not None:  # verl: scores.unsqueeze(-1) * response_mask
            seq = segment_ids(cu, batch.n_tokens)
            return torch.where(batch.loss_mask, self.per_sequence[idx].to(_F64)[seq], 0.0)
        values, mask = self.raw(batch, idx)
        if self.norm is not None:
            values = self.norm.apply(values, mask, idx, cu)
        if self.cfg.estimator == "gae" and self.cfg.alignment == "token":
            values = unroll_next_token(values, cu, 0.0)
        return values


def _needs_first(norm: StreamingNormalization | StreamingWhiten) -> bool:
    return norm.needs_mean_pass if isinstance(norm, StreamingNormalization) else True


def _needs_second(norm: StreamingNormalization | StreamingWhiten) -> bool:
    return norm.needs_std_pass if isinstance(norm, StreamingNormalization) else True



# ----------------------------------------------------------------------------------------------------
# the variant search (per-sequence estimators)
# ----------------------------------------------------------------------------------------------------

_EPS_VARIANTS = (("1e-6", 1e-6), ("1e-5", 1e-5), ("1e-4", 1e-4), ("1e-8", 1e-8))
"""The std ε trainers use: 1e-6 (verl ``compute_grpo_outcome_advantage``, ``epsilon=1e-6``), 1e-5 (AReaL
``Normalization``'s default ``eps``), 1e-4 (TRL ``GRPOTrainer``: ``std + 1e-4``), 1e-8 (verl ``masked_whiten``)."""


@dataclass(frozen=True)
class Variant:
    """One common variant of the per-sequence estimators: the options that select it and its advantages."""

    options: str
    """The ``grpo-cli advantages`` options, e.g. ``--estimator grpo --std-eps 1e-4``."""
    settings: dict[str, object]
    advantages: Tensor = field(repr=False)


def sequence_variants(seqs: Sequences, scores: Tensor, cfg: AdvantageCheckConfig) -> list[Variant]:
    """Every common per-sequence variant except the configured one, from the same shaped scores.

    GRPO with each ε of :data:`_EPS_VARIANTS` and an unbiased (``torch.std``, verl) or biased (``/N``) std; the
    per-token group statistics of AReaL's GRPO recipe
    (:func:`~grpo_cli.core.advantages.token_weighted_grpo_advantages`); Dr.GRPO
    (no std, verl ``compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)``); RLOO's leave-one-out baseline
    (verl ``compute_rloo_outcome_advantage``) with a one-sequence group kept or zeroed.
    """
    if cfg.estimator not in PER_SEQUENCE_ESTIMATORS or seqs.group_index is None:
        return []
    group = seqs.group_index
    out: list[Variant] = []
    for biased in (False, True):
        for text, eps in _EPS_VARIANTS:
            if cfg.estimator == "grpo" and eps == cfg.eps and biased == (not cfg.std_unbiased):
                continue
            options = f"--estimator grpo --std-eps {text}" + (" --std-biased" if biased else "")
            adv = grpo_advantages(scores, group, eps=eps, std_unbiased=not biased)
            out.append(Variant(options, {"estimator": "grpo", "std_eps": eps, "std_unbiased": not biased}, adv))
    tokens = token_weighted_grpo_advantages(scores, group, seqs.response_len)
    out.append(Variant("--estimator gae --adv-norm group", {"estimator": "gae", "adv_norm": "group"}, tokens))
    if cfg.estimator != "drgrpo":
        out.append(Variant("--estimator drgrpo", {"estimator": "drgrpo"}, drgrpo_advantages(scores, group)))
    for singleton in ("keep", "zero"):
        if cfg.estimator == "rloo" and cfg.rloo_singleton == singleton:
            continue
        options = "--estimator rloo" + ("" if singleton == "keep" else " --rloo-singleton zero")
        adv = rloo_advantages(scores, group, singleton=singleton)
        out.append(Variant(options, {"estimator": "rloo", "rloo_singleton": singleton}, adv))
    return out
