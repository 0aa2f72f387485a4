"""``loss/*`` in ``analyze``: the GRPO-family losses and AReaL's PPO actor loss over a whole dump, streamed.

Every loss is a ratio of two sums over whole sequences (``core.grpo_family_valid_terms``,
``core.ppo_actor_loss_terms``), so the figure for the dump is Σ numerator / Σ denominator over batches: exactly the
value one call over all sequences in memory would return. The PPO ratio's base is ``prox_logp`` when the dump has
it (decoupled PPO), else ``old_logp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.grpo_family import grpo_family_valid_terms
from grpo_cli.core.ppo import ppo_actor_loss_terms
from grpo_cli.core.state import MetricState, count, total
from grpo_cli.engine.figures import Figure, Requirement
from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.config import LOSS_NAMES, AnalyzeConfig

__all__ = ["LOSS_NAMES", "LossGroup", "valid_ppo_terms"]


_NEEDS = Requirement("needs 'advantages' and a ratio base ('prox_logp' or 'old_logp')",
                     lambda cols, _: "advantages" in cols and bool({"old_logp", "prox_logp"} & cols))
_LOSS_MEANINGS = {
    "grpo": "GRPOLoss: per-sequence token mean of −min(rA, clip(r)A) (+β·k3), then batch mean",
    "gspo": "GSPOLoss: as GRPO with the sequence geometric-mean ratio",
    "sapo": "SAPOLoss: soft sigmoid gate instead of the hard clip (τ₊, τ₋)",
    "cispo": "CISPOLoss: −sg(min(r, 1 + ε_high))·A·log π over the token count",
    "bnpo": "BNPOLoss: token mean of the clipped surrogate over the whole dump",
    "dr_grpo": "DRGRPOLoss: token sum / (sequences · max_completion_length)",
    "ppo": "AReaL ppo_actor_loss (decoupled with prox_logp; dual clip, rejection sampling)",
}
_LOSS_PEERS = {"ppo": {"verl": "actor/pg_loss"}}


def _selected(name: str) -> Callable[[AnalyzeConfig], bool]:
    return lambda config: config.losses is None or name in config.losses


def valid_ppo_terms(valid: TokenBatch, config: AnalyzeConfig) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """AReaL's PPO actor-loss terms (:func:`~grpo_cli.core.ppo.ppo_actor_loss_terms`) of a batch of valid tokens,
    with the ratio based on ``prox_logp`` when present (else ``old_logp``); computed once per batch
    (:meth:`~grpo_cli.core.batch.TokenBatch.memoised`) for every group that needs them (``loss/ppo``, ``clip/dual``,
    the ``actor_stats`` clipped-token means). The batch must have ``advantages`` and a ratio base."""

    def compute() -> tuple[Tensor, Tensor, dict[str, Any]]:
        base = valid.ratio_base_logp
        assert base is not None and valid.advantages is not None
        return ppo_actor_loss_terms(
            valid.new_logp,
            base,
            valid.old_logp if valid.old_logp is not None else base,
            valid.advantages,
            config.epsilon,
            torch.ones_like(valid.new_logp, dtype=torch.bool),
            eps_clip_higher=config.epsilon_high,
            c_clip=config.c_clip,
            rejection_sampling=config.rejection_sampling(),
            importance_sampling_level=config.importance_level,
            cu_seqlens=valid.cu_seqlens,
        )

    return valid.memoised("ppo_terms", compute)


class LossGroup(MetricGroup):
    """``loss/<name>`` for every selected loss and ``clip/dual`` (with ``--c-clip``)."""

    name = "loss"
    figures = (
        *(Figure(f"loss/{name}", _LOSS_MEANINGS[name], reduce="ratio of sums", needs=(_NEEDS,),
                 enabled=_selected(name), peers=_LOSS_PEERS.get(name, {}))
          for name in LOSS_NAMES),
        Figure("clip/dual", "AReaL dual clip (--c-clip): A < 0 and r > c_clip, loss capped at c_clip·|A|",
               reduce="fraction", needs=(_NEEDS,), enabled=lambda config: config.c_clip is not None,
               peers={"verl": "actor/pg_clipfrac_lower"}),
    )

    def columns(self) -> frozenset[str]:
        return frozenset({"new_logp", "old_logp", "prox_logp", "ref_logp", "advantages"})

    def _selected(self, config: AnalyzeConfig) -> tuple[str, ...]:
        return LOSS_NAMES if config.losses is None else tuple(config.losses)

    def init_state(self, config: AnalyzeConfig, device: torch.device | str) -> MetricState:
        specs = {}
        for name in self._selected(config):
            specs[f"{name}_num"] = total()
            specs[f"{name}_den"] = total()
        specs["n_dual"] = count()
        specs["n_tokens"] = count()
        return MetricState(specs, device)

    def update(self, state: MetricState, batch: TokenBatch, valid: TokenBatch, config: AnalyzeConfig) -> None:
        base = valid.ratio_base_logp
        if base is None or valid.advantages is None:
            return
        # The GRPO-family variants share their log-ratio, ratio and clipped surrogate (one pass for all of them).
        family = [name for name in self._selected(config) if name != "ppo"]
        terms = grpo_family_valid_terms(
            family,
            valid.new_logp,
            base,
            valid.ref_logp,
            valid.advantages,
            valid.cu_seqlens,
            clip_low=config.epsilon,
            clip_high=config.epsilon_high,
            beta=config.beta,
            tau_pos=config.tau_pos,
            tau_neg=config.tau_neg,
            max_completion_length=config.max_completion_length,
        )
        for name in self._selected(config):
            if name == "ppo":
                num, den, stats = valid_ppo_terms(valid, config)
                state.update(n_dual=stats["dual_clip_mask"].sum(), n_tokens=torch.tensor(valid.n_tokens))
            else:
                num, den = terms[name]
            state.update(**{f"{name}_num": num.detach(), f"{name}_den": den})

    def compute(self, state: MetricState, config: AnalyzeConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._selected(config):
            den = float(state[f"{name}_den"])
            if name == "ppo":
                den = max(den, 1.0)  # AReaL divides by max(N0, 1)
            if den > 0:
                out[f"loss/{name}"] = float(state[f"{name}_num"]) / den
        if config.c_clip is not None and int(state["n_tokens"]) > 0:
            out["clip/dual"] = int(state["n_dual"]) / int(state["n_tokens"])
        return out
