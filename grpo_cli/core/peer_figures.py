"""Figures exactly as the peers log them, as pure batch functions (one call = one logged step).

Each function reproduces one peer's definition, including its quirks, so that a figure shown under the peer's
name can be compared with the peer's own logs; ``docs/peers.md`` lists them and the conformance tier
(``tests/peers``) runs the peers' released code against them. Conventions: padded ``[B, T]`` inputs with a bool
(or 0/1) mask; elementwise math in the log-probs' dtype (float16 through float32), sums in float64, masked
positions neutralised with ``torch.where`` or left out (the peers multiply by the mask, which only differs where
the masked entries hold inf/NaN). The rollout-correction, TRL and AReaL staleness figures pack the valid tokens
and call the packed per-token and per-sequence functions the ``--names`` groups of :mod:`grpo_cli.metrics.peers`
call (verl's also the same reductions), so each formula is written once. Results are Python floats keyed by the
peer's logged key (without its prefix: ``rollout_corr/``, ``actor/``, ``ppo_actor/update/``, ...). The functions
live in one module per peer (:mod:`~grpo_cli.core.peer_verl`, :mod:`~grpo_cli.core.peer_verl_rollout`,
:mod:`~grpo_cli.core.peer_verl_rs`, :mod:`~grpo_cli.core.peer_trl`, :mod:`~grpo_cli.core.peer_areal`) and are
importable from here.

Sources (public repositories, at the pinned releases of :data:`~grpo_cli.core.conventions.PEER_RELEASES`):

- verl ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``, ``compute_policy_loss_cispo``,
  ``agg_loss``, ``kl_penalty``), ``verl/trainer/ppo/rollout_corr_helper.py``
  (``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_offpolicy_metrics``),
  ``verl/trainer/ppo/metric_utils.py`` (``compute_data_metrics``);
- TRL ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``, ``_generate_and_score_completions``);
- AReaL ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``, ``_log_proximal_approximation_stats``,
  ``_log_version_staleness_stats``) and ``areal/utils/stats_tracker.py`` (``avg``/``min``/``max`` reductions).
"""


from __future__ import annotations

from grpo_cli.core._peer_common import VERL_SAFETY_BOUND
from grpo_cli.core.peer_areal import areal_actor_stats, areal_kl_div_stats, areal_token_stats, areal_version_stats
from grpo_cli.core.peer_trl import trl_cispo_clip_ratio, trl_clip_ratio_metrics, trl_logged_kl, trl_sampling_metrics
from grpo_cli.core.peer_verl import verl_data_metrics, verl_kl_penalty, verl_policy_loss
from grpo_cli.core.peer_verl_rollout import verl_is_threshold, verl_offpolicy_metrics, verl_rollout_is
from grpo_cli.core.peer_verl_rs import VERL_RS_OPTIONS, verl_rollout_rs, verl_rs_options, verl_rs_thresholds

__all__ = [
    "VERL_RS_OPTIONS",
    "VERL_SAFETY_BOUND",
    "areal_actor_stats",
    "areal_kl_div_stats",
    "areal_token_stats",
    "areal_version_stats",
    "trl_cispo_clip_ratio",
    "trl_clip_ratio_metrics",
    "trl_logged_kl",
    "trl_sampling_metrics",
    "verl_data_metrics",
    "verl_is_threshold",
    "verl_kl_penalty",
    "verl_offpolicy_metrics",
    "verl_policy_loss",
    "verl_rollout_is",
    "verl_rollout_rs",
    "verl_rs_options",
    "verl_rs_thresholds",
]

