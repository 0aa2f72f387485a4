"""What a sane log-probability is: finite and ≤ 0 (``log p`` with ``0 < p ≤ 1``), up to float rounding.

The validation layer (:mod:`grpo_cli.engine.validate`) enforces this at every valid token of every log-prob column;
``grpo-cli check`` gates on the counts it reports (``sanity/n_nonfinite_logp``, ``sanity/n_positive_logp``).
Both read these definitions, so they can never disagree.
"""

from __future__ import annotations

# Both are declared in the torch-free grpo_cli._constants (importing grpo_cli.core loads torch); re-exported here
# under their old names.
from grpo_cli._constants import LOGP_COLUMNS
from grpo_cli._constants import LOGP_TOLERANCE as POSITIVE_LOGP_TOLERANCE

__all__ = ["LOGP_COLUMNS", "POSITIVE_LOGP_TOLERANCE"]
