"""twinkle's GRPOMetric family for training loops: thin stateful wrappers over ``core.policy_stats``.

The same core computes ``grpo-cli analyze``'s figures, so a training loop and the CLI agree by construction.
Differences from twinkle's implementation, on purpose: advantage tensors are honoured, means divide by the tokens
that actually had old log-probs, maxima are true maxima, and with a ``process_group`` the state is all-reduced (not
gathered) so every rank returns the global figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from grpo_cli._constants import TWINKLE_NAMES
from grpo_cli.core.keyed_state import all_reduce_states
from grpo_cli.core.packing import cu_seqlens_from_lengths
from grpo_cli.core.policy_stats import policy_stats_compute, policy_stats_state, policy_stats_update
from grpo_cli.core.state import MetricState

__all__ = ["CISPOMetric", "GRPOMetric", "GSPOMetric"]

_CLIP = ("clip/ratio", "clip/low", "clip/high")
_COMMON_KEYS = {key: name for key, name in TWINKLE_NAMES.items() if key not in _CLIP}


class GRPOMetric:
    """Policy-optimisation diagnostics accumulated over micro-batches (token-level, advantage-gated clipping).

    Args:
        device_mesh: accepted for API compatibility; if given without ``process_group`` and it has a single
            dimension, its group is used.
        process_group: ``torch.distributed`` group to all-reduce over in :meth:`calculate`.
        epsilon: lower clip width ε.
        epsilon_high: upper clip width (default ε).
        temperature: sampling temperature; log-probs are multiplied by it (rescaled to T = 1), as twinkle's
            GRPOMetric does.
        top_k_kl: if > 0, also return the k highest-KL tokens under ``train/top_kl``.
        ignore_index: label value marking tokens that are not scored.

    Example:
        >>> metric = GRPOMetric(epsilon=0.2)
        >>> labels = torch.tensor([[5, 7, -100]])
        >>> logps = torch.tensor([[-1.0, -0.5, 0.0]])
        >>> metric.accumulate({"labels": labels}, {"logps": logps},
        ...                   old_logps=torch.tensor([[-1.0, -1.0, 0.0]]), advantages=torch.tensor([1.0]))
        >>> out = metric.calculate()
        >>> round(out["train/logp_diff_mean"], 6), out["train/clip_ratio_high"]
        (0.25, 0.5)
    """

    _clip_keys: ClassVar[dict[str, str]] = {key: TWINKLE_NAMES[key] for key in _CLIP}

    def __init__(
        self,
        device_mesh: Any = None,
        process_group: Any = None,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        temperature: float = 1.0,
        top_k_kl: int = 0,
        ignore_index: int = -100,
    ) -> None:
        if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
            raise ValueError("epsilon and epsilon_high must be >= 0")
        if top_k_kl < 0:
            raise ValueError("top_k_kl must be >= 0")
        self.device_mesh = device_mesh
        self.process_group = process_group
        self.epsilon = epsilon
        self.epsilon_high = epsilon_high
        self.temperature = temperature
        self.top_k_kl = top_k_kl
        self.ignore_index = ignore_index
        self._state: MetricState | None = None
        self._sequence_cursor = 0

    def reset(self) -> None:
        self._state = None
        self._sequence_cursor = 0

    def accumulate(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        old_logps: Tensor | Sequence[Any] | None = None,
        advantages: Tensor | Sequence[Any] | None = None,
    ) -> None:
        """Fold one micro-batch in.

        Args:
            inputs: ``inputs["labels"]`` ``[B, T]``; positions equal to ``ignore_index`` are not scored.
            outputs: ``outputs["logps"]`` ``[B, T]`` and optionally ``outputs["entropies"]`` ``[B, T]``.
            old_logps: ``[B, T]`` tensor, or one 1-D tensor/list per sequence holding either the scored positions
                only (scattered onto them in order) or the full row.
            advantages: ``[B]``, ``[B, 1]`` or ``[B, T]`` tensor, or a list with one scalar or per-token row per
                sequence.
        """
        logps = _as_2d(outputs["logps"])
        labels = _as_2d(torch.as_tensor(inputs["labels"], device=logps.device))
        if labels.shape != logps.shape:
            raise ValueError(f"labels {tuple(labels.shape)} and logps {tuple(logps.shape)} differ in shape")
        mask = labels != self.ignore_index
        lengths = mask.sum(dim=1)
        cu_seqlens = cu_seqlens_from_lengths(lengths)
        positions = torch.arange(logps.shape[1], device=logps.device).expand_as(logps)[mask]
        n_rows = logps.shape[0]
        rows = torch.arange(self._sequence_cursor, self._sequence_cursor + n_rows, device=logps.device)
        self._sequence_cursor += n_rows

        entropy = outputs.get("entropies")
        old = None if old_logps is None else _per_token(old_logps, mask, logps, "old_logps")
        adv = None if advantages is None else _per_token(advantages, mask, logps, "advantages")
        if self._state is None:
            self._state = policy_stats_state(self.top_k_kl, logps.device)
        policy_stats_update(
            self._state,
            new_logp=logps.detach()[mask],
            cu_seqlens=cu_seqlens,
            old_logp=None if old is None else old[mask],
            advantages=None if adv is None else adv[mask],
            entropy=None if entropy is None else _as_2d(entropy).detach()[mask],
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            temperature=self.temperature,
            sequence_keys=torch.stack([torch.zeros_like(rows), rows], dim=1),
            positions=positions,
        )

    def _group(self) -> Any:
        if self.process_group is not None:
            return self.process_group
        if self.device_mesh is not None and getattr(self.device_mesh, "ndim", 0) == 1:
            return self.device_mesh.get_group()
        return None

    def calculate(self) -> dict[str, Any]:
        """The figures since the last call (global over the process group, if any); then reset."""
        import torch.distributed as dist

        state = self._state
        self.reset()
        if state is None:
            return {}
        group = self._group()
        if group is not None and dist.is_available() and dist.is_initialized():
            state = state.clone()
            all_reduce_states([state], group)
        figures = policy_stats_compute(state)
        if figures["n_valid_tokens"] == 0:
            return {}
        out = {name: figures[key] for key, name in _COMMON_KEYS.items() if key in figures}
        out.update({name: figures[key] for key, name in self._clip_keys.items() if key in figures})
        if "top_kl" in figures:
            out["train/top_kl"] = [
                {"sequence": r["row"], "position": r["position"], "kl": r["kl"], "ratio": r["ratio"],
                 "new_logp": r["new_logp"], "old_logp": r["old_logp"]}
                for r in figures["top_kl"]
            ]
        return out


class GSPOMetric(GRPOMetric):
    """Clip rates at sequence level: s = exp(mean_t (new − old)), gated by the mean advantage; fractions of
    non-empty sequences."""

    _clip_keys: ClassVar[dict[str, str]] = {
        "clip/seq_ratio": "train/clip_ratio",
        "clip/seq_low": "train/clip_ratio_low",
        "clip/seq_high": "train/clip_ratio_high",
    }


class CISPOMetric(GRPOMetric):
    """Unconditional clip rates (not gated by the advantage sign): r < 1 − ε and r > 1 + ε_high."""

    _clip_keys: ClassVar[dict[str, str]] = {"clip/cispo": "train/clip_ratio", "clip/cispo_low": "train/clip_ratio_low",
                  "clip/cispo_high": "train/clip_ratio_high"}


def _as_2d(x: Any) -> Tensor:
    t = torch.as_tensor(x)
    return t.unsqueeze(0) if t.dim() == 1 else t


def _per_token(values: Tensor | Sequence[Any], mask: Tensor, like: Tensor, name: str) -> Tensor:
    """Any accepted form of a per-sequence or per-token input → a ``[B, T]`` tensor aligned with ``like``."""
    batch, width = like.shape
    if isinstance(values, Tensor):
        t = values.to(like.device)
        if t.dim() == 1 and t.numel() == batch:
            t = t.unsqueeze(1)
        if t.dim() == 2 and t.shape[0] == batch and t.shape[1] in (1, width):
            return t.expand(batch, width)
        raise ValueError(f"{name}: expected [B], [B, 1] or [B, T] with B={batch}, T={width}; got {tuple(t.shape)}")
    if len(values) != batch:
        raise ValueError(f"{name}: expected one entry per sequence ({batch}), got {len(values)}")
    out = torch.zeros(batch, width, dtype=like.dtype, device=like.device)
    for i, entry in enumerate(values):
        row = torch.as_tensor(entry, dtype=like.dtype, device=like.device).flatten()
        n_scored = int(mask[i].sum())
        if row.numel() == 1:
            out[i] = row
        elif row.numel() == n_scored:
            out[i, mask[i]] = row
        elif row.numel() == width:
            out[i] = row
        else:
            raise ValueError(
                f"{name}[{i}]: {row.numel()} values, but the row has {n_scored} scored positions and width {width}"
            )
    return out
