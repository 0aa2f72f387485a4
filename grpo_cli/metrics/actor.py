"""``analyze``: the AReaL actor statistics still missing from the other groups (:mod:`grpo_cli.core.actor_stats`).

Keys (``docs/metrics.md``, "AReaL actor statistics"): ``seq/prompt_len_*``, ``seq/total_len_*``,
``seq/no_eos_frac``, ``reward/min``, ``reward/max``, ``seq/n_correct``, ``seq/n_incorrect``,
``seq/{correct,incorrect}_total_len_*``, ``ratio/log_mean``, ``logp/clipped_new_mean``, ``logp/clipped_old_mean``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.actor_stats import actor_stats_compute, actor_stats_state, actor_stats_update
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.offpolicy import working_logp
from grpo_cli.core.packing import lengths_from_cu_seqlens
from grpo_cli.core.state import MetricState
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.loss import valid_ppo_terms

__all__ = ["ActorStatsGroup"]

_REWARD_KEYS = ("reward/min", "reward/max", "seq/n_correct", "seq/n_incorrect",
                *(f"seq/{w}_total_len_{s}" for w in ("correct", "incorrect") for s in ("mean", "min", "max")))


class ActorStatsGroup(MetricGroup):
    """Prompt/sequence lengths, EOS, task-reward splits, mean log-ratio and the clipped-token log-probs.

    The clip mask is AReaL's ``ppo_actor_loss`` ``clip_mask`` with the ``loss/ppo`` options (``--epsilon``,
    ``--epsilon-high``, ``--c-clip``, ``--importance-level``, ``--rs-*``) on the dump's log-probs as stored (no
    ``--temperature`` rescaling, like ``loss/ppo``); ``ratio/log_mean`` is rescaled like the other ``ratio/*``.
    """

    name = "actor_stats"

    def columns(self) -> frozenset[str]:
        return frozenset({"old_logp", "prox_logp", "advantages", "rewards", "eos"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "eos" not in columns and config.max_new_tokens is None:
            out["seq/no_eos_frac"] = "needs an 'eos' column or --max-new-tokens"
        if "rewards" not in columns:
            out.update(dict.fromkeys(_REWARD_KEYS, "needs a 'rewards' column"))
        if not {"old_logp", "prox_logp"} & columns:
            out["ratio/log_mean"] = "needs 'old_logp' or 'prox_logp'"
            out["logp/clipped_new_mean"] = "needs 'old_logp' or 'prox_logp'"
        elif "advantages" not in columns:
            out["logp/clipped_new_mean"] = "needs an 'advantages' column"
        if "old_logp" not in columns or "advantages" not in columns:
            out["logp/clipped_old_mean"] = "needs 'old_logp' and 'advantages' columns"
        return out

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return actor_stats_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        no_eos = None
        if batch.eos is not None:
            no_eos = batch.eos == 0
        elif config.max_new_tokens is not None:  # AReaL's rule: a response that reached the limit had no EOS
            no_eos = lengths_from_cu_seqlens(valid.cu_seqlens) >= config.max_new_tokens
        base = valid.prox_logp if valid.prox_logp is not None else valid.old_logp
        log_ratio = clip_mask = None
        if base is not None:
            log_ratio = working_logp(valid.new_logp, config.temperature) - working_logp(base, config.temperature)
            if valid.advantages is not None and valid.n_tokens:
                _, _, stats = valid_ppo_terms(valid, config)  # shared with loss/ppo (computed once per batch)
                clip_mask = stats["clip_mask"]
        actor_stats_update(
            state,
            cu_seqlens=batch.cu_seqlens,
            loss_mask=batch.loss_mask,
            rewards=batch.rewards,
            no_eos=no_eos,
            log_ratio=log_ratio,
            clip_mask=clip_mask,
            new_logp=valid.new_logp,
            old_logp=valid.old_logp,
            prompt_lengths=_first_valid_positions(batch, valid),
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return actor_stats_compute(state)


def _first_valid_positions(batch: TokenBatch, valid: TokenBatch) -> Tensor | None:
    """Each sequence's first loss-mask position (its whole length when it has none), read off the valid view's
    ``positions`` in O(sequences) instead of scanning every token's mask."""
    if valid.positions is None or valid.n_sequences != batch.n_sequences:
        return None
    valid_lengths = lengths_from_cu_seqlens(valid.cu_seqlens)
    whole_lengths = lengths_from_cu_seqlens(batch.cu_seqlens).to(valid_lengths.device)
    if valid.n_tokens == 0:
        return whole_lengths
    starts = valid.cu_seqlens[:-1].clamp(max=valid.n_tokens - 1)
    return torch.where(valid_lengths > 0, valid.positions.index_select(0, starts), whole_lengths)
