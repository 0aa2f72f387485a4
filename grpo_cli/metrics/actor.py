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
from grpo_cli.engine.figures import Figure, Requirement, column, columns, neg
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig
from grpo_cli.metrics.loss import valid_ppo_terms
from grpo_cli.metrics.policy import ADV, BASE

__all__ = ["ActorStatsGroup"]

_P = "ppo_actor/"  # AReaL: once per PPO update
_U = "ppo_actor/update/"  # AReaL: per micro-batch
_REWARDS = column("rewards")



class ActorStatsGroup(MetricGroup):
    """Prompt/sequence lengths, EOS, task-reward splits, mean log-ratio and the clipped-token log-probs.

    The clip mask is AReaL's ``ppo_actor_loss`` ``clip_mask`` with the ``loss/ppo`` options (``--epsilon``,
    ``--epsilon-high``, ``--c-clip``, ``--importance-level``, ``--rs-*``) on the dump's log-probs as stored (no
    ``--temperature`` rescaling, like ``loss/ppo``); ``ratio/log_mean`` is rescaled like the other ``ratio/*``.
    """

    name = "actor_stats"
    figures = (
        Figure("seq/no_eos_frac", "sequences cut off without EOS (eos column or --max-new-tokens)", reduce="fraction",
               needs=(Requirement("needs an 'eos' column or --max-new-tokens",
                                  lambda cols, config: "eos" in cols or config.max_new_tokens is not None),),
               peers={"areal": _P + "no_eos_ratios/avg", "verl": "response_length/clip_ratio",
                      "trl": "completions/clipped_ratio"}),
        Figure("reward/min", "smallest reward", needs=(_REWARDS,),
               peers={"areal": _P + "task_reward/min"}),
        Figure("reward/max", "largest reward", needs=(_REWARDS,),
               peers={"areal": _P + "task_reward/max"}),
        Figure("seq/n_correct", "sequences with reward > 0", needs=(_REWARDS,), peers={"areal": _P + "correct_n_seqs"}),
        Figure("seq/n_incorrect", "sequences with reward ≤ 0", needs=(_REWARDS,),
               peers={"areal": _P + "incorrect_n_seqs"}),
        *(Figure(f"seq/{which}_total_len_{stat}", meaning.format(which=which, cmp=cmp), needs=(_REWARDS,),
                 peers={"areal": f"{_P}{which}_seq_len/{theirs}"})
          for which, cmp in (("correct", ">"), ("incorrect", "≤"))
          for stat, theirs, meaning in (("mean", "avg", "mean length (all tokens) of sequences with reward {cmp} 0"),
                                        ("min", "min", "shortest sequence with reward {cmp} 0"),
                                        ("max", "max", "longest sequence with reward {cmp} 0"))),
        Figure("ratio/log_mean", "mean(new − base) = mean log r (AReaL approx_kl; verl ppo_kl = −this)", needs=(BASE,),
               peers={"verl": neg("actor/ppo_kl")}),
        Figure("logp/clipped_new_mean", "mean new over the tokens AReaL's PPO clip mask selects", needs=(BASE, ADV),
               peers={"areal": _U + "clipped_new_logp/avg"}),
        Figure("logp/clipped_old_mean", "mean old (behaviour) over the PPO-clipped tokens",
               needs=(columns("old_logp", "advantages"),), peers={"areal": _U + "clipped_old_logp/avg"}),
        *(Figure(f"seq/prompt_len_{stat}", meaning, peers={"areal": f"{_P}prompt_len/{theirs}",
                                                             "verl": f"prompt_length/{stat}"})
          for stat, theirs, meaning in (("mean", "avg", "mean index of the first loss-mask token (prompt length)"),
                                        ("min", "min", "shortest prompt"), ("max", "max", "longest prompt"))),
        *(Figure(f"seq/total_len_{stat}", meaning, peers={"areal": f"{_P}seq_len/{theirs}"})
          for stat, theirs, meaning in (("mean", "avg", "mean tokens per sequence, prompt included"),
                                        ("min", "min", "shortest sequence (all tokens)"),
                                        ("max", "max", "longest sequence (all tokens)"))),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"old_logp", "prox_logp", "advantages", "rewards", "eos"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return actor_stats_state(device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        no_eos = None
        if batch.eos is not None:
            no_eos = batch.eos == 0
        elif config.max_new_tokens is not None:  # AReaL's rule: a response that reached the limit had no EOS
            no_eos = lengths_from_cu_seqlens(valid.cu_seqlens) >= config.max_new_tokens
        base = valid.ratio_base_logp
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
