"""Constants that torch-free modules and the torch layers share, declared once and without torch.

``grpo_cli.core`` imports torch when it is imported, so a constant the CLI, ``check`` or ``convert --from jsonl``
must read before (or without) loading torch lives here, and the torch layers import it from here: the log-prob
tolerance of the value checks, twinkle's names of the GRPOMetric figures, the headline figures of the terminal
and of the HTML report, and the defaults of the options that ``analyze`` and its config share.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_DISTILL_WEIGHT",
    "DEFAULT_EPSILON",
    "DEFAULT_IS_THRESHOLD",
    "DEFAULT_MAX_COMPLETION_LENGTH",
    "DEFAULT_RL_WEIGHT",
    "DEFAULT_TAU_POS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "DEFAULT_VLLM_IS_CLIP_MAX",
    "DEFAULT_VLLM_IS_MODE",
    "HEADLINE_KEYS",
    "LOGP_COLUMNS",
    "LOGP_TOLERANCE",
    "REPORT_HEADLINE_KEYS",
    "TWINKLE_NAMES",
]

# -- what a sane log-prob is --------------------------------------------------------------------------------------
LOGP_COLUMNS = ("new_logp", "old_logp", "prox_logp", "ref_logp")
"""The log-probability columns of schema v1, in the order used to report the first offender at a token."""

LOGP_TOLERANCE = 1e-4
"""A valid token's log-prob counts as positive only above this (and an entropy as negative only below its
negative): float32 ``log_softmax`` of a near-certain token can round to a tiny positive value (about
eps·|logsumexp| ≈ 4e-6 for logits near 30), which is not a bug; a real sign error (a negative log-likelihood, a
logit) is far larger. The value checks (``engine.checks``, ``engine.validate``) and the ``sanity/n_positive_logp``
count (``core.logp_sanity.POSITIVE_LOGP_TOLERANCE``) all read this one constant."""

# -- peers' names -------------------------------------------------------------------------------------------------
TWINKLE_NAMES: dict[str, str] = {
    "logp/new_mean": "train/mean_new_logp",
    "policy_confidence": "train/policy_confidence",
    "logp/old_mean": "train/mean_old_logp",
    "logp/diff_mean": "train/logp_diff_mean",
    "kl/k3": "train/approx_kl",
    "kl/k3_token_max": "train/token_kl_max",
    "ratio/max": "train/token_ratio_max",
    "entropy/mean": "train/entropy",
    "clip/ratio": "train/clip_ratio",
    "clip/low": "train/clip_ratio_low",
    "clip/high": "train/clip_ratio_high",
}
"""grpo-cli key → the key twinkle's ``GRPOMetric.calculate`` returns (``core.metric.GRPOMetric`` returns the
same keys; ``--names twinkle`` reports under them)."""

# -- what the first screen shows ----------------------------------------------------------------------------------
HEADLINE_KEYS = (
    "n_valid_tokens", "kl/k3", "kl/abs_diff_mean", "clip/ratio", "ratio/max", "is/ess", "staleness/theta_mean",
    "entropy/mean", "reward/mean", "groups/zero_std_frac", "seq/no_eos_frac",
)
"""The figures ``analyze``'s terminal headline table shows (each when the dump has it)."""

REPORT_HEADLINE_KEYS = (
    "kl/k3", "clip/ratio", "ratio/max", "is/ess", "staleness/theta_mean", "entropy/mean", "reward/mean",
)
"""The figures the HTML report shows as cards in its header (each when reported): fewer than the terminal's,
since a card holds one number and the page lists every figure below."""

# -- option defaults shared by the CLI and the configs ------------------------------------------------------------
DEFAULT_EPSILON = 0.2
"""``--epsilon``, ``PPOOptions.epsilon``: the PPO clip width (TRL's, verl's and AReaL's default)."""
DEFAULT_TEMPERATURE = 1.0
"""``--temperature``, ``AnalyzeConfig.temperature``."""
DEFAULT_TOP_K = 10
"""``analyze --top-k``, ``AnalyzeConfig.top_k``."""
DEFAULT_BETA = 0.0
"""``--beta``, ``AnalyzeConfig.beta``."""
DEFAULT_TAU_POS = 1.0
"""``--tau-pos``, ``AnalyzeConfig.tau_pos``."""
DEFAULT_MAX_COMPLETION_LENGTH = 1024
"""``--max-completion-length``, ``AnalyzeConfig.max_completion_length``."""
DEFAULT_IS_THRESHOLD = 2.0
"""``--is-threshold``, ``AnalyzeConfig.is_threshold``."""
DEFAULT_DISTILL_WEIGHT = 0.005
"""``--distill-weight``, ``AnalyzeConfig.distill_weight`` (AReaL's ``distill_loss_weight``)."""
DEFAULT_RL_WEIGHT = 1.0
"""``--rl-weight``, ``AnalyzeConfig.rl_weight`` (AReaL's ``rl_loss_weight``)."""
DEFAULT_VLLM_IS_MODE = "sequence_mask"
"""``--vllm-is-mode``, ``AnalyzeConfig.vllm_is_mode`` (TRL 1.16 ``vllm_importance_sampling_mode``)."""
DEFAULT_VLLM_IS_CLIP_MAX = 3.0
"""``--vllm-is-clip-max``, ``AnalyzeConfig.vllm_is_clip_max`` (TRL 1.16 ``vllm_importance_sampling_clip_max``)."""
