"""Figures exactly as a peer framework logs them, reported only under that peer's ``--names``.

Where grpo-cli's own figure and a peer's logged figure differ in definition (verl's rollout-correction statistics
of the *truncated* weights and of its recomputed log-probs, TRL's bias-corrected ``kl``, AReaL's sequence-level
``clip_ratio``, ...), the peer's is declared here, once, with the peer's key in ``peers``; grpo-cli's own keys keep
their values and no longer map to that peer key. Each group is enabled only when ``AnalyzeConfig.names`` is its
peer, so the default report does not change.

Every state is a set of float64 sums, int64 counts and running min/max (TRL's per-micro-batch figures: a keyed
table of them, one row per (step, micro_batch)), so the figures do not depend on how the dump is cut into
batches. A peer logs per training step; these are over the whole dump (``--group-by step`` gives per-step
figures). The definitions are those of :mod:`grpo_cli.core.peer_figures` (the peers' functions, tested
against their released code in ``tests/peers``) computed on one batch holding the whole dump (or one step); the
groups call the same packed per-token and per-sequence core functions as those batch functions:

- verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
  ``compute_is_metrics``, ``compute_offpolicy_metrics``), ``verl/utils/debug/metrics.py``
  (``calculate_debug_metrics``: the Pearson figure), ``verl/trainer/ppo/metric_utils.py``
  (``compute_data_metrics``: ``critic/score/*``);
- TRL ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``, ``_generate_and_score_completions``);
- AReaL ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``, ``_log_proximal_approximation_stats``,
  ``_log_version_staleness_stats``) with ``areal/utils/stats_tracker.py`` (``avg``/``min``/``max``).

Peer figures read the log-probs as stored (no ``--temperature`` rescaling): the peers log them as computed.
One module per peer holds its group (:mod:`~grpo_cli.metrics.peers_verl`, :mod:`~grpo_cli.metrics.peers_trl`,
:mod:`~grpo_cli.metrics.peers_areal`); the groups are importable from here.
"""

from __future__ import annotations

from grpo_cli.engine.group import MetricGroup
from grpo_cli.metrics.peers_areal import ArealPeerGroup
from grpo_cli.metrics.peers_trl import TrlPeerGroup
from grpo_cli.metrics.peers_verl import VerlPeerGroup

__all__ = ["ArealPeerGroup", "TrlPeerGroup", "VerlPeerGroup", "peer_groups"]


def peer_groups() -> list[MetricGroup]:
    """The peer-exact groups, each a no-op unless ``--names`` is its peer."""
    return [VerlPeerGroup(), TrlPeerGroup(), ArealPeerGroup()]
