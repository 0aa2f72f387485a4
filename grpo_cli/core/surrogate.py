"""The clipped GRPO surrogate: token ratios, PPO clip, masked means, clip fraction."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_cli.core._loss_common import check_real, compute_dtype

__all__ = ["clipped_grpo_surrogate"]

# The log-ratio is bounded to ±60 before exp, so exp never overflows float32/bfloat16.
LOG_RATIO_BOUND = 60.0

ArrayLike = Tensor | Sequence


def _to_tensor(x: ArrayLike, name: str, device: torch.device | None, dtype: torch.dtype | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x if device is None else x.to(device)
    try:
        return torch.as_tensor(x, device=device, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a tensor or a rectangular nested list of numbers: {exc}") from exc


def _float_dtype(t: Tensor) -> torch.dtype:
    # Lists of ints (e.g. [[0, 0]]) become int64 tensors; log-probs are then read in the default float dtype.
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


def clipped_grpo_surrogate(
    new_log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    token_mask: ArrayLike,
    clip_epsilon: float,
) -> dict[str, Tensor]:
    """Clipped GRPO surrogate over the selected response tokens.

    For sequence ``i`` and token ``t``: ``r = exp(clip(new - old, -60, 60))`` and
    ``s = min(r * A_i, clip(r, 1 - eps, 1 + eps) * A_i)``. The loss is ``-mean(s)`` over the selected tokens;
    ``per_sequence_surrogate[i]`` is the mean of ``s`` over sequence ``i``'s selected tokens (0 when it has
    none); ``clipped_fraction`` is the share of selected ratios strictly outside ``[1 - eps, 1 + eps]``.
    With no token selected, ``loss`` and ``clipped_fraction`` are 0.

    Precision: elementwise math runs in the log-probs' dtype (float16 via float32), the clip bounds are
    rounded to that dtype before comparing (so a ratio of exactly ``float32(1.2)`` is not clipped), and sums
    are accumulated in float64. Masked positions are neutralised with ``torch.where``, so NaN/inf there never
    leaks into a result or a gradient.

    Args:
        new_log_probs: ``(B, T)`` current log-probs (tensor or nested list); gradients flow into it.
        old_log_probs: ``(B, T)`` behaviour log-probs.
        advantages: ``(B,)``, ``(B, 1)`` (broadcast over the sequence) or ``(B, T)``.
        token_mask: ``(B, T)`` bool or 0/1 selection of response tokens.
        clip_epsilon: clip width ``eps >= 0``.

    Returns:
        ``{"loss": scalar, "per_sequence_surrogate": (B,), "clipped_fraction": scalar}``, all with the
        log-probs' dtype and device: a tensor's dtype (the promoted dtype when both are tensors; a list
        paired with a tensor takes that tensor's dtype; the default float dtype when both are lists).

    Raises:
        ValueError: shapes that do not match, a mask with values other than 0/1, a negative or non-finite
            ``clip_epsilon``.
        TypeError: ``clip_epsilon`` that is not a real number.

    Example:
        >>> out = clipped_grpo_surrogate([[0.0, 0.0]], [[0.0, 0.0]], [2.0], [[True, False]], 0.2)
        >>> out["loss"].item(), out["per_sequence_surrogate"].tolist(), out["clipped_fraction"].item()
        (-2.0, [2.0], 0.0)
    """
    eps = check_real(clip_epsilon, "clip_epsilon", minimum=0.0)
    device = next(
        (x.device for x in (new_log_probs, old_log_probs, advantages, token_mask) if isinstance(x, Tensor)),
        None,
    )
    new = _to_tensor(new_log_probs, "new_log_probs", device)
    old = _to_tensor(old_log_probs, "old_log_probs", device)
    # A list of log-probs takes the dtype of the tensor it is paired with (bf16 new + list old stays bf16).
    if isinstance(new_log_probs, Tensor) and not isinstance(old_log_probs, Tensor):
        old = old.to(_float_dtype(new))
    elif isinstance(old_log_probs, Tensor) and not isinstance(new_log_probs, Tensor):
        new = new.to(_float_dtype(old))
    # Lists of advantages are read in float64 (not the default float32) so no precision is lost before the
    # cast to the working dtype below.
    adv = _to_tensor(advantages, "advantages", device, torch.float64)
    mask = _to_tensor(token_mask, "token_mask", device)

    if new.ndim != 2:
        raise ValueError(f"new_log_probs must have shape (batch, tokens), got {tuple(new.shape)}")
    if old.shape != new.shape:
        raise ValueError(f"old_log_probs shape {tuple(old.shape)} != new_log_probs shape {tuple(new.shape)}")
    if mask.shape != new.shape:
        raise ValueError(f"token_mask shape {tuple(mask.shape)} != new_log_probs shape {tuple(new.shape)}")
    b, t = new.shape
    if adv.shape == (b,):
        adv = adv.unsqueeze(1)
    elif adv.shape not in ((b, 1), (b, t)):
        raise ValueError(f"advantages must have shape ({b},), ({b}, 1) or ({b}, {t}), got {tuple(adv.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_complex() or (mask.numel() and bool(((mask != 0) & (mask != 1)).any())):
            raise ValueError("token_mask must be bool or hold only 0/1 values")
        mask = mask != 0

    out_dtype = torch.promote_types(_float_dtype(new), _float_dtype(old))
    cd = compute_dtype(out_dtype)
    new, old = new.to(cd), old.to(cd)
    adv = torch.where(mask, adv.to(cd).expand(b, t), torch.zeros((), dtype=cd, device=new.device))

    zero = torch.zeros((), dtype=cd, device=new.device)
    log_ratio = torch.where(mask, new - old, zero).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    # Bounds rounded to the working dtype: the comparison and the clamp see the same numbers.
    lo = torch.tensor(1.0 - eps, dtype=cd, device=new.device)
    hi = torch.tensor(1.0 + eps, dtype=cd, device=new.device)
    # PPO's clipped surrogate (Schulman et al. 2017, Eq. 7): s = min(r·A, clip(r, 1 - eps, 1 + eps)·A).
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    surrogate = torch.where(mask, surrogate, zero)

    counts = mask.sum(dim=1)
    row_sums = surrogate.to(torch.float64).sum(dim=1)
    per_seq = torch.where(counts > 0, row_sums / counts.clamp(min=1), torch.zeros_like(row_sums))
    n_sel = counts.sum()
    total = row_sums.sum()
    zero64 = torch.zeros((), dtype=torch.float64, device=new.device)
    loss = torch.where(n_sel > 0, -total / n_sel.clamp(min=1), zero64)
    outside = ((ratio < lo) | (ratio > hi)) & mask
    clipped_fraction = torch.where(n_sel > 0, outside.sum() / n_sel.clamp(min=1).to(torch.float64), zero64)
    return {
        "loss": loss.to(out_dtype),
        "per_sequence_surrogate": per_seq.to(out_dtype),
        "clipped_fraction": clipped_fraction.to(out_dtype),
    }
