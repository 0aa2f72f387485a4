"""Advantage estimators: AReaL's normalisation and token-level GAE, and the GRPO-family peers.

Each function mirrors one framework function (AReaL's ``areal/utils/functional.py`` and
``areal/engine/ppo/actor.py``, verl's ``verl/trainer/ppo/core_algos.py``):

========================================  ==========================================================================
grpo-cli                                  mirrors
========================================  ==========================================================================
:class:`NormConfig`                       AReaL ``NormConfig`` (cli_args.py)
:func:`normalize`                         AReaL ``Normalization.__call__`` (data.py) — ``reward_norm`` / ``adv_norm``
:func:`gae_advantages`                    AReaL ``_compute_token_level_gae`` (gae.py; in ``_compute_advantages``)
:func:`compute_advantages`                AReaL ``PPOActor._compute_advantages`` (shaping, KL rewards, GAE, adv_norm)
:func:`grpo_advantages`                   verl ``compute_grpo_outcome_advantage`` (TRL/OpenRLHF/slime: other ε)
:func:`drgrpo_advantages`                 verl GRPO with ``norm_adv_by_std_in_grpo=False``; OpenRLHF ``dr_grpo``
:func:`rloo_advantages`                   verl ``compute_rloo_outcome_advantage``; OpenRLHF ``rloo``
:func:`reinforce_pp_advantages`           verl ``compute_reinforce_plus_plus_outcome_advantage``
:func:`masked_whiten`                     verl ``verl_F.masked_whiten``
:func:`token_weighted_grpo_advantages`    AReaL ``adv_norm`` group/group on outcome scores, per sequence
========================================  ==========================================================================

Layouts: per-token inputs are padded ``[B, T]`` (one sequence per row) or packed ``[N]`` with ``cu_seqlens``;
per-sequence estimators take rewards ``[B]`` and integer ``group_ids`` ``[B]`` (any values, groups need not be
contiguous). Statistics are accumulated in float64 with ``torch.unique`` + ``index_add_`` (no Python loop over
sequences; GAE and return-to-go loop over time steps, as every peer does). Results are float32 (AReaL's output
dtype), or float64 when an input is float64. Nothing here is differentiable by design (advantages are
constants).

Modules: ``normalization`` (AReaL's ``Normalization``), ``gae`` (token-level GAE and the AReaL pipeline),
``outcome`` (GRPO, Dr. GRPO, RLOO), ``returns`` (REINFORCE++ and ``masked_whiten``), ``layout`` (per-sequence
values onto tokens, next-token roll) and ``_common`` (group indices, segment sums); this package re-exports
them all.
"""

from __future__ import annotations

from grpo_cli._choices import ADVANTAGE_ESTIMATORS
from grpo_cli.core.advantages.gae import AdvantageConfig, compute_advantages, gae_advantages
from grpo_cli.core.advantages.layout import outcome_to_token_rewards, roll_to_next_token, sequence_to_tokens
from grpo_cli.core.advantages.normalization import Normalization, NormConfig, normalize
from grpo_cli.core.advantages.outcome import (
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
    token_weighted_grpo_advantages,
)
from grpo_cli.core.advantages.returns import REINFORCE_PP_CONVENTIONS, masked_whiten, reinforce_pp_advantages

__all__ = [
    "REINFORCE_PP_CONVENTIONS",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "NormConfig",
    "Normalization",
    "compute_advantages",
    "drgrpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "masked_whiten",
    "normalize",
    "outcome_to_token_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "roll_to_next_token",
    "sequence_to_tokens",
    "token_weighted_grpo_advantages",
]

