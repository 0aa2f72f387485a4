"""Streaming comparison of AReaL's proximal approximations with the recomputed truth (``compare-prox``).

A functional core in the ``*_state`` / ``*_update`` / ``*_compute`` pattern of :mod:`grpo_cli.core.policy_stats`:
:func:`prox_compare_update` folds one batch of whole sequences into a :class:`~grpo_cli.core.state.MetricState`
(int64 counts, float64 sums, maxima, fixed-edge histograms), and :func:`prox_compare_compute` turns the merged
state into figures. Every entry merges by sum/max/min, so the figures do not depend on how the dump was split
into batches, workers or ranks (the p99 is read from a histogram, within :data:`P99_REL_ERROR_BOUND`).

Per token, with ℓp* the recomputed truth, ℓp̂ an approximation (:func:`~grpo_cli.core.prox.
compute_prox_logp_approximations`), the per-token errors of :func:`~grpo_cli.core.prox.prox_approximation_errors`
(AReaL ``compute_logp/<method>/*``), and what the error does to the update, which AReaL does not report:

- *clip flip*: the PPO clip decision of :func:`~grpo_cli.core.ppo.ppo_actor_loss_terms` (``clip_mask`` and,
  with ``c_clip``, ``dual_clip_mask``) differs between ℓp̂ and ℓp*;
- *behaviour-weight flip*: the rejection-sampling outcome of :func:`~grpo_cli.core.rejection.
  apply_rejection_sampling` differs: the token is dropped with one and kept with the other (``action="mask"``),
  or its weight is truncated with one and not the other (``action="clamp"``);
- ``loss/ppo``: AReaL's decoupled PPO loss Σ L / N0 with ℓp̂ instead of ℓp*, streamed as an exact float64
  numerator and an int64 denominator.

Error figures are over *compared* tokens: ``loss_mask`` ∧ ``versions ≥ 0`` (valid generated tokens); the loss is
over the whole loss mask, as the trainer computes it. The staleness lag of a token is k = v_θ − v_b (AReaL's
``sample_staleness_theta``); α = (k − 1)/k for k ≥ 1.

Example:
    >>> import torch
    >>> state = prox_compare_state(("rollout",), max_lag=4)
    >>> prox_compare_update(state, new_logp=torch.tensor([-1.0, -1.0]), old_logp=torch.tensor([-2.0, -2.0]),
    ...                     prox_logp=torch.tensor([-1.5, -1.9]), versions=torch.tensor([3, 4]),
    ...                     current_version=5, cu_seqlens=torch.tensor([0, 2]))
    >>> out = prox_compare_compute(state, tolerance=0.2)
    >>> round(out["prox/rollout/abs_error_mean"], 6), out["prox/rollout/max_safe_lag"]  # (0.5 + 0.1) / 2; lag 1 ok
    (0.3, 1)

Modules: ``prepare`` (the method-independent work on a batch), ``state`` (the state and the fold),
``compute`` (the figures and the lag verdict) and ``_common``; this package re-exports them all.
"""

from __future__ import annotations

from grpo_cli.core.prox_compare._common import DEFAULT_MAX_LAG
from grpo_cli.core.prox_compare.compute import (
    DEFAULT_TOLERANCE,
    LOSS_FIGURES,
    P99_REL_ERROR_BOUND,
    PROX_COMPARE_FIGURES,
    REJECTION_FIGURES,
    max_safe_lag,
    prox_compare_compute,
)
from grpo_cli.core.prox_compare.prepare import ProxCompareBatch, prox_compare_prepare, rejection_changes
from grpo_cli.core.prox_compare.state import prox_compare_fold, prox_compare_state, prox_compare_update

__all__ = [
    "DEFAULT_MAX_LAG",
    "ProxCompareBatch",
    "DEFAULT_TOLERANCE",
    "LOSS_FIGURES",
    "P99_REL_ERROR_BOUND",
    "PROX_COMPARE_FIGURES",
    "REJECTION_FIGURES",
    "max_safe_lag",
    "prox_compare_compute",
    "prox_compare_fold",
    "prox_compare_prepare",
    "prox_compare_state",
    "prox_compare_update",
    "rejection_changes",
]
