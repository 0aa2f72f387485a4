"""Proximal-policy approximation: AReaL's version interpolation and its error against the recomputed truth.

AReaL's decoupled PPO loss needs the proximal log-probs ℓp (the policy one update behind the current
one). With ``prox_logp_method="loglinear"`` AReaL skips the proximal forward pass and *interpolates* ℓp
between the behaviour log-probs ℓb (``old_logp``, from the inference engine) and the current log-probs ℓθ
(``logprobs``) by policy version (AReaL ``areal/trainer/ppo/actor.py::compute_prox_logp_approximations``,
PR #600)::

    v_θ = current_version,  v_prox = v_θ − 1,  v_b = versions            (per token)
    α   = clamp((v_prox − v_b) / (v_θ − v_b), 0, 1)   where v_θ − v_b > 0 and v_b ≥ 0, else α = 0
    loglinear:  ℓb + α·(ℓθ − ℓb)                       (geometric interpolation of the probabilities)
    linear:     log((1 − α)·e^ℓb + α·e^ℓθ + 1e−10)     (arithmetic interpolation of the probabilities)
    rollout:    ℓb                                     (no correction at all)

With ``prox_logp_method="metrics"`` AReaL still recomputes ℓp and logs how far each approximation is
from it (``ppo_actor/update/compute_logp/<method>/<key>``). :func:`prox_approximation_errors` computes the
same per-token errors; :func:`reduce_prox_errors` reduces them over a mask in float64.

Everything here is detached (AReaL feeds ``logprobs.detach()``: the proximal policy is a constant of the
loss), pure torch, device-agnostic, and accepts packed ``[N]`` tokens (with ``cu_seqlens`` where
per-sequence values must be broadcast) or padded ``[B, T]`` rows. Elementwise math runs in the promoted
dtype of the log-probs; float16 and bfloat16 go through float32 (AReaL's 1e−8 and 1e−10 would underflow in
float16), so results are float32 then.

Example:
    >>> import math, torch
    >>> old, new = torch.tensor([math.log(0.2)]), torch.tensor([math.log(0.6)])
    >>> approx = compute_prox_logp_approximations(old, new, torch.tensor([3]), current_version=5)
    >>> round(approx["loglinear"].exp().item(), 4), round(approx["linear"].exp().item(), 4)  # α = (4-3)/(5-3)
    (0.3464, 0.4)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from grpo_cli._choices import PROX_APPROX_METHODS
from grpo_cli.core._loss_common import fill_outside
from grpo_cli.core.packing import broadcast_to_tokens

__all__ = [
    "LINEAR_PROB_EPS",
    "PROX_APPROX_METHODS",
    "PROX_ERROR_KEYS",
    "REL_ERROR_EPS",
    "broadcast_current_version",
    "compute_prox_logp_approximations",
    "prox_approximation_errors",
    "prox_importance_weights",
    "prox_interpolation_alpha",
    "reduce_prox_errors",
]


LINEAR_PROB_EPS: float = 1e-10
"""Added to the interpolated probability before the log in ``linear`` (AReaL's literal ``1e-10``)."""

REL_ERROR_EPS: float = 1e-8
"""Added to ``|truth|`` in relative errors (AReaL ``actor.py::_EPSILON``)."""

PROX_ERROR_KEYS: tuple[str, ...] = (
    "abs_error",
    "rel_error",
    "squared_error",
    "behave_imp_weight_abs_error",
    "behave_imp_weight_rel_error",
    "importance_weight_abs_error",
    "importance_weight_rel_error",
)
"""Keys of :func:`prox_approximation_errors`; AReaL logs each as ``compute_logp/<method>/<key>``."""


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """Promoted floating dtype of ``tensors``; 16-bit floats compute in float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"log-probs must be floating point tensors, got dtype {dtype}")
    return torch.float32 if torch.finfo(dtype).bits < 32 else dtype


def _check_same_shape(**tensors: Tensor) -> torch.Size:
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if any(s != first for s in shapes.values()):
        raise ValueError(f"shapes differ: {shapes}")
    if len(first) not in (1, 2):
        raise ValueError(f"expected packed [N] or padded [B, T] tensors, got shape {first}")
    return torch.Size(first)


def _as_bool_mask(mask: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor:
    """The mask as bool (non-bool masks mean ``mask != 0``); ``None`` means every position counts."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from the log-probs' {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _resolve_methods(method: str | Iterable[str] | None) -> tuple[str, ...]:
    if method is None:
        return PROX_APPROX_METHODS
    names = (method,) if isinstance(method, str) else tuple(method)
    bad = [m for m in names if m not in PROX_APPROX_METHODS]
    if bad or not names:
        valid = ", ".join(PROX_APPROX_METHODS)
        raise ValueError(f"unknown proximal approximation method(s) {bad or names!r}; valid: {valid}")
    return tuple(dict.fromkeys(names))  # de-duplicate, keep the caller's order


def broadcast_current_version(
    current_version: int | Tensor,
    versions: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The current policy version v_θ of every token, shaped like ``versions``.

    Accepted forms of ``current_version``:

    - a Python ``int`` or a 0-d tensor: one version for the whole batch (AReaL's ``engine.get_version()``);
    - a tensor shaped like ``versions``: already per token;
    - padded ``[B, T]`` input: a ``[B]`` tensor, one version per row;
    - packed ``[N]`` input: a ``[B]`` tensor, one version per sequence, together with ``cu_seqlens``
      (``[B + 1]``). When ``cu_seqlens`` is given a length-``B`` tensor is always read per sequence.

    Args:
        current_version: the version(s) of the weights being trained (v_θ).
        versions: per-token behaviour versions v_b, ``[N]`` or ``[B, T]``.
        cu_seqlens: packed sequence offsets, only for packed input with a per-sequence ``current_version``.

    Returns:
        A tensor of ``versions.shape`` on ``versions.device`` (int64 for an ``int``, else the tensor's dtype).

    Example:
        >>> cu = torch.tensor([0, 1, 3])
        >>> broadcast_current_version(torch.tensor([5, 2]), torch.zeros(3), cu_seqlens=cu)
        tensor([5, 2, 2])
    """
    if not isinstance(versions, Tensor):
        raise TypeError(f"versions must be a torch.Tensor, got {type(versions).__name__}")
    if versions.ndim not in (1, 2):
        raise ValueError(f"versions must be packed [N] or padded [B, T], got shape {tuple(versions.shape)}")
    if cu_seqlens is not None:
        if versions.ndim != 1:
            raise ValueError("cu_seqlens is only meaningful for packed 1-D input")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}")
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != versions.numel():
            raise ValueError(
                f"cu_seqlens must run from 0 to the token count {versions.numel()}, "
                f"got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
            )
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")

    if isinstance(current_version, bool) or not isinstance(current_version, (int, Tensor)):
        raise TypeError(f"current_version must be an int or a tensor, got {type(current_version).__name__}")
    if isinstance(current_version, int):
        return torch.full_like(versions, current_version, dtype=torch.int64)
    cv = current_version.to(versions.device)
    if cv.dtype == torch.bool or cv.is_complex():
        raise TypeError(f"current_version must be a real-valued tensor, got dtype {cv.dtype}")
    if cv.ndim == 0:
        return cv.expand(versions.shape)
    if versions.ndim == 1 and cu_seqlens is not None:
        n_seq = cu_seqlens.numel() - 1
        if tuple(cv.shape) != (n_seq,):
            raise ValueError(
                f"with cu_seqlens, current_version must be per sequence [{n_seq}], got shape {tuple(cv.shape)}"
            )
        return broadcast_to_tokens(cv, cu_seqlens.to(versions.device), versions.numel())
    if cv.shape == versions.shape:
        return cv
    if versions.ndim == 2 and tuple(cv.shape) == (versions.shape[0],):
        return cv.unsqueeze(1).expand(versions.shape)
    expected = (
        f"[{versions.shape[0]}] per row or {list(versions.shape)} per token"
        if versions.ndim == 2
        else f"[{versions.numel()}] per token, or [B] per sequence together with cu_seqlens="
    )
    raise ValueError(f"current_version of shape {list(cv.shape)} does not fit versions; expected {expected}")


def prox_interpolation_alpha(
    versions: Tensor,
    current_version: int | Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """AReaL's interpolation weight α of every token (``compute_prox_logp_approximations``, actor.py).

    α = (v_prox − v_b) / (v_θ − v_b) with v_prox = v_θ − 1, set to 0 for prompt tokens (v_b < 0) and where
    v_θ − v_b ≤ 0, then clamped to [0, 1]. For integer versions and a lag k = v_θ − v_b ≥ 1 this is
    α = (k − 1)/k: 0 when the token was sampled by the proximal policy itself, → 1 as the lag grows.

    Args:
        versions: per-token behaviour versions v_b (prompt tokens < 0), ``[N]`` or ``[B, T]``.
        current_version: v_θ, see :func:`broadcast_current_version`.
        cu_seqlens: packed offsets for a per-sequence ``current_version`` on packed input.
        dtype: floating dtype of the computation and result. AReaL computes in float32.

    Returns:
        α with ``versions.shape``, in ``dtype``.

    Example:
        >>> prox_interpolation_alpha(torch.tensor([-1, 4, 3, 1, 5]), 5).tolist()  # prompt, lag 1, 2, 4, 0
        [0.0, 0.0, 0.5, 0.75, 0.0]
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating point, got {dtype}")
    v_theta = broadcast_current_version(current_version, versions, cu_seqlens=cu_seqlens).to(dtype)
    v_behave = versions.to(dtype)
    v_prox = v_theta - 1  # AReaL's assumption: the proximal policy is the last published one
    version_diff = v_theta - v_behave
    interpolate = (version_diff > 0) & (v_behave >= 0)
    # the division is done only where it is defined; elsewhere α = 0 (prompt tokens, v_θ ≤ v_b)
    alpha = torch.where(
        interpolate,
        (v_prox - v_behave) / torch.where(interpolate, version_diff, 1),
        torch.zeros_like(v_behave),
    )
    return alpha.clamp(0.0, 1.0)


def compute_prox_logp_approximations(
    old_logp: Tensor,
    logprobs: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    method: str | Iterable[str] | None = None,
    *,
    cu_seqlens: Tensor | None = None,
) -> dict[str, Tensor]:
    """Approximate the proximal log-probs ℓp from ℓb, ℓθ and versions, as AReaL does (PR #600).

    With α from :func:`prox_interpolation_alpha`:

    - ``loglinear``: ℓb + α·(ℓθ − ℓb)  (what AReaL trains with under ``prox_logp_method="loglinear"``)
    - ``linear``:    log((1 − α)·e^ℓb + α·e^ℓθ + 1e−10)  (1e−10 is added even where α = 0, as in AReaL)
    - ``rollout``:   ℓb

    Where α = 0 (prompt tokens, v_θ ≤ v_b, lag 1) the ℓθ term is dropped with ``torch.where`` rather than
    multiplied by 0: bit-identical to AReaL for finite inputs, but garbage ℓθ (−inf, NaN) at prompt or padding
    positions cannot turn ℓp into NaN there. Inputs are detached.

    Args:
        old_logp: behaviour log-probs ℓb (AReaL ``old_logp``), ``[N]`` or ``[B, T]``.
        logprobs: current-policy log-probs ℓθ (AReaL ``logprobs``), same shape.
        versions: per-token behaviour versions v_b (< 0 for prompt tokens), same shape.
        current_version: v_θ: an ``int``, or a tensor (see :func:`broadcast_current_version`).
        method: one of :data:`PROX_APPROX_METHODS`, an iterable of them, or ``None`` for all.
        cu_seqlens: packed offsets, needed only for a per-sequence ``current_version`` on packed input.

    Returns:
        ``{method: tensor}`` with the input shape, in the compute dtype (float32 for 16-bit inputs).

    Raises:
        ValueError: unknown method (the message lists the valid ones), mismatched shapes, bad versions.
        TypeError: non-tensor inputs or a non-integer ``current_version``.

    Example:
        >>> out = compute_prox_logp_approximations(
        ...     torch.tensor([-2.0, -2.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-1, 3]), 5, "loglinear")
        >>> out["loglinear"].tolist()  # prompt token keeps ℓb; lag 2 gives α = 1/2
        [-2.0, -1.5]
    """
    _check_same_shape(old_logp=old_logp, logprobs=logprobs, versions=versions)
    methods = _resolve_methods(method)
    dtype = _compute_dtype(old_logp, logprobs)
    old = old_logp.detach().to(dtype)
    new = logprobs.detach().to(dtype)
    alpha = prox_interpolation_alpha(versions.detach(), current_version, cu_seqlens=cu_seqlens, dtype=dtype)
    moves = alpha > 0

    out: dict[str, Tensor] = {}
    for m in methods:
        if m == "loglinear":
            # AReaL: old_logp + alpha * (logprobs - old_logp)
            out[m] = torch.where(moves, old + alpha * (new - old), old)
        elif m == "linear":
            # AReaL: log((1 - alpha) * exp(old_logp) + alpha * exp(logprobs) + 1e-10)
            p_mix = (1 - alpha) * old.exp() + torch.where(moves, alpha * new.exp(), torch.zeros_like(alpha))
            out[m] = torch.log(p_mix + LINEAR_PROB_EPS)
        else:  # rollout — AReaL: old_logp.clone()
            out[m] = old.clone()
    return out


def prox_importance_weights(
    prox_logp: Tensor, old_logp: Tensor, logprobs: Tensor, mask: Tensor | None = None
) -> dict[str, Tensor]:
    """The two importance weights the decoupled PPO loss builds from a proximal log-prob ℓp.

    - ``behave_imp_weight`` = exp(ℓp − ℓb): the π_prox/π_behave correction
      (AReaL ``compute_logp/<m>/behave_imp_weight``);
    - ``importance_weight`` = exp(ℓθ − ℓp): the PPO ratio π_θ/π_prox
      (AReaL ``compute_logp/<m>/importance_weight``).

    Args:
        prox_logp: ℓp (an approximation or the recomputed truth).
        old_logp: ℓb.
        logprobs: ℓθ.
        mask: positions to keep (bool, or ``!= 0``); the others are set to 0 with ``torch.where``.
            ``None`` keeps all.

    Returns:
        ``{"behave_imp_weight": ..., "importance_weight": ...}`` in the compute dtype, detached.
    """
    shape = _check_same_shape(prox_logp=prox_logp, old_logp=old_logp, logprobs=logprobs)
    keep = _as_bool_mask(mask, shape, prox_logp.device)
    dtype = _compute_dtype(prox_logp, old_logp, logprobs)
    prox, old, new = (t.detach().to(dtype) for t in (prox_logp, old_logp, logprobs))
    zero = torch.zeros((), dtype=dtype, device=prox.device)
    return {
        "behave_imp_weight": fill_outside(keep, torch.exp(prox - old), zero),
        "importance_weight": fill_outside(keep, torch.exp(new - prox), zero),
    }


def _abs_rel_squared(truth: Tensor, approx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """AReaL ``actor.py::_compute_approximation_errors``: |d|, |d / (|t| + 1e−8)|, d², d = t − approx."""
    diff = truth - approx
    abs_error = diff.abs()
    # |d / (|t| + ε)| == |d| / (|t| + ε) bit for bit: the denominator is positive and division's sign is exact
    return abs_error, abs_error / (truth.abs() + REL_ERROR_EPS), diff * diff


def prox_approximation_errors(
    approx_logp: Tensor,
    true_prox_logp: Tensor,
    old_logp: Tensor,
    logprobs: Tensor,
    mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-token error of an approximated ℓp against the recomputed truth (AReaL's ``metrics`` mode).

    With ℓp* = ``true_prox_logp``, ℓp̂ = ``approx_logp``, d = ℓp* − ℓp̂ and AReaL's ε = 1e−8
    (``_compute_approximation_errors`` in actor.py); each key is AReaL's ``compute_logp/<method>/<key>``:

    - ``abs_error``: |d|
    - ``rel_error``: |d| / (|ℓp*| + ε), a *fraction* (AReaL's docs call it "%", the code logs a fraction)
    - ``squared_error``: d²
    - ``behave_imp_weight_abs_error``: |w* − ŵ| with w = exp(ℓp − ℓb) (truth vs approximation)
    - ``behave_imp_weight_rel_error``: |w* − ŵ| / (|w*| + ε)
    - ``importance_weight_abs_error``: |r* − r̂| with r = exp(ℓθ − ℓp)
    - ``importance_weight_rel_error``: |r* − r̂| / (|r*| + ε)

    The weights come from :func:`prox_importance_weights`.

    The tensors are per token so a streaming caller can reduce them itself (float64 sums, max, quantiles);
    :func:`reduce_prox_errors` does it for one in-memory batch. Positions outside ``mask`` hold 0, set with
    ``torch.where``, so NaN/inf garbage there never reaches a sum; the caller still needs the mask for counts.
    AReaL reduces these over ``behave_mask`` under rejection sampling, else over the loss mask.

    Args:
        approx_logp: the approximation ℓp̂ (e.g. one value of :func:`compute_prox_logp_approximations`).
        true_prox_logp: the recomputed proximal log-probs ℓp* (AReaL ``prox_logp_gt``).
        old_logp: behaviour log-probs ℓb.
        logprobs: current-policy log-probs ℓθ.
        mask: valid positions (bool, or ``!= 0``); ``None`` means all.

    Returns:
        ``{key: tensor}`` for every key in :data:`PROX_ERROR_KEYS`, input-shaped, compute dtype, detached.

    Example:
        >>> e = prox_approximation_errors(torch.tensor([-1.5]), torch.tensor([-1.0]),
        ...                               torch.tensor([-2.0]), torch.tensor([-1.0]))
        >>> e["abs_error"].item(), e["rel_error"].item(), e["squared_error"].item()
        (0.5, 0.5, 0.25)
    """
    shape = _check_same_shape(
        approx_logp=approx_logp, true_prox_logp=true_prox_logp, old_logp=old_logp, logprobs=logprobs
    )
    keep = _as_bool_mask(mask, shape, approx_logp.device)
    dtype = _compute_dtype(approx_logp, true_prox_logp, old_logp, logprobs)
    inputs = (approx_logp, true_prox_logp, old_logp, logprobs)
    approx, truth, old, new = (t.detach().to(dtype) for t in inputs)

    w_approx = prox_importance_weights(approx, old, new)
    w_truth = prox_importance_weights(truth, old, new)
    abs_e, rel_e, sq_e = _abs_rel_squared(truth, approx)
    b_abs, b_rel, _ = _abs_rel_squared(w_truth["behave_imp_weight"], w_approx["behave_imp_weight"])
    i_abs, i_rel, _ = _abs_rel_squared(w_truth["importance_weight"], w_approx["importance_weight"])

    zero = torch.zeros((), dtype=dtype, device=approx.device)
    per_token = dict(zip(PROX_ERROR_KEYS, (abs_e, rel_e, sq_e, b_abs, b_rel, i_abs, i_rel), strict=True))
    return {key: fill_outside(keep, value, zero) for key, value in per_token.items()}


def reduce_prox_errors(errors: Mapping[str, Tensor], mask: Tensor | None = None) -> dict[str, float]:
    """Float64 mean and max over ``mask`` of each per-token tensor, and ``rmse`` from ``squared_error``.

    Like AReaL's ``stats_tracker`` ``avg``/``max`` over the ``n_valid_tokens`` denominator, for one batch
    held in memory.
    Masked positions are excluded with ``torch.where`` (never multiplied), so NaN there does not leak.

    Args:
        errors: per-token tensors, e.g. from :func:`prox_approximation_errors`.
        mask: the valid positions (bool, or ``!= 0``); ``None`` means all.

    Returns:
        ``{f"{key}_mean": float, f"{key}_max": float, ...}`` and ``"rmse"`` = sqrt(mean squared error).
        With no valid position the result is empty (absent, never 0).

    Example:
        >>> errors = {"abs_error": torch.tensor([0.5, 9.0, 0.25])}
        >>> reduce_prox_errors(errors, torch.tensor([True, False, True]))
        {'abs_error_mean': 0.375, 'abs_error_max': 0.5}
    """
    if not errors:
        return {}
    first = next(iter(errors.values()))
    keep = _as_bool_mask(mask, first.shape, first.device)
    n_valid = keep.sum()
    if int(n_valid) == 0:
        return {}
    names: list[str] = []
    values: list[Tensor] = []
    for key, value in errors.items():
        if tuple(value.shape) != tuple(keep.shape):
            raise ValueError(f"errors[{key!r}] has shape {tuple(value.shape)}, the mask {tuple(keep.shape)}")
        v = value.detach()
        total = fill_outside(keep, v, torch.zeros((), dtype=v.dtype, device=v.device)).sum(dtype=torch.float64)
        peak = fill_outside(keep, v, torch.full((), float("-inf"), dtype=v.dtype, device=v.device)).amax()
        mean = total / n_valid
        names += [f"{key}_mean", f"{key}_max"]
        values += [mean, peak.to(torch.float64)]
        if key == "squared_error":
            names.append("rmse")
            values.append(mean.sqrt())
    # one device→host transfer for all figures
    return dict(zip(names, torch.stack(values).tolist(), strict=True))
