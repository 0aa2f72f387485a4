"""The GRPO-family loss objects (twinkle's ``twinkle.loss`` API): GRPO, GSPO, SAPO, CISPO, BNPO and Dr.GRPO.

Usage mirrors twinkle's ``twinkle.loss`` classes (twinkle's ``twinkle.loss`` classes) with twinkle's
documented constructor names::

    loss_fn = GRPOLoss(clip_range=0.2, beta=0.01)
    loss = loss_fn({"labels": labels}, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv)
    loss.backward()  # gradients reach outputs["logps"]

Differences from twinkle, on purpose: an unknown constructor keyword raises ``TypeError`` (twinkle silently
ignores ``clip_range``/``tau`` and trains with its defaults); masked positions are neutralised with
``torch.where`` so NaN/inf garbage there cannot poison the loss; packed rows are split at every
``position_ids == 0`` (twinkle's detector misses a pack whose later segments are single tokens); CISPO
caps at ``1 + clip_range_high`` and divides by the token count (0 rather than NaN with no tokens).
Every loss is ``numerator / denominator``; :meth:`terms` returns both for exact streaming.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from grpo_cli.core._loss_common import check_real, safe_ratio
from grpo_cli.core.grpo_family import grpo_family_loss_terms
from grpo_cli.core.packing import segment_ids

__all__ = ["BNPOLoss", "CISPOLoss", "DRGRPOLoss", "GRPOLoss", "GSPOLoss", "SAPOLoss"]

_UNSET: Any = object()


def _pick(primary: Any, alias: Any, primary_name: str, alias_name: str, default: Any) -> Any:
    """One value from a parameter and its alias; both given with different values raises ``TypeError``."""
    if primary is not _UNSET and alias is not _UNSET and primary != alias:
        raise TypeError(f"got both {primary_name}={primary!r} and its alias {alias_name}={alias!r}")
    if primary is not _UNSET:
        return primary
    return default if alias is _UNSET else alias


def _as_tensor(x: Any, name: str, device: torch.device | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x if device is None else x.to(device)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x).to(device) if device is not None else torch.from_numpy(x)
    try:
        out = torch.as_tensor(x, device=device)
        # Python floats are float64: read them so, not in the default float32, to lose no precision.
        return torch.as_tensor(x, device=device, dtype=torch.float64) if out.is_floating_point() else out
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a tensor, an array or a rectangular nested list: {exc}") from exc


def _result_dtype(outputs: Mapping[str, Any]) -> torch.dtype:
    """The loss value's dtype: that of ``outputs["logps"]`` (or of the log-probs computed from logits)."""
    logps = outputs.get("logps")
    if isinstance(logps, Tensor) and logps.is_floating_point():
        return logps.dtype
    logits = outputs.get("logits")
    if isinstance(logits, Tensor) and logits.dtype == torch.float64:
        return torch.float64
    return torch.float32


class _Packed:
    """Flattened view of one call's inputs: tokens ``[N = B·T]``, sequences split at ``position_ids == 0``."""

    def __init__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], ignore_index: int) -> None:
        if not isinstance(inputs, Mapping) or "labels" not in inputs:
            raise ValueError("inputs must be a mapping with 'labels'")
        if not isinstance(outputs, Mapping):
            raise ValueError("outputs must be a mapping with 'logps' (or 'logits')")
        ref = outputs.get("logps")
        if ref is None:
            ref = outputs.get("logits")
        device = ref.device if isinstance(ref, Tensor) else None
        labels = _as_tensor(inputs["labels"], "labels", device)
        if labels.ndim == 1:
            labels = labels.unsqueeze(0)
        if labels.ndim != 2:
            raise ValueError(f"labels must have shape (batch, tokens), got {tuple(labels.shape)}")
        self.batch, self.width = labels.shape
        self.mask2d = labels != ignore_index
        logps = outputs.get("logps")
        if logps is None:
            logps = self._logps_from_logits(outputs.get("logits"), labels, ignore_index)
        if not isinstance(logps, Tensor):
            raise ValueError("outputs['logps'] must be a torch.Tensor")
        if logps.ndim == 1:
            logps = logps.unsqueeze(0)
        if logps.shape != labels.shape:
            raise ValueError(f"outputs['logps'] shape {tuple(logps.shape)} != labels shape {tuple(labels.shape)}")
        self.device = logps.device
        self.mask2d = self.mask2d.to(self.device)
        self.logp = logps.reshape(-1)
        self.mask = self.mask2d.reshape(-1)
        self.cu = self._boundaries(inputs.get("position_ids"))
        self.n_seq = self.cu.numel() - 1
        self.seg = segment_ids(self.cu, self.logp.numel())
        self.seg_len = (self.cu[1:] - self.cu[:-1]).tolist()
        self.seg_valid = torch.zeros(self.n_seq, dtype=torch.int64, device=self.device)
        if self.logp.numel():
            self.seg_valid.index_add_(0, self.seg, self.mask.to(torch.int64))

    @staticmethod
    def _logps_from_logits(logits: Any, labels: Tensor, ignore_index: int) -> Tensor:
        # twinkle: keep the last T positions (drops multimodal prefixes), log-softmax, gather the label
        # (ignored labels read token 0, masked later). No temperature here, as in twinkle.
        if not isinstance(logits, Tensor) or logits.ndim != 3:
            raise ValueError("outputs needs 'logps' [B, T] or 'logits' [B, T, V]")
        logits = logits[:, -labels.shape[1] :, :]
        index = torch.where(labels == ignore_index, torch.zeros_like(labels), labels).to(logits.device)
        logp_all = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
        return logp_all.gather(-1, index.unsqueeze(-1).to(torch.int64)).squeeze(-1)

    def _boundaries(self, position_ids: Any) -> Tensor:
        b, t = self.batch, self.width
        starts = torch.zeros((b, t), dtype=torch.bool, device=self.device)
        if t:
            starts[:, 0] = True
        if position_ids is not None:
            pos = _as_tensor(position_ids, "position_ids", self.device)
            if pos.ndim == 3:  # mrope [3, B, T]: the first (temporal) channel carries the sequence starts
                pos = pos[0]
            if pos.ndim == 1:
                pos = pos.unsqueeze(0)
            if pos.shape != (b, t):
                raise ValueError(f"position_ids shape {tuple(pos.shape)} != labels shape {(b, t)}")
            # A sequence starts wherever position_ids is 0 after position 0 (packed rows), also a final
            # one-token segment; every segment, even one without valid tokens, counts as a sequence.
            starts |= pos == 0
        flat_starts = torch.nonzero(starts.reshape(-1)).reshape(-1)
        if b and not t:  # rows of width 0: one empty sequence per row
            flat_starts = torch.zeros(b, dtype=torch.int64, device=self.device)
        end = torch.tensor([b * t], dtype=torch.int64, device=self.device)
        return torch.cat([flat_starts.to(torch.int64), end])

    def align(self, data: Any, name: str, dtype: torch.dtype) -> Tensor | None:
        """Per-token ``[N]`` values from twinkle's accepted forms (twinkle's
        ``GRPOLoss._pad_and_align_to_batch``, ``src/twinkle/loss/grpo.py``), 0 elsewhere.

        - a tensor/array of exactly ``(B, T)``: taken position by position;
        - one number per sequence (a 1-D tensor/list of length S, or ``(S, 1)``): broadcast over it;
        - a 0-d tensor or a number: broadcast over every token;
        - per-sequence rows (a list of sequences, or a 2-D ``(S, L)`` tensor): a row of 1 value is broadcast,
          a row of ``n_valid`` values fills the valid positions in order (response-only form), a row of at
          least the segment length gives its first ``len`` values (full-sequence form); other lengths raise.
        """
        if data is None:
            return None
        n_seq, b, t = self.n_seq, self.batch, self.width
        if isinstance(data, numbers.Real) and not isinstance(data, bool):
            data = torch.tensor(float(data))
        if isinstance(data, (list, tuple)) and not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in data
        ):
            return self._from_rows([_as_tensor(r, name).reshape(-1) for r in data], name, dtype)
        x = _as_tensor(data, name, self.device)
        if x.shape == (b, t):
            return x.reshape(-1).to(dtype)
        if x.ndim == 0:
            return x.to(dtype).expand(b * t).clone()
        if (x.ndim == 1 and x.numel() == n_seq) or x.shape == (n_seq, 1):
            return x.reshape(-1).to(dtype)[self.seg]
        if x.ndim == 1 and b == 1 and x.numel() == t:
            return x.to(dtype)
        if x.ndim == 2:
            return self._from_rows(list(x), name, dtype)
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} matches neither (batch, tokens) = {(b, t)}, one value per "
            f"sequence ({n_seq}), nor per-sequence rows"
        )

    def _from_rows(self, rows: Sequence[Tensor], name: str, dtype: torch.dtype) -> Tensor:
        if len(rows) != self.n_seq:
            raise ValueError(f"{name} has {len(rows)} rows but the batch holds {self.n_seq} sequences")
        out = torch.zeros(self.batch * self.width, dtype=dtype, device=self.device)
        valid = self.seg_valid.tolist()
        cu = self.cu.tolist()
        for s, row in enumerate(rows):
            row = row.reshape(-1).to(device=self.device, dtype=dtype)
            start, length, n_valid = cu[s], self.seg_len[s], valid[s]
            if row.numel() == 1:
                out[start : start + length] = row
            elif row.numel() == n_valid:
                positions = start + torch.nonzero(self.mask[start : start + length]).reshape(-1)
                out[positions] = row
            elif row.numel() >= length:
                out[start : start + length] = row[:length]
            else:
                raise ValueError(
                    f"{name} row {s} has {row.numel()} values; expected 1, the {n_valid} valid tokens, "
                    f"or at least the sequence length {length}"
                )
        return out


class GRPOLoss:
    """GRPO loss: token ratio, PPO clip, optional β·k3 KL; per-sequence mean then batch mean.

    ``L_tok = −min(r·A, clip(r, 1 − clip_range, 1 + clip_range_high)·A) + β·k3`` with
    ``r = exp(clamp(ℓ − ℓ_old, −20, 20))`` and ``k3 = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1`` (only when
    ``beta > 0`` and ``ref_logps`` is given); ``loss = (1/S) Σ_s Σ_t L_tok·m / max(1, n_s)`` over the ``S``
    sequences (rows, or ``position_ids`` segments), including sequences without valid tokens.

    Args (keyword-only):
        clip_range: PPO clip width ε (alias ``epsilon``), default 0.2.
        clip_range_high: upper clip width (alias ``epsilon_high``), default ``clip_range``.
        beta: KL coefficient, default 0 (off).
        entropy_coef: twinkle's entropy bonus ``L_tok −= coef·H`` (needs ``outputs["entropies"]``), default 0.
        ignore_index: label value of positions outside the loss, default −100.

    Raises:
        TypeError: an unknown keyword (twinkle silently ignores them), or a parameter and its alias with
            different values.
        ValueError: a negative ``clip_range``/``beta``/``entropy_coef``, a non-int ``ignore_index``.

    Example:
        >>> lp = torch.zeros(1, 2, requires_grad=True)
        >>> loss_fn = GRPOLoss(clip_range=0.2)
        >>> loss = loss_fn({"labels": torch.tensor([[5, -100]])}, {"logps": lp}, advantages=[1.0])
        >>> loss.item(); loss.backward(); lp.grad.tolist()
        -1.0
        [[-1.0, 0.0]]
    """

    variant: ClassVar[str] = "grpo"

    def __init__(
        self,
        *,
        clip_range: float = _UNSET,
        beta: float = 0.0,
        clip_range_high: float | None = _UNSET,
        epsilon: float = _UNSET,
        epsilon_high: float | None = _UNSET,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
    ) -> None:
        eps = _pick(clip_range, epsilon, "clip_range", "epsilon", 0.2)
        eps_hi = _pick(clip_range_high, epsilon_high, "clip_range_high", "epsilon_high", None)
        self.clip_range = check_real(eps, "clip_range", minimum=0.0)
        self.clip_range_high = self.clip_range if eps_hi is None else check_real(eps_hi, "clip_range_high", minimum=0.0)
        self.beta = check_real(beta, "beta", minimum=0.0)
        self.entropy_coef = check_real(entropy_coef, "entropy_coef", minimum=0.0)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
        self.ignore_index = ignore_index
        self.tau_pos = 1.0
        self.tau_neg = 1.0
        self.max_completion_length = 1024

    @property
    def epsilon(self) -> float:
        """Alias of :attr:`clip_range` (twinkle's name)."""
        return self.clip_range

    @property
    def epsilon_high(self) -> float:
        """Alias of :attr:`clip_range_high` (twinkle's name)."""
        return self.clip_range_high

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(clip_range={self.clip_range}, clip_range_high={self.clip_range_high}, beta={self.beta})"

    def terms(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        old_logps: Any = None,
        ref_logps: Any = None,
        advantages: Any = None,
    ) -> tuple[Tensor, Tensor]:
        """``(numerator, denominator)`` float64 scalars with ``self(...) == numerator / denominator``.

        GRPO/GSPO/SAPO: Σ of per-sequence means and the number of sequences; BNPO/CISPO: token sum and
        token count; Dr.GRPO: token sum and ``S·max_completion_length``. Both add up over batches of whole
        sequences. Without ``advantages`` both are 0 (the numerator still attached to the graph).
        """
        packed = _Packed(inputs, outputs, self.ignore_index)
        if advantages is None:
            zero = packed.logp.sum().to(torch.float64) * 0
            return zero, torch.zeros((), dtype=torch.float64, device=packed.device)
        dtype = packed.logp.dtype if packed.logp.is_floating_point() else torch.get_default_dtype()
        entropies = outputs.get("entropies") if self.entropy_coef > 0 else None
        if self.entropy_coef > 0 and entropies is None:
            raise ValueError("entropy_coef > 0 needs outputs['entropies']")
        return grpo_family_loss_terms(
            self.variant,
            packed.logp,
            packed.align(old_logps, "old_logps", dtype),
            packed.align(ref_logps, "ref_logps", dtype),
            packed.align(advantages, "advantages", dtype),  # type: ignore[arg-type]  # not None: checked above
            packed.mask,
            packed.cu,
            clip_low=self.clip_range,
            clip_high=self.clip_range_high,
            beta=self.beta,
            tau_pos=self.tau_pos,
            tau_neg=self.tau_neg,
            max_completion_length=self.max_completion_length,
            entropy=packed.align(entropies, "entropies", dtype),
            entropy_coef=self.entropy_coef,
        )

    def __call__(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
        *,
        old_logps: Any = None,
        ref_logps: Any = None,
        advantages: Any = None,
    ) -> Tensor:
        """The scalar loss (``outputs["logps"]``' dtype), differentiable w.r.t. ``outputs["logps"]``.

        Args:
            inputs: ``{"labels": [B, T] or [T], "position_ids": optional [B, T] / [T] / [3, B, T]}``.
            outputs: ``{"logps": [B, T]}`` (or ``{"logits": [B, T', V]}``; ``"entropies"`` for the bonus).
            old_logps: behaviour log-probs (``None``: ratio 1, gradient kept), in any form that
                :meth:`_Packed.align` accepts (per token ``[B, T]``, per-sequence rows, ...).
            ref_logps: reference log-probs for the KL term.
            advantages: one value per sequence or per token; ``None`` returns a graph-attached 0.
        """
        num, den = self.terms(inputs, outputs, old_logps=old_logps, ref_logps=ref_logps, advantages=advantages)
        return safe_ratio(num, den).to(_result_dtype(outputs))


class GSPOLoss(GRPOLoss):
    """GSPO: the PPO clip on the sequence geometric-mean ratio ``exp(Σ_t w·m / max(1, n))``, broadcast.

    Same constructor and aggregation as :class:`GRPOLoss`; the KL term stays per token. The GSPO paper uses
    ε = 3e-4 / 4e-4; the default here is twinkle's 0.2.
    """

    variant = "gspo"


class BNPOLoss(GRPOLoss):
    """BNPO: the GRPO per-token loss averaged over all valid tokens of the batch (TRL ``bnpo``)."""

    variant = "bnpo"


class CISPOLoss(GRPOLoss):
    """CISPO: ``−sg(min(r, 1 + clip_range_high))·A·ℓ`` over the valid-token count (MiniMax-M1).

    twinkle caps at ``1 + epsilon``; with the default ``clip_range_high = clip_range`` the two agree.
    """

    variant = "cispo"


class SAPOLoss(GRPOLoss):
    """SAPO: soft gate ``−σ(τ(r − 1))·4/τ·A`` (τ = ``tau_pos`` where A > 0, else ``tau_neg``).

    Extra keywords: ``tau=1.0`` (seed), ``tau_pos``/``tau_neg`` (default ``tau``; TRL and AReaL default
    ``tau_neg`` to 1.05, twinkle to 1.0). Aggregation as :class:`GRPOLoss`; ``clip_range`` is accepted but
    does not enter the formula.
    """

    variant = "sapo"

    def __init__(
        self,
        *,
        tau: float = 1.0,
        tau_pos: float | None = None,
        tau_neg: float | None = None,
        clip_range: float = _UNSET,
        beta: float = 0.0,
        clip_range_high: float | None = _UNSET,
        epsilon: float = _UNSET,
        epsilon_high: float | None = _UNSET,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(
            clip_range=clip_range,
            beta=beta,
            clip_range_high=clip_range_high,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            entropy_coef=entropy_coef,
            ignore_index=ignore_index,
        )
        base = check_real(tau, "tau", minimum=0.0, strict=True)
        self.tau_pos = base if tau_pos is None else check_real(tau_pos, "tau_pos", minimum=0.0, strict=True)
        self.tau_neg = base if tau_neg is None else check_real(tau_neg, "tau_neg", minimum=0.0, strict=True)


class DRGRPOLoss(GRPOLoss):
    """Dr. GRPO ("GRPO Done Right"): ``Σ L_tok·m / (S·max_completion_length)``, default length 1024.

    ``S`` counts sequences after splitting packed rows (twinkle); TRL's default length is 512.
    """

    variant = "dr_grpo"

    def __init__(
        self,
        *,
        max_completion_length: int = 1024,
        clip_range: float = _UNSET,
        beta: float = 0.0,
        clip_range_high: float | None = _UNSET,
        epsilon: float = _UNSET,
        epsilon_high: float | None = _UNSET,
        entropy_coef: float = 0.0,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(
            clip_range=clip_range,
            beta=beta,
            clip_range_high=clip_range_high,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            entropy_coef=entropy_coef,
            ignore_index=ignore_index,
        )
        mcl = max_completion_length
        if isinstance(mcl, bool) or not isinstance(mcl, int) or mcl <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {mcl!r}")
        self.max_completion_length = mcl
