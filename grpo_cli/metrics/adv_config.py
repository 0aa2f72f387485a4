"""The options of ``grpo-cli advantages`` (:class:`AdvantageCheckConfig`) and the ``--reward-norm``/``--adv-norm``
spec parser; read by the advantage-check metric groups (:mod:`grpo_cli.metrics.adv_check`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from grpo_cli.core.advantages import ADVANTAGE_ESTIMATORS, NormConfig
from grpo_cli.core.rewards import KL_ESTIMATORS
from grpo_cli.engine.config import validate_stream
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS

__all__ = ["PER_SEQUENCE_ESTIMATORS", "AdvantageCheckConfig", "parse_norm_spec"]

PER_SEQUENCE_ESTIMATORS = ("grpo", "drgrpo", "rloo")
"""Estimators with one advantage per sequence (broadcast over its valid tokens, 0 elsewhere)."""

_DEFAULT_STD_EPS = {"grpo": 1e-6, "reinforce_pp": 1e-8}

def parse_norm_spec(text: str | None, option: str = "--adv-norm") -> NormConfig | None:
    """``MEAN[/STD][,leave1out][,biased][,eps=E][,group_size=N]`` → :class:`NormConfig` (``none`` → None).

    ``MEAN`` and ``STD`` are ``batch``, ``group`` or ``none``; a lone level is used for both. ``biased`` divides
    the std by N instead of N − 1; ``eps`` defaults to AReaL's 1e-5.

    Example:
        >>> parse_norm_spec("group,leave1out,eps=0")
        NormConfig(mean_level='group', mean_leave1out=True, std_level='group', std_unbiased=True, eps=0.0, \
group_size=1)
        >>> parse_norm_spec("batch/none").std_level is None
        True
    """
    if text is None or text.strip().lower() == "none":
        return None
    head, *options = [part.strip() for part in text.split(",")]
    levels = [level.strip().lower() for level in head.split("/")]
    if len(levels) not in (1, 2) or any(level not in ("batch", "group", "none") for level in levels):
        raise UsageError(f"{option}: expected MEAN[/STD] with levels batch|group|none, got '{head}'")
    mean = None if levels[0] == "none" else levels[0]
    std = mean if len(levels) == 1 else (None if levels[1] == "none" else levels[1])
    kwargs: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        try:
            if key == "leave1out" and not sep:
                kwargs["mean_leave1out"] = True
            elif key == "biased" and not sep:
                kwargs["std_unbiased"] = False
            elif key == "eps" and sep:
                kwargs["eps"] = float(value)
            elif key == "group_size" and sep:
                kwargs["group_size"] = int(value)
            else:
                raise UsageError(f"{option}: unknown option '{item}' (leave1out, biased, eps=E, group_size=N)")
        except ValueError:
            raise UsageError(f"{option}: bad value in '{item}'") from None
    try:
        return NormConfig(mean_level=mean, std_level=std, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{option}: {exc}") from None


@dataclass
class AdvantageCheckConfig:
    """Every option of ``grpo-cli advantages`` that changes a figure (reported in the JSON ``config``).

    Defaults are neutral — no shaping, no KL reward, no normalisation — rather than AReaL's (which clip rewards at
    20 and add a 0.1·k1 KL reward): state the trainer's configuration explicitly (``docs/advantages.md``).
    """

    estimator: str
    atol: float = 1e-5
    rtol: float = 0.0
    valid_only: bool = False
    top_k: int = 10
    batch_by: str | None = "auto"
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float | None = None
    overlong_tokens: int | None = None
    overlong_penalty_factor: float | None = None
    max_new_tokens: int | None = None
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"
    discount: float = 1.0
    gae_lambda: float = 1.0
    mask_no_eos_with_zero: bool = False
    std_eps: float | None = None
    std_unbiased: bool = True
    rloo_singleton: str = "keep"
    alignment: str = "token"
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    device: str = "cpu"
    on_invalid: str = "error"
    current_version: int | None = None
    group_by: str | None = None
    """Not an option of ``advantages`` (the engine's ``StreamConfig`` reads it): always None."""
    max_groups: int = 1

    def validate(self) -> None:
        """Raise :class:`UsageError` for a bad value or an option the estimator does not use."""
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise UsageError(f"--estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got '{self.estimator}'")
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        validate_stream(self)
        if self.reward_clip is not None and not self.reward_clip >= 0:
            raise UsageError(f"--reward-clip must be >= 0, got {self.reward_clip}")
        if (self.overlong_tokens is None) != (self.overlong_penalty_factor is None):
            raise UsageError("--overlong-tokens and --overlong-penalty-factor go together")
        if self.overlong_tokens is not None and self.overlong_tokens < 1:
            raise UsageError(f"--overlong-tokens must be >= 1, got {self.overlong_tokens}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise UsageError(f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}, got '{self.kl_estimator}'")
        if self.std_eps is not None and not (math.isfinite(self.std_eps) and self.std_eps >= 0):
            raise UsageError(f"--std-eps must be a finite number >= 0, got {self.std_eps}")
        if self.rloo_singleton not in ("keep", "zero"):
            raise UsageError(f"--rloo-singleton must be keep or zero, got '{self.rloo_singleton}'")
        if self.alignment not in ("token", "next"):
            raise UsageError(f"--alignment must be token or next, got '{self.alignment}'")
        est = self.estimator
        unused = {
            "--kl-ctl": self.kl_ctl != 0 and est != "gae",
            "--gae-lambda": self.gae_lambda != 1.0 and est != "gae",
            "--discount": self.discount != 1.0 and est not in ("gae", "reinforce_pp"),
            "--adv-norm": self.adv_norm is not None and est != "gae",
            "--mask-no-eos-with-zero": self.mask_no_eos_with_zero and est != "gae",
            "--alignment next": self.alignment != "token" and est != "gae",
            "--std-eps": self.std_eps is not None and est not in _DEFAULT_STD_EPS,
            "--std-biased": not self.std_unbiased and est != "grpo",
            "--rloo-singleton zero": self.rloo_singleton != "keep" and est != "rloo",
        }
        for option, bad in unused.items():
            if bad:
                raise UsageError(f"{option} does not apply to --estimator {est}")

    @property
    def eps(self) -> float | None:
        """The std ε of the estimator (GRPO 1e-6 as verl, REINFORCE++ whitening 1e-8), None for the others."""
        return self.std_eps if self.std_eps is not None else _DEFAULT_STD_EPS.get(self.estimator)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("reward_norm", "adv_norm"):
            value = getattr(self, name)
            out[name] = None if value is None else asdict(value)
        out["std_eps"] = self.eps
        for name in ("device", "batch_tokens", "current_version", "group_by", "max_groups"):
            out.pop(name)
        if self.on_invalid == "error":
            out.pop("on_invalid")  # the default: reported only when sequences may have been skipped
        return out


