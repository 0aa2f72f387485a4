"""The dump counts and the GRPOMetric family's figures (``core.policy_stats``) as metric groups."""

from __future__ import annotations

from typing import Any

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.policy_stats import policy_stats_compute, policy_stats_state, policy_stats_update
from grpo_cli.core.state import MetricState, count
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig

__all__ = ["CountsGroup", "PolicyGroup"]


class CountsGroup(MetricGroup):
    """``n_sequences`` and ``n_tokens`` (all tokens, masked or not)."""

    name = "counts"

    def columns(self) -> frozenset[str]:
        return frozenset()

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        return {}

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return MetricState({"n_sequences": count(), "n_tokens": count()}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        state.update(n_sequences=torch.tensor(batch.n_sequences), n_tokens=torch.tensor(batch.n_tokens))

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        return {"n_sequences": int(state["n_sequences"]), "n_tokens": int(state["n_tokens"])}


_NEEDS_OLD = ("logp/old_mean", "logp/diff_mean", "kl/k3", "kl/k3_token_max", "top_kl")
_NEEDS_RATIO = ("ratio/max", "clip/cispo", "clip/cispo_low", "clip/cispo_high")
_NEEDS_ADV = ("clip/ratio", "clip/low", "clip/high", "clip/seq_ratio", "clip/seq_low", "clip/seq_high")


class PolicyGroup(MetricGroup):
    """The GRPOMetric family (``core.policy_stats``): log-prob means, k3 KL, ratio maximum, clip fractions.

    ``kl/*`` compares ``new_logp`` with ``old_logp``; ``ratio/*`` and ``clip/*`` use the PPO ratio against
    ``prox_logp`` when the dump has it (decoupled PPO), else against ``old_logp``.
    """

    name = "policy"

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "advantages", "entropy"})

    def omitted(self, columns: frozenset[str], config: AnalyzeConfig) -> dict[str, str]:
        out: dict[str, str] = {}
        if "entropy" not in columns:
            out["entropy/mean"] = "needs an 'entropy' column"
        if "old_logp" not in columns:
            out.update(dict.fromkeys(_NEEDS_OLD, "needs an 'old_logp' column"))
        if not {"old_logp", "prox_logp"} & columns:
            out.update(dict.fromkeys(_NEEDS_RATIO + _NEEDS_ADV, "needs 'old_logp' or 'prox_logp'"))
        elif "advantages" not in columns:
            out.update(dict.fromkeys(_NEEDS_ADV, "needs an 'advantages' column"))
        if config.top_k == 0:
            out.setdefault("top_kl", "disabled with --top-k 0")
        return out

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return policy_stats_state(config.top_k, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        policy_stats_update(
            state,
            new_logp=valid.new_logp,
            cu_seqlens=valid.cu_seqlens,
            old_logp=valid.old_logp,
            ratio_base_logp=valid.prox_logp if valid.prox_logp is not None else valid.old_logp,
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
