"""``AnalyzeConfig``: every option that changes an ``analyze`` figure, read by the metric groups."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from grpo_cli._choices import FRAMEWORKS, TRL_VLLM_IS_MODES, VERL_ROLLOUT_IS_LEVELS
from grpo_cli._constants import (
    DEFAULT_BETA,
    DEFAULT_DISTILL_WEIGHT,
    DEFAULT_IS_THRESHOLD,
    DEFAULT_MAX_COMPLETION_LENGTH,
    DEFAULT_RL_WEIGHT,
    DEFAULT_TAU_POS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_VLLM_IS_CLIP_MAX,
    DEFAULT_VLLM_IS_MODE,
)
from grpo_cli.core.grpo_family import GRPO_VARIANTS
from grpo_cli.core.histogram import QUANTILE_REL_ERROR
from grpo_cli.core.peer_figures import verl_is_threshold, verl_rs_options, verl_rs_thresholds
from grpo_cli.core.staleness import MAX_LAG
from grpo_cli.engine.config import DEFAULT_BATCH_TOKENS, PPOOptions, check_finite, validate_stream
from grpo_cli.errors import UsageError

__all__ = ["LOSS_NAMES", "PEER_CONVENTIONS", "PEER_NAMES", "AnalyzeConfig"]

PEER_NAMES = FRAMEWORKS
"""``--names`` frameworks besides ``grpo-cli`` (``grpo_cli.metrics.names.FRAMEWORKS`` is the same tuple)."""

PEER_CONVENTIONS: dict[str, tuple[str, ...]] = {"verl": ("verl<=0.7",)}
"""``--convention``: older peer releases whose logged figures differ and that users still run, per ``--names``
peer (the core's ``convention`` strings). ``verl<=0.7``: ``rollout_corr/rollout_is_*`` describe the raw weights
(verl 0.8 and later: the truncated weights)."""

_PEER_SETTINGS: dict[str, tuple[str, ...]] = {
    "verl": ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold"),
    "trl": ("vllm_is_mode", "vllm_is_clip_max", "vllm_is_clip_min", "advantages_per_token"),
}
"""The fields that configure one peer's logged figures (reported in the JSON ``config`` under its ``--names``)."""

LOSS_NAMES = (*GRPO_VARIANTS, "ppo")
"""``--loss`` choices: the six GRPO-family loss objects and AReaL's ``ppo_actor_loss``."""


@dataclass
class AnalyzeConfig(PPOOptions):
    """Every option that changes a figure (reported in the JSON ``config``).

    Besides :class:`~grpo_cli.engine.config.PPOOptions` (clip widths, dual clip, importance level, rejection sampling):
    ``losses`` selects the ``loss/*`` figures (``None``: all the data allows); ``beta``, ``tau_pos``, ``tau_neg`` and
    ``max_completion_length`` are the GRPO-family loss objects' parameters (``docs/losses.md``). ``names`` is the
    framework whose keys and conventions the report uses (``--names``; ``None`` or ``"grpo-cli"``: grpo-cli's own):
    under a peer's name the peer-exact figures of :mod:`grpo_cli.metrics.peers` are computed too, by the peer's
    pinned release (:data:`~grpo_cli.core.conventions.PEER_RELEASES`) unless ``convention`` names an older one
    (:data:`PEER_CONVENTIONS`, ``--convention``).

    The peers' own settings of the figures they log, read only under their ``--names``: verl's
    ``RolloutCorrectionConfig`` ``rollout_is`` (level), ``rollout_is_threshold`` (``None``: ``is_threshold``;
    ``"l_u"``: IcePop), ``rollout_rs`` and ``rollout_rs_threshold`` (rejection sampling, off when ``None``); TRL's
    ``GRPOConfig`` ``vllm_importance_sampling_mode``, ``vllm_importance_sampling_clip_max`` and ``_clip_min``
    (``vllm_is_*``). ``advantages_per_token`` is not an option but what the dump holds (``commands.analyze`` sets
    it under ``--names trl``): TRL's clip ratios at sequence level average over sequences for its base ``[B]``
    advantages and over tokens for per-token ``[B, T]`` ones (:func:`~grpo_cli.core.peer_trl.trl_clip_ratio_metrics`).
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"
    group_by: str | None = None
    max_groups: int = 100_000
    losses: tuple[str, ...] | None = None
    beta: float = DEFAULT_BETA
    tau_pos: float = DEFAULT_TAU_POS
    tau_neg: float | None = None
    max_completion_length: int = DEFAULT_MAX_COMPLETION_LENGTH
    on_invalid: str = "error"
    kl_clamp: float | None = None
    is_threshold: float = DEFAULT_IS_THRESHOLD
    m2_threshold: float | None = None
    current_version: int | None = None
    distill_weight: float = DEFAULT_DISTILL_WEIGHT
    rl_weight: float = DEFAULT_RL_WEIGHT
    max_new_tokens: int | None = None
    names: str | None = None
    convention: str | None = None
    rollout_is: str = "token"
    rollout_is_threshold: str | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None
    vllm_is_mode: str = DEFAULT_VLLM_IS_MODE
    vllm_is_clip_max: float = DEFAULT_VLLM_IS_CLIP_MAX
    vllm_is_clip_min: float | None = None
    advantages_per_token: bool = False

    def peer(self) -> str | None:
        """The peer framework whose figures are asked for (``None`` for grpo-cli's own names)."""
        return None if self.names in (None, "grpo-cli") else self.names

    def validate(self) -> None:
        self.validate_ppo()
        if self.kl_clamp is not None:
            check_finite(self.kl_clamp, "--kl-clamp", above=0)
        check_finite(self.is_threshold, "--is-threshold", minimum=1)
        if self.m2_threshold is not None:
            check_finite(self.m2_threshold, "--m2-threshold")
        check_finite(self.beta, "--beta", minimum=0)
        check_finite(self.distill_weight, "--distill-weight", minimum=0)
        check_finite(self.rl_weight, "--rl-weight", minimum=0)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        check_finite(self.tau_pos, "--tau-pos", above=0)
        if self.tau_neg is not None:
            check_finite(self.tau_neg, "--tau-neg", above=0)
        if self.max_completion_length < 1:
            raise UsageError(f"--max-completion-length must be >= 1, got {self.max_completion_length}")
        if self.losses is not None:
            unknown = [name for name in self.losses if name not in LOSS_NAMES]
            if unknown:
                raise UsageError(f"--loss: unknown {', '.join(unknown)} (choose from {', '.join(LOSS_NAMES)})")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if self.peer() is not None and self.peer() not in PEER_NAMES:
            raise UsageError(f"--names: unknown framework {self.names!r} "
                             f"(choose from grpo-cli, {', '.join(PEER_NAMES)})")
        if self.convention is not None:
            accepted = PEER_CONVENTIONS.get(self.peer() or "", ())
            if self.convention not in accepted:
                raise UsageError(f"--convention {self.convention!r} needs --names with a peer release that differs "
                                 f"(choose from {', '.join(c for cs in PEER_CONVENTIONS.values() for c in cs)})")
        self._validate_peer_settings()
        validate_stream(self)

    def verl_is_bounds(self) -> tuple[float, float | None]:
        """verl's ``rollout_is_threshold`` as ``(upper, lower)``: ``lower`` is set for IcePop (``"l_u"``)."""
        if self.rollout_is_threshold is None:
            return self.is_threshold, None
        return verl_is_threshold(self.rollout_is_threshold)

    def _validate_peer_settings(self) -> None:
        if self.rollout_is not in VERL_ROLLOUT_IS_LEVELS:
            raise UsageError(f"--rollout-is must be one of {', '.join(VERL_ROLLOUT_IS_LEVELS)}, "
                             f"got {self.rollout_is!r}")
        try:
            self.verl_is_bounds()
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--rollout-is-threshold: {exc}") from None
        if (self.rollout_rs is None) != (self.rollout_rs_threshold is None):
            raise UsageError("--rollout-rs and --rollout-rs-threshold go together (verl needs an explicit threshold)")
        if self.rollout_rs is not None and self.rollout_rs_threshold is not None:
            try:
                verl_rs_thresholds(verl_rs_options(self.rollout_rs), self.rollout_rs_threshold)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"--rollout-rs/--rollout-rs-threshold: {exc}") from None
        if self.vllm_is_mode not in TRL_VLLM_IS_MODES:
            raise UsageError(f"--vllm-is-mode must be one of {', '.join(TRL_VLLM_IS_MODES)}, "
                             f"got {self.vllm_is_mode!r}")
        check_finite(self.vllm_is_clip_max, "--vllm-is-clip-max", above=0)
        if self.vllm_is_clip_min is not None:
            check_finite(self.vllm_is_clip_min, "--vllm-is-clip-min", minimum=0)
            if self.vllm_is_clip_min >= self.vllm_is_clip_max:  # TRL's GRPOConfig.__post_init__ refuses it too
                raise UsageError(f"--vllm-is-clip-min ({self.vllm_is_clip_min}) must be less than --vllm-is-clip-max "
                                 f"({self.vllm_is_clip_max})")

    def to_json(self) -> dict[str, Any]:
        out = self.ppo_json(asdict(self))
        out.pop("device")  # where it ran does not change a figure
        out.pop("batch_tokens")
        out.pop("max_groups")
        out["losses"] = list(LOSS_NAMES if self.losses is None else self.losses)
        out["tau_neg"] = self.tau_pos if self.tau_neg is None else self.tau_neg
        out["names"] = self.peer() or "grpo-cli"
        out["convention"] = self.convention or self.peer() or "grpo-cli"
        # A peer's own settings are recorded only under its --names (they change nothing else).
        for peer, fields in _PEER_SETTINGS.items():
            if self.peer() != peer:
                for name in fields:
                    out.pop(name)
        # How the off-policy figures are binned (grpo_cli.core.histogram / .staleness), not options.
        out["quantile_rel_error"] = QUANTILE_REL_ERROR
        out["staleness_max_lag"] = MAX_LAG
        return out
