"""The configuration the engine reads: how a streaming pass runs (:class:`StreamConfig`) and the PPO options every
command that evaluates the PPO objective shares (:class:`PPOOptions`). Nothing here needs the layers above."""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

from grpo_cli._choices import IMPORTANCE_LEVELS
from grpo_cli._constants import DEFAULT_EPSILON
from grpo_cli.core.rejection import RejectionSamplingConfig
from grpo_cli.errors import UsageError
from grpo_cli.io.reader import DEFAULT_BATCH_TOKENS
from grpo_cli.io.schema import COLUMNS, ColumnKind

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "GROUP_BY_COLUMNS",
    "IMPORTANCE_LEVELS",
    "OnInvalid",
    "PPOOptions",
    "StreamConfig",
    "check_finite",
    "coded_group_by",
    "validate_stream",
]

GROUP_BY_COLUMNS = tuple(name for name, spec in COLUMNS.items() if spec.kind is ColumnKind.SEQUENCE_INT)
"""The schema's per-sequence integer columns: ``--group-by`` (and a ``check`` rule's ``per``) reads them as batch
columns. Any other per-sequence file column (a task or data-source string, a prompt id, …) is read as codes into
its sorted distinct values (``RolloutDataset.group_values``; see :func:`coded_group_by`)."""


def coded_group_by(group_by: str | None) -> bool:
    """Whether ``--group-by group_by`` is read as ``batch.group_key`` codes rather than a schema int column."""
    return group_by is not None and group_by not in GROUP_BY_COLUMNS


class OnInvalid(str, enum.Enum):
    """What to do with a sequence that fails validation (``--on-invalid``)."""

    error = "error"
    skip = "skip"


class StreamConfig(Protocol):
    """What the streaming pass itself reads from a command's config (``AnalyzeConfig``, ``CompareProxConfig``):
    where and in what batches to compute, the validation policy, and the optional ``--group-by`` split."""

    device: str
    batch_tokens: int
    on_invalid: str
    current_version: int | None
    group_by: str | None
    max_groups: int


def validate_stream(config: StreamConfig) -> None:
    """Raise :class:`UsageError` (exit 2) naming the bad streaming option."""
    if config.on_invalid not in tuple(OnInvalid):
        raise UsageError(f"--on-invalid must be 'error' or 'skip', got '{config.on_invalid}'")
    if isinstance(config.batch_tokens, bool) or not isinstance(config.batch_tokens, int) or config.batch_tokens < 1:
        raise UsageError(f"--batch-tokens must be >= 1, got {config.batch_tokens}")
    current = config.current_version
    if current is not None and (isinstance(current, bool) or not isinstance(current, int)):
        raise UsageError(f"--current-version must be an integer, got {current!r}")
    if config.group_by is not None and (not isinstance(config.group_by, str) or not config.group_by):
        raise UsageError(f"--group-by must be a column name, got {config.group_by!r}")

_RS_FIELDS = ("rs_level", "rs_action", "rs_metric", "rs_agg", "rs_upper", "rs_lower")


def check_finite(value: object, option: str, *, minimum: float | None = None, above: float | None = None) -> None:
    """Raise a :class:`UsageError` naming ``option`` unless ``value`` is a finite number within the bound."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = cast(float, value) >= minimum  # ok: value is a real number
    if ok and above is not None:
        ok = cast(float, value) > above
    if not ok:
        bound = f" >= {minimum}" if minimum is not None else f" > {above}" if above is not None else ""
        raise UsageError(f"{option} must be a finite number{bound}, got {value}")


@dataclass
class PPOOptions:
    """Clip widths, dual clip, importance level and AReaL rejection sampling.

    Attributes:
        epsilon, epsilon_high, c_clip, importance_level: AReaL's ``eps_clip``, ``eps_clip_higher``, ``c_clip``,
            ``importance_sampling_level`` (``epsilon_high`` defaults to ``epsilon``).
        rs_level, rs_action, rs_metric, rs_agg, rs_upper, rs_lower: AReaL's ``RejectionSamplingConfig``; rejection
            sampling is on when any of them is set (the others take AReaL's defaults) and off otherwise.
    """

    epsilon: float = DEFAULT_EPSILON
    epsilon_high: float | None = None
    c_clip: float | None = None
    importance_level: str = "token"
    rs_level: str | None = None
    rs_action: str | None = None
    rs_metric: str | None = None
    rs_agg: str | None = None
    rs_upper: float | None = None
    rs_lower: float | None = None

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def validate_ppo(self) -> None:
        """Raise :class:`UsageError` (exit 2) naming the bad option."""
        check_finite(self.epsilon, "--epsilon", minimum=0)
        if self.epsilon_high is not None:
            check_finite(self.epsilon_high, "--epsilon-high", minimum=0)
        if self.c_clip is not None:
            check_finite(self.c_clip, "--c-clip (dual clipping)", above=1)
        if self.importance_level not in IMPORTANCE_LEVELS:
            raise UsageError(f"--importance-level must be token or sequence, got {self.importance_level!r}")
        self.rejection_sampling()

    def rejection_sampling(self) -> RejectionSamplingConfig | None:
        """AReaL's ``RejectionSamplingConfig`` from the ``rs_*`` fields, or ``None`` when none is set."""
        given = {name[3:]: getattr(self, name) for name in _RS_FIELDS if getattr(self, name) is not None}
        if not given:
            return None
        try:
            with warnings.catch_warnings():
                # AReaL warns that agg is ignored at token level; `ppo_notes()` says it once, in the user's terms.
                warnings.simplefilter("ignore", UserWarning)
                return RejectionSamplingConfig(**given)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"rejection sampling (--rs-*): {exc}") from None

    def ppo_notes(self) -> list[str]:
        """Warnings about options that have no effect (the CLI prints them on stderr)."""
        rs = self.rejection_sampling()
        if rs is not None and rs.level == "token" and self.rs_agg not in (None, "mean"):
            return [f"--rs-agg {self.rs_agg} is ignored at --rs-level token (aggregation is per sequence)"]
        return []

    def ppo_json(self, out: dict[str, Any]) -> dict[str, Any]:
        """Rewrite ``asdict(self)`` for the JSON ``config``: ε_high resolved, rs_* folded into one object."""
        for name in _RS_FIELDS:
            out.pop(name, None)
        out["epsilon_high"] = self.eps_high
        rs = self.rejection_sampling()
        out["rejection_sampling"] = None if rs is None else asdict(rs)
        return out
