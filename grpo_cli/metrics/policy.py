"""The dump counts and the GRPOMetric family's figures (``core.policy_stats``) as metric groups."""

from __future__ import annotations

from typing import Any

import torch

from grpo_cli._constants import TWINKLE_NAMES
from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.policy_stats import policy_stats_compute, policy_stats_state, policy_stats_update
from grpo_cli.core.state import MetricState, count
from grpo_cli.engine.figures import Figure, any_column, column, neg, option
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig

__all__ = ["ADV", "BASE", "OLD", "CountsGroup", "PolicyGroup"]

OLD = column("old_logp")
BASE = any_column("old_logp", "prox_logp")
"""The PPO ratio's base: ``prox_logp`` when the dump has it (decoupled PPO), else ``old_logp``."""
ADV = column("advantages")
_U = "ppo_actor/update/"  # AReaL: per-micro-batch actor statistics


class CountsGroup(MetricGroup):
    """``n_sequences`` and ``n_tokens`` (all tokens, masked or not)."""

    name = "counts"
    figures = (
        Figure("n_sequences", "sequences (rows) read", section="dump", peers={"areal": "ppo_actor/n_seqs"}),
        Figure("n_tokens", "tokens read, masked or not", section="dump", peers={"areal": _U + "n_tokens"}),
    )

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return MetricState({"n_sequences": count(), "n_tokens": count()}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        state.update(n_sequences=torch.tensor(batch.n_sequences), n_tokens=torch.tensor(batch.n_tokens))

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return {"n_sequences": int(state["n_sequences"]), "n_tokens": int(state["n_tokens"])}


class PolicyGroup(MetricGroup):
    """The GRPOMetric family (``core.policy_stats``): log-prob means, k3 KL, ratio maximum, clip fractions.

    ``kl/*`` compares ``new_logp`` with ``old_logp``; ``ratio/*`` and ``clip/*`` use the PPO ratio against
    ``prox_logp`` when the dump has it (decoupled PPO), else against ``old_logp``.
    """

    name = "policy"
    figures = (
        Figure("n_valid_tokens", "tokens with loss_mask = 1 (every other figure is over these)", section="dump",
               peers={"areal": _U + "n_valid_tokens"}),
        Figure("logp/new_mean", "mean log π_θ", peers={"twinkle": TWINKLE_NAMES["logp/new_mean"]}),
        Figure("policy_confidence", "exp(mean log π_θ): geometric-mean token probability", section="logp",
               peers={"twinkle": TWINKLE_NAMES["policy_confidence"]}),
        Figure("entropy/mean", "mean token entropy of π_θ", section="logp", needs=(column("entropy"),),
               peers={"verl": "actor/entropy", "twinkle": TWINKLE_NAMES["entropy/mean"]}),
        Figure("logp/old_mean", "mean behaviour log-prob", needs=(OLD,),
               peers={"twinkle": TWINKLE_NAMES["logp/old_mean"]}),
        Figure("logp/diff_mean", "mean (new − old); > 0: trainer likes the samples more than the sampler did",
               needs=(OLD,), peers={"areal": neg(_U + "logp_diff/avg"), "twinkle": TWINKLE_NAMES["logp/diff_mean"]}),
        Figure("kl/k3", "mean(e^d − 1 − d), d = new − old: k3 estimate of KL(old ‖ new)", needs=(OLD,),
               peers={"twinkle": TWINKLE_NAMES["kl/k3"]}),
        Figure("kl/k3_token_max", "largest per-token k3", needs=(OLD,),
               peers={"twinkle": TWINKLE_NAMES["kl/k3_token_max"]}),
        Figure("top_kl", "the highest-k3 tokens (file, row, position), with the ratio against old and against the "
               "ratio base", section="kl", reduce="table",
               needs=(OLD, option(lambda c: c.top_k > 0, "disabled with --top-k 0"))),
        Figure("top_ratio", "the highest-ratio tokens (file, row, position); ratio base: prox_logp if present, "
               "else old_logp (config ratio_base); the first is ratio/max's", section="ratio", reduce="table",
               needs=(BASE, option(lambda c: c.top_k > 0, "disabled with --top-k 0"))),
        Figure("ratio/max", "largest per-token ratio π_θ/π_base (base: prox_logp if present, else old_logp; "
               "top_ratio locates it)", needs=(BASE,), peers={"twinkle": TWINKLE_NAMES["ratio/max"]}),
        Figure("clip/cispo", "CISPO: r outside [1 − ε, 1 + ε_high], regardless of A (r against the ratio base)",
               reduce="fraction", needs=(BASE,)),
        Figure("clip/cispo_low", "CISPO: r < 1 − ε", reduce="fraction", needs=(BASE,)),
        Figure("clip/cispo_high", "CISPO: r > 1 + ε_high", reduce="fraction", needs=(BASE,)),
        Figure("clip/ratio", "tokens clipped by PPO: clip/low + clip/high (r against the ratio base: prox or old)",
               needs=(BASE, ADV), peers={"verl": "actor/pg_clipfrac", "twinkle": TWINKLE_NAMES["clip/ratio"]}),
        Figure("clip/low", "r < 1 − ε with A < 0", reduce="fraction", needs=(BASE, ADV),
               peers={"twinkle": TWINKLE_NAMES["clip/low"]}),
        Figure("clip/high", "r > 1 + ε_high with A > 0", reduce="fraction", needs=(BASE, ADV),
               peers={"twinkle": TWINKLE_NAMES["clip/high"]}),
        Figure("clip/seq_ratio", "GSPO: sequences whose geometric-mean ratio is clipped", reduce="fraction",
               needs=(BASE, ADV)),
        Figure("clip/seq_low", "GSPO: s < 1 − ε with mean A < 0", reduce="fraction", needs=(BASE, ADV)),
        Figure("clip/seq_high", "GSPO: s > 1 + ε_high with mean A > 0", reduce="fraction", needs=(BASE, ADV)),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "advantages", "entropy"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return policy_stats_state(config.top_k, device, top_ratio=True)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        policy_stats_update(
            state,
            new_logp=valid.new_logp,
            cu_seqlens=valid.cu_seqlens,
            old_logp=valid.old_logp,
            ratio_base_logp=valid.ratio_base_logp,
            advantages=valid.advantages,
            entropy=valid.entropy,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            temperature=config.temperature,
            sequence_keys=valid.sequence_keys(),
            positions=valid.positions,
        )

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return policy_stats_compute(state)
