"""What a sane log-probability is: finite and ≤ 0 (``log p`` with ``0 < p ≤ 1``), up to float rounding.

The validation layer (:mod:`grpo_cli.engine.validate`) enforces this at every valid token of every log-prob column;
``grpo-cli check`` gates on the counts it reports (``sanity/n_nonfinite_logp``, ``sanity/n_positive_logp``).
Both read these definitions, so they can never disagree.
"""

from __future__ import annotations

__all__ = ["LOGP_COLUMNS", "POSITIVE_LOGP_TOLERANCE"]

LOGP_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp")
"""The log-probability columns of schema v1, in the order used to report the first offender at a token."""

POSITIVE_LOGP_TOLERANCE = 1e-4
"""A log-prob counts as positive only above this: float32 ``log_softmax`` of a near-certain token can round to a
tiny positive value (about eps·|logsumexp| ≈ 4e-6 for logits near 30), which is not a bug; a real sign error (a
negative log-likelihood, a logit) is far larger."""
