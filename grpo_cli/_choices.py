"""The names users choose from on the command line, defined once and torch-free.

The library's modules use these tuples (``grpo_cli.core.prox.PROX_APPROX_METHODS`` is
:data:`PROX_APPROX_METHODS`, and so on) and the CLI builds its choice types from them, so ``--help`` needs no torch
and the two never disagree.
"""

from __future__ import annotations

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CONVERT_FORMATS",
    "DEFAULT_BATCH_TOKENS",
    "DEVICES",
    "FRAMEWORKS",
    "GRPO_VARIANTS",
    "IMPORTANCE_LEVELS",
    "ON_INVALID",
    "PRESET_NAMES",
    "PROX_APPROX_METHODS",
    "TRL_VLLM_IS_MODES",
    "VERL_ROLLOUT_IS_LEVELS",
    "VERL_RS_OPTIONS",
]

DEFAULT_BATCH_TOKENS = 1 << 18
"""Tokens per streamed batch (``--batch-tokens``): bounds memory; the figures never depend on it."""

ON_INVALID: tuple[str, ...] = ("error", "skip")
"""``--on-invalid``: stop at the first invalid value, or drop (and count) the sequences that hold one."""

DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""``--device``: where the core runs."""

FRAMEWORKS: tuple[str, ...] = ("areal", "verl", "trl", "twinkle")
"""Frameworks ``--names`` accepts (besides ``grpo-cli``, the default: no renaming)."""

PRESET_NAMES: tuple[str, ...] = ("areal", "verl", "trl", "slime", "openrlhf", "twinkle")
"""Frameworks with a column-map preset (``--preset``; ``grpo_cli.io.presets.PRESETS``)."""

PROX_APPROX_METHODS: tuple[str, ...] = ("loglinear", "linear", "rollout")
"""AReaL's ``PROX_APPROX_METHODS_ALL``, in AReaL's order (``ProxApproxMethod``)."""

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("gae", "grpo", "drgrpo", "rloo", "reinforce_pp")
"""Estimator names the ``advantages`` command accepts (``--estimator``)."""

GRPO_VARIANTS: tuple[str, ...] = ("grpo", "gspo", "sapo", "cispo", "bnpo", "dr_grpo")
"""The GRPO-family loss objects (``--loss``, besides AReaL's ``ppo``)."""

IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")
"""``--importance-level``: the PPO ratio per token or per sequence (GSPO)."""

CONVERT_FORMATS: tuple[str, ...] = ("slime-train", "slime-rollout", "torch-dict", "jsonl")
"""``convert --from``: the dump formats the converters read."""

TRL_VLLM_IS_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's ``GRPOConfig.vllm_importance_sampling_mode`` values (``--vllm-is-mode``; TRL 1.16's default
``sequence_mask``)."""

VERL_ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""verl's ``RolloutCorrectionConfig.rollout_is`` levels (``--rollout-is``)."""

VERL_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""verl's ``rollout_rs`` options (``rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS``; ``--rollout-rs``)."""
