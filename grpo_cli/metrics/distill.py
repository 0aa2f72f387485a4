"""``analyze`` figures of AReaL's joint distillation (``teacher_logp`` column): ``kd/rkl_mean`` and ``loss/kd``.

The math is :func:`grpo_cli.core.distill.distill_loss_terms`; this group streams its float64 numerators and token
counts, so the figures are the token means over the whole dump (AReaL's engine-level normalisation,
``areal/engine/core/train_engine.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.distill import distill_loss_terms
from grpo_cli.core.state import MetricState, count, total
from grpo_cli.engine.figures import Figure, Requirement, column
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import AnalyzeConfig

__all__ = ["DistillGroup"]


class DistillGroup(MetricGroup):
    """``kd/rkl_mean`` = mean(new − teacher) and ``loss/kd`` (``--distill-weight`` w_d, ``--rl-weight`` w_rl).

    ``loss/kd`` is the term AReaL adds to the RL loss, ``w_d·mean(new − teacher)``; with ``--rl-weight 0`` it is
    AReaL's importance-sampled form ``−w_d·mean(exp(new − old)·(teacher − new))`` (which then replaces the RL loss,
    so it needs ``old_logp``). Log-probs are used as dumped (no ``--temperature`` rescaling).
    """

    name = "distill"
    figures = (
        Figure("kd/rkl_mean", "mean(new − teacher): single-sample estimate of KL(π_θ ‖ π_teacher)",
               needs=(column("teacher_logp"),), peers={"areal": "ppo_actor/update/rkl_loss/avg"}),
        Figure("loss/kd", "AReaL's distillation term: w_d·mean(new − teacher), or its IS form when w_rl = 0",
               needs=(column("teacher_logp"),
                      Requirement("--rl-weight 0 (importance-sampled reverse KL) needs an 'old_logp' column",
                                  lambda cols, config: config.rl_weight != 0 or "old_logp" in cols))),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"teacher_logp", "old_logp"})

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        return MetricState({"n": count(), "sum_rkl": total(), "sum_kd": total()}, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        if valid.teacher_logp is None:
            return
        # The importance-sampled form (--rl-weight 0) needs old_logp; without it only kd/rkl_mean is reported.
        loss_ok = config.rl_weight != 0 or valid.old_logp is not None
        num, n, stats = distill_loss_terms(
            valid.new_logp,
            valid.teacher_logp,
            valid.loss_mask,
            old_logprobs=valid.old_logp if config.rl_weight == 0 else None,
            rl_loss_weight=config.rl_weight if loss_ok else 1.0,
            distill_loss_weight=config.distill_weight,
        )
        state.update(n=n.to(torch.int64), sum_rkl=stats["rkl_sum"])
        if loss_ok:
            state.update(sum_kd=num.detach())

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        n = int(state["n"])
        if n == 0:
            return {}
        return {"kd/rkl_mean": float(state["sum_rkl"]) / n, "loss/kd": float(state["sum_kd"]) / n}
