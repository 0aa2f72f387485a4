"""Figures exactly as the peers log them, as pure batch functions (one call = one logged step).

Each function reproduces one peer's definition, including its quirks, so that a figure shown under the peer's
name can be compared with the peer's own logs; ``docs/peers.md`` lists them and the conformance tier
(``tests/peers``) runs the peers' released code against them. Conventions: padded ``[B, T]`` inputs with a bool
(or 0/1) mask; elementwise math in the log-probs' dtype (float16 through float32), sums in float64, masked
positions neutralised with ``torch.where`` (the peers multiply by the mask, which only differs where the masked
entries hold inf/NaN). Results are Python floats keyed by the peer's logged key (without its prefix:
``rollout_corr/``, ``actor/``, ``ppo_actor/update/``, ...).

Sources (public repositories, at the pinned releases of :data:`~grpo_cli.core.conventions.PEER_RELEASES`):

- verl ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_vanilla``, ``compute_policy_loss_cispo``,
  ``agg_loss``, ``kl_penalty``), ``verl/trainer/ppo/rollout_corr_helper.py``
  (``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_offpolicy_metrics``),
  ``verl/trainer/ppo/metric_utils.py`` (``compute_data_metrics``);
- TRL ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``, ``_generate_and_score_completions``);
- AReaL ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``, ``_log_proximal_approximation_stats``,
  ``_log_version_staleness_stats``) and ``areal/utils/stats_tracker.py`` (``avg``/``min``/``max`` reductions).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_cli._choices import TRL_VLLM_IS_MODES, VERL_RS_OPTIONS
from grpo_cli.core._loss_common import (
    as_bool_mask,
    check_real,
    check_same_shape,
    compute_dtype,
)
from grpo_cli.core.aggregate import aggregate_loss
from grpo_cli.core.kl import kl_estimate
from grpo_cli.core.ppo import ppo_actor_loss
from grpo_cli.core.rejection import RejectionSamplingConfig

__all__ = [
    "VERL_RS_OPTIONS",
    "VERL_SAFETY_BOUND",
    "areal_actor_stats",
    "areal_kl_div_stats",
    "areal_token_stats",
    "areal_version_stats",
    "trl_cispo_clip_ratio",
    "trl_clip_ratio_metrics",
    "trl_logged_kl",
    "trl_sampling_metrics",
    "verl_data_metrics",
    "verl_is_threshold",
    "verl_kl_penalty",
    "verl_offpolicy_metrics",
    "verl_policy_loss",
    "verl_rollout_is",
    "verl_rollout_rs",
    "verl_rs_options",
    "verl_rs_thresholds",
]

VERL_SAFETY_BOUND = 20.0
"""verl's ``SAFETY_BOUND``: log-ratios are clamped to ±20 before ``exp`` in the rollout-correction helper."""

_F64 = torch.float64


# ------------------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------------------


def _prepare(ref: Tensor, mask: Tensor, **others: Tensor | None) -> tuple[Tensor, torch.dtype]:
    if not isinstance(ref, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(ref).__name__}")
    if ref.ndim != 2:
        raise ValueError(f"expected padded [B, T] tensors, got shape {tuple(ref.shape)}")
    m = as_bool_mask(mask, "mask")
    check_same_shape("log_probs", ref, mask=m, **others)
    return m, compute_dtype(ref.dtype)


def _where(mask: Tensor, x: Tensor, fill: float = 0.0) -> Tensor:
    return torch.where(mask, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """Σ x·m / Σ m over everything (float64), 0 for an empty mask (verl divides by Σm + 1e-8)."""
    n = int(mask.sum())
    return float(_where(mask, x).to(_F64).sum() / n) if n else 0.0


def _row_sums(x: Tensor, mask: Tensor) -> Tensor:
    return _where(mask, x).to(_F64).sum(-1)


def _row_means(x: Tensor, mask: Tensor) -> Tensor:
    """Per-row masked means in float64; a row without valid tokens gives 0 (verl's ``masked_mean(axis=-1)``)."""
    n = mask.sum(-1).to(_F64)
    return _row_sums(x, mask) / n.clamp(min=1.0)


def _masked_max(x: Tensor, mask: Tensor) -> float:
    return float(_where(mask, x.to(_F64), -math.inf).max()) if x.numel() else -math.inf


def _masked_min(x: Tensor, mask: Tensor) -> float:
    return float(_where(mask, x.to(_F64), math.inf).min()) if x.numel() else math.inf


# ------------------------------------------------------------------------------------------------------------
# verl
# ------------------------------------------------------------------------------------------------------------

_VERL_LOSSES = ("vanilla", "cispo")


def verl_policy_loss(
    variant: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    convention: str | None = "verl",
) -> tuple[Tensor, dict[str, float]]:
    """verl's ``vanilla`` (PPO with dual clip) and ``cispo`` policy losses and their ``actor/*`` metrics.

    ``log r = clamp(ℓ − ℓ_old, −20, 20)``, ``r = exp(log r)``.

    - ``vanilla`` (``compute_policy_loss_vanilla``): ``L1 = −A·r``, ``L2 = −A·clip(r, 1 − ε_l, 1 + ε_h)``,
      ``Lc = max(L1, L2)``; where ``A < 0`` the dual clip ``min(−A·c, Lc)``. Metrics ``pg_clipfrac`` =
      masked mean ``[L2 > L1]``, ``pg_clipfrac_lower`` = masked mean ``[Lc > −A·c ∧ A < 0]``.
    - ``cispo`` (``compute_policy_loss_cispo``): ``−sg(clip(r, 1 − ε_l, 1 + ε_h))·A·ℓ`` (two-sided);
      ``pg_clipfrac`` = masked mean ``[r ≠ clip(r)]``, ``pg_clipfrac_lower`` = 0.
    - both: ``ppo_kl`` = masked mean of ``−log r`` (after the clamp); the per-token loss times
      ``rollout_is_weights`` when given, then :func:`~grpo_cli.core.aggregate.aggregate_loss` with
      ``loss_agg_mode`` and ``convention`` (``"verl"``: the current release's ``seq-mean-token-sum-norm``).

    Args:
        variant: ``"vanilla"`` or ``"cispo"``.
        old_log_prob: ``[B, T]`` old log-probs.
        log_prob: ``[B, T]`` current log-probs (carry the gradient).
        advantages: ``[B, T]`` per-token advantages.
        response_mask: ``[B, T]`` bool or 0/1.
        loss_agg_mode: one of :data:`~grpo_cli.core.aggregate.AGG_MODES`.
        clip_ratio_low: ε_l (verl ``clip_ratio_low``).
        clip_ratio_high: ε_h (verl ``clip_ratio_high``).
        clip_ratio_c: dual-clip constant ``c > 1`` (verl ``clip_ratio_c``, default 3).
        rollout_is_weights: optional ``[B, T]`` rollout-correction weights (detached).
        convention: passed to :func:`~grpo_cli.core.aggregate.aggregate_loss`.

    Returns:
        ``(loss, {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"})``; ``loss`` in ``log_prob``'s dtype.

    Raises:
        ValueError: an unknown variant or mode, ``clip_ratio_c <= 1``, bad shapes or mask.

    Example:
        >>> lp = torch.log(torch.tensor([[2.0, 0.5]])); old = torch.zeros(1, 2)
        >>> loss, m = verl_policy_loss("vanilla", old, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
        >>> round(loss.item(), 6), m["pg_clipfrac"]  # (-1.2 + 0.8) / 2; both tokens clipped
        (-0.2, 1.0)
    """
    if variant not in _VERL_LOSSES:
        raise ValueError(f"Unknown verl policy loss {variant!r}; choose one of {_VERL_LOSSES}")
    eps_lo = check_real(clip_ratio_low, "clip_ratio_low", minimum=0.0)
    eps_hi = check_real(clip_ratio_high, "clip_ratio_high", minimum=0.0)
    c = check_real(clip_ratio_c, "clip_ratio_c")
    if variant == "vanilla" and c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip PPO), got {c}")
    m, cd = _prepare(
        log_prob, response_mask, old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights
    )
    lp = _where(m, log_prob.to(cd))
    old = _where(m, old_log_prob.detach().to(cd))
    adv = _where(m, advantages.detach().to(cd))
    log_r = (lp - old).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    ratio = torch.exp(log_r)
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    metrics = {"ppo_kl": _masked_mean(-log_r.detach(), m)}
    if variant == "vanilla":
        loss1 = -adv * ratio
        loss2 = -adv * clipped
        clip_loss = torch.maximum(loss1, loss2)
        loss3 = -adv * c
        per_token = torch.where(adv < 0, torch.minimum(loss3, clip_loss), clip_loss)
        metrics["pg_clipfrac"] = _masked_mean((loss2 > loss1).detach(), m)
        metrics["pg_clipfrac_lower"] = _masked_mean(((clip_loss > loss3) & (adv < 0)).detach(), m)
    else:
        per_token = -clipped.detach() * adv * lp
        metrics["pg_clipfrac"] = _masked_mean((ratio != clipped).detach(), m)
        metrics["pg_clipfrac_lower"] = 0.0
    if rollout_is_weights is not None:
        per_token = per_token * _where(m, rollout_is_weights.detach().to(cd))
    loss = aggregate_loss(_where(m, per_token), m, loss_agg_mode, convention=convention)
    return loss.to(log_prob.dtype), {k: metrics[k] for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")}


_VERL_KL = {
    "kl": ("k1", None),
    "k1": ("k1", None),
    "abs": ("abs", None),
    "mse": ("k2", None),
    "k2": ("k2", None),
    "low_var_kl": ("k3", 10.0),
    "k3": ("k3", 10.0),
}


def verl_kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's ``kl_penalty`` by its names: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``
    (k3 clamped to ±10), each also with a ``+`` suffix (straight-through: the value of the kind, the gradient
    of k2). Maps onto :func:`~grpo_cli.core.kl.kl_estimate`.

    Raises:
        ValueError: an unknown name (verl raises ``NotImplementedError``, also for ``full``).

    Example:
        >>> verl_kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "low_var_kl").item()  # clamped
        10.0
    """
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if base not in _VERL_KL:
        raise ValueError(f"Unknown verl kl_penalty {kl_penalty!r}; choose one of {sorted(_VERL_KL)} (optionally +)")
    kind, clamp = _VERL_KL[base]
    return kl_estimate(logprob, ref_logprob, kind + ("+" if kl_penalty.endswith("+") else ""), clamp=clamp)


def verl_rollout_is(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    truncate: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """verl's rollout importance weights and their ``rollout_corr/rollout_is_*`` metrics.

    ``ℓ = ℓ_old − ℓ_rollout``. ``level="token"``: ``w = exp(clamp(ℓ, ±20))``; ``"sequence"``: every token of
    row ``i`` gets ``exp(clamp(Σ_t m·ℓ, ±20))``. Without ``threshold_lower`` the weights are truncated at
    ``C = threshold`` (TIS); with it, weights outside ``[threshold_lower, C]`` become 0 (IcePop). Metrics
    (``compute_is_metrics``; ``w̃`` = the truncated weights, ``lo`` = ``threshold_lower`` or ``1/C``):

    - ``rollout_is_mean`` masked mean of ``w̃``; token level: ``rollout_is_max``/``min`` over valid ``w̃``,
      ``rollout_is_ratio_fraction_high``/``low`` masked means of ``[w > C]``/``[w < lo]`` (raw ``w``);
      sequence level: max/min ``exp`` of the row log-sums (``max`` clamped at 20) and the fractions of rows
      above/below, over *all* rows (a row without valid tokens has log-sum 0).
    - ``rollout_is_std`` (0 when at most one valid token) = sqrt(masked mean ``v²`` − (masked mean ``v``)²) and
      ``rollout_is_eff_sample_size`` = 1 / masked mean ``(v / (mean v + 1e-8))²`` with ``v = min(w̃, C)``.
    - ``rollout_is_seq_{mean,std,max,min,max_deviation}`` over the per-row masked means of ``w̃`` (all rows,
      an empty row counts 0; std unbiased, 0 for one row), ``rollout_is_seq_fraction_{high,low}`` on the
      per-row means of the raw weights; ``rollout_is_oob_ratio`` (IcePop) = masked mean of ``[w ∉ [lo, C]]``.

    ``truncate=True`` is verl 0.8 and later (the statistics describe the weights the loss uses).
    ``truncate=False`` gives the statistics of the raw weights (earlier verl, and grpo-cli's ``is/*`` figures):
    mean, max, min and seq statistics of ``w``, std and ESS over ``clamp(w, lo, C)``. Example: ``w = [4, 0.25,
    1]``, ``C = 2``: mean 1.083, max 2, ESS 0.695 (truncated) against 1.75, 4, 0.778 (raw).

    Returns:
        ``(weights, metrics)``: ``weights`` ``[B, T]`` detached (0 off the mask), in the working dtype.

    Raises:
        ValueError: a bad level or threshold, an all-masked batch (verl raises too), bad shapes or mask.

    Example:
        >>> lr = torch.log(torch.tensor([[4.0, 0.25, 1.0]]))
        >>> _, m = verl_rollout_is(lr, torch.zeros(1, 3), torch.ones(1, 3))
        >>> round(m["rollout_is_mean"], 3), m["rollout_is_max"], round(m["rollout_is_eff_sample_size"], 3)
        (1.083, 2.0, 0.695)
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {level}. Must be one of {{'token', 'sequence'}}.")
    c = check_real(threshold, "threshold", minimum=0.0, strict=True)
    lo_given = None if threshold_lower is None else check_real(threshold_lower, "threshold_lower", minimum=0.0)
    lo = 1.0 / c if lo_given is None else lo_given
    m, cd = _prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = _where(m, old_log_prob.detach().to(cd) - rollout_log_prob.detach().to(cd))
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    else:
        log_for_metrics = log_ratio.to(_F64).sum(-1, keepdim=True).to(cd)
        raw = torch.exp(log_for_metrics.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).expand_as(log_ratio)
    raw = _where(m, raw)
    weights = raw.clamp(max=c) if lo_given is None else _where((raw >= lo_given) & (raw <= c), raw)
    stat_w = weights if truncate else raw
    out: dict[str, float] = {"rollout_is_mean": _masked_mean(stat_w, m)}
    if level == "sequence":
        log_c, log_lo = math.log(c), (math.log(lo) if lo > 0 else -math.inf)
        row_log = log_for_metrics.to(_F64).reshape(-1)
        out["rollout_is_max"] = math.exp(min(float(row_log.max()), VERL_SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(row_log.min()))
        out["rollout_is_ratio_fraction_high"] = float((row_log > log_c).to(_F64).mean())
        out["rollout_is_ratio_fraction_low"] = float((row_log < log_lo).to(_F64).mean())
    else:
        out["rollout_is_ratio_fraction_high"] = _masked_mean(raw > c, m)
        out["rollout_is_ratio_fraction_low"] = _masked_mean(raw < lo, m)
        out["rollout_is_max"] = _masked_max(stat_w, m)
        out["rollout_is_min"] = _masked_min(stat_w, m)
    v = weights.clamp(min=0.0, max=c) if truncate else raw.clamp(min=lo, max=c)
    mean_v = _masked_mean(v, m)
    if int(m.sum()) > 1:
        out["rollout_is_std"] = math.sqrt(max(_masked_mean(v.to(_F64) ** 2, m) - mean_v**2, 0.0))
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / _masked_mean((v.to(_F64) / (mean_v + 1e-8)) ** 2, m)
    seq = _row_means(stat_w, m)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    raw_seq = _row_means(raw, m)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > c).to(_F64).mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < lo).to(_F64).mean())
    if lo_given is not None:
        out["rollout_is_oob_ratio"] = _masked_mean((raw < lo_given) | (raw > c), m)
    return weights.detach(), out


def verl_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: ``(upper, lower)`` from a number or ``"u"`` (TIS: truncate at ``u``,
    ``lower`` None) or ``"l_u"`` (IcePop: weights outside ``[l, u]`` become 0).

    Raises:
        ValueError: not a positive number, or ``l > u`` (``rollout_corr_helper._parse_rollout_is_threshold``).

    Example:
        >>> verl_is_threshold("0.5_5"), verl_is_threshold(2)
        ((5.0, 0.5), (2.0, None))
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError("rollout_is_threshold must be a number or a string")
    text = str(spec).strip()
    try:
        lo_s, hi_s = text.split("_", 1) if "_" in text else (None, text)
        upper, lower = float(hi_s), None if lo_s is None else float(lo_s)
    except ValueError as exc:
        raise ValueError(f"Invalid rollout_is_threshold {spec!r}: a number or 'lower_upper'") from exc
    if not (math.isfinite(upper) and upper > 0):
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and not (math.isfinite(lower) and 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold lower bound must be in (0, upper], got {lower}")
    return upper, lower


def verl_rs_options(rollout_rs: str) -> list[str]:
    """verl's ``rollout_rs``: the comma-separated options in order, duplicates dropped.

    Raises:
        ValueError: an unknown option or none (``compute_rollout_rejection_mask``).

    Example:
        >>> verl_rs_options("token_k1, seq_mean_k3,token_k1")
        ['token_k1', 'seq_mean_k3']
    """
    options: list[str] = []
    for opt in (o.strip() for o in str(rollout_rs).split(",")):
        if not opt:
            continue
        if opt not in VERL_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {opt}. Must be one of {sorted(VERL_RS_OPTIONS)}.")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    return options


def verl_rs_thresholds(options: list[str], spec: str | float) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}`` from verl's ``rollout_rs_threshold`` (one entry, or one per option; a k1
    option takes ``"lower_upper"`` or ``u`` meaning ``1/u_u``, the others one upper bound).

    Raises:
        ValueError: a count that matches neither, a bound that is not positive, ``lower > upper``.

    Example:
        >>> verl_rs_thresholds(["token_k1", "seq_mean_k3"], "0.5_2,0.1")
        {'token_k1': (0.5, 2.0), 'seq_mean_k3': (None, 0.1)}
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError("rollout_rs_threshold must be a string or a number")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one threshold or {len(options)}, got {len(parts)}")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts):
        if option.endswith("k1"):
            lo_s, hi_s = part.split("_", 1) if "_" in part else (None, part)
            hi = float(hi_s)
            lo = 1.0 / hi if lo_s is None else float(lo_s)
            if lo <= 0 or hi <= 0 or lo > hi:
                raise ValueError(f"Thresholds for option '{option}' must be 0 < lower <= upper, got {part}")
            out[option] = (lo, hi)
        else:
            if "_" in part:
                raise ValueError(f"rollout_rs_threshold for option '{option}' takes a single upper bound, got {part}")
            hi = float(part)
            if hi <= 0:
                raise ValueError(f"Threshold for option '{option}' must be positive, got {part}")
            out[option] = (None, hi)
    return out


def verl_rollout_rs(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_rs: str,
    rollout_rs_threshold: str | float,
) -> tuple[Tensor, dict[str, float]]:
    """verl's rejection sampling (``compute_rollout_rejection_mask``) and its ``rollout_corr/rollout_rs_*`` metrics.

    ``ℓ = clamp(ℓ_old − ℓ_rollout, ±20)``; per token ``k1 = −ℓ`` (so k1 bounds apply to π_rollout/π_old),
    ``k2 = ℓ²/2``, ``k3 = e^ℓ − 1 − ℓ``. Options (comma-separated, all must pass): ``token_k*`` per token,
    ``seq_sum_k*``/``seq_mean_k*`` the masked sum/mean per sequence, ``seq_max_k{2,3}`` the masked max (0 for an
    empty row). k1 options keep ``log(lower) ≤ stat ≤ log(upper)`` (threshold ``"lower_upper"``, a single
    ``u`` meaning ``1/u_u``); the others keep ``stat ≤ upper``. Per option ``<o>`` (prefix ``rollout_rs_<o>``):

    - ``_mean``: masked token mean of the statistic (a sequence option's value repeated on its tokens, so
      sequences weigh by length); ``_max``/``_min``: over valid tokens (token options) or non-empty rows;
    - ``_fraction_high``/``_fraction_low`` (low only for k1, else 0): token-level masked means, or row means
      for sequence options, against the thresholds (k1 in log space);
    - ``_std``: sqrt of the masked variance of the statistic clamped to ``[lower, upper]`` (``[0, upper]``
      without a lower bound; 0 for at most one valid token);
    - ``_seq_{mean,std,max,min,max_deviation,fraction_high}`` (and ``_seq_fraction_low`` for k1) over the
      non-empty rows' values (token options: per-row masked means), std unbiased;
    - ``_masked_fraction``: masked mean of rejected tokens; ``_seq_masked_fraction``: the share of non-empty
      rows with a rejected valid token.

    Totals: ``rollout_rs_masked_fraction`` (masked token mean) and ``rollout_rs_seq_masked_fraction`` (share of
    *all* rows, empty ones included, with a rejected valid token).

    Returns:
        ``(mask, metrics)``: the response mask after rejection (bool) and the metrics.

    Raises:
        ValueError: an unknown option, bad thresholds, an all-masked batch (verl raises too), bad shapes.

    Example:
        >>> old = torch.log(torch.tensor([[1.0, 4.0, 1.0]])); roll = torch.zeros(1, 3)
        >>> m, f = verl_rollout_rs(old, roll, torch.ones(1, 3), "token_k1", "0.5_2.0")
        >>> m.tolist(), round(f["rollout_rs_token_k1_masked_fraction"], 4)  # π_roll/π_old = 1/4 < 0.5
        ([[True, False, True]], 0.3333)
    """
    options = verl_rs_options(rollout_rs)
    bounds = verl_rs_thresholds(options, rollout_rs_threshold)
    m, cd = _prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = _where(m, old_log_prob.detach().to(cd) - rollout_log_prob.detach().to(cd))
    log_ratio = log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    per_token = {"k1": -log_ratio, "k2": 0.5 * log_ratio * log_ratio, "k3": torch.expm1(log_ratio) - log_ratio}
    has = m.any(-1)
    keep_all = torch.ones_like(m)
    out: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        lo_t = math.log(lower) if k1 and lower is not None else 0.0
        hi_t = math.log(upper) if k1 else upper
        values = per_token[option[-2:]]
        if option.startswith("token"):
            stat = values
            seq_values = _row_means(stat, m)
        else:
            if option.startswith("seq_sum"):
                seq_values = _row_sums(values, m)
            elif option.startswith("seq_mean"):
                seq_values = _row_means(values, m)
            else:
                seq_values = _where(m, values.to(_F64), -math.inf).max(-1).values
                seq_values = torch.where(torch.isinf(seq_values), torch.zeros_like(seq_values), seq_values)
            stat = seq_values.to(cd)[:, None].expand_as(values)
        keep = (stat >= lo_t) & (stat <= hi_t) if k1 else stat <= hi_t
        keep_all = keep_all & keep
        p = f"rollout_rs_{option}"
        valid_seq = seq_values[has]
        sequence_level = not option.startswith("token")
        out[f"{p}_mean"] = _masked_mean(stat, m)
        if sequence_level:
            out[f"{p}_max"], out[f"{p}_min"] = float(valid_seq.max()), float(valid_seq.min())
            out[f"{p}_fraction_high"] = float((valid_seq > hi_t).to(_F64).mean())
            out[f"{p}_fraction_low"] = float((valid_seq < lo_t).to(_F64).mean()) if k1 else 0.0
        else:
            out[f"{p}_max"], out[f"{p}_min"] = _masked_max(stat, m), _masked_min(stat, m)
            out[f"{p}_fraction_high"] = _masked_mean(stat > hi_t, m)
            out[f"{p}_fraction_low"] = _masked_mean(stat < lo_t, m) if k1 else 0.0
        if int(m.sum()) > 1:
            clamped = stat.to(_F64).clamp(min=lo_t, max=hi_t)
            mean_c = _masked_mean(clamped, m)
            out[f"{p}_std"] = math.sqrt(max(_masked_mean(clamped * clamped, m) - mean_c**2, 0.0))
        else:
            out[f"{p}_std"] = 0.0
        out[f"{p}_seq_mean"] = float(valid_seq.mean())
        out[f"{p}_seq_std"] = float(valid_seq.std()) if valid_seq.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = float(valid_seq.max())
        out[f"{p}_seq_min"] = float(valid_seq.min())
        out[f"{p}_seq_max_deviation"] = float(valid_seq.abs().max())
        out[f"{p}_seq_fraction_high"] = float((valid_seq > hi_t).to(_F64).mean())
        if k1:
            out[f"{p}_seq_fraction_low"] = float((valid_seq < lo_t).to(_F64).mean())
        out[f"{p}_masked_fraction"] = _masked_mean(~keep, m)
        out[f"{p}_seq_masked_fraction"] = float((~keep & m).any(-1)[has].to(_F64).mean())
    out["rollout_rs_masked_fraction"] = _masked_mean(~keep_all, m)
    out["rollout_rs_seq_masked_fraction"] = float((~keep_all & m).any(-1).to(_F64).mean())
    return m & keep_all, out


def verl_offpolicy_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor | None, response_mask: Tensor
) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics`` (``rollout_corr/*``): perplexities, KL and χ² of π_old vs π_rollout.

    With per-row masked means ``μ_old_i``, ``μ_roll_i`` of the log-probs (a row without valid tokens gives 0 and
    still counts in every batch mean, as verl's ``masked_mean(axis=-1)``) and ``ℓ = ℓ_old − ℓ_rollout``:
    ``training_ppl`` = mean ``exp(−μ_old)``, ``training_log_ppl`` = mean ``−μ_old``; with rollout log-probs
    ``kl`` = masked mean ``(−ℓ)``, ``k3_kl`` = masked mean ``(e^ℓ − ℓ − 1)`` (never clamped: only the KL *loss*
    clamps k3), ``rollout_ppl``, ``rollout_log_ppl`` likewise, ``log_ppl_diff`` = mean ``(μ_roll − μ_old)``,
    ``log_ppl_abs_diff``, ``log_ppl_diff_max``/``min``, ``ppl_ratio`` = mean ``exp(μ_roll − μ_old)``,
    ``chi2_token`` = masked mean ``exp(2·clamp(ℓ, ±20))`` − 1, ``chi2_seq`` = mean ``exp(2·clamp(Σ_t m·ℓ, ±20))``
    − 1.

    Raises:
        ValueError: an all-masked batch (verl asserts), bad shapes or mask.

    Example:
        >>> old = torch.tensor([[-1.0, -3.0]]); roll = torch.tensor([[-1.0, -2.0]])
        >>> m = verl_offpolicy_metrics(old, roll, torch.ones(1, 2))
        >>> m["training_log_ppl"], m["rollout_log_ppl"], m["log_ppl_diff"]
        (2.0, 1.5, 0.5)
    """
    m, cd = _prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("Expected at least one valid token in response_mask")
    old = _where(m, old_log_prob.detach().to(cd))
    mu_old = _row_means(old, m)
    out = {
        "training_ppl": float(torch.exp(-mu_old).mean()),
        "training_log_ppl": float((-mu_old).mean()),
    }
    if rollout_log_prob is None:
        return out
    roll = _where(m, rollout_log_prob.detach().to(cd))
    log_ratio = old - roll
    out["kl"] = _masked_mean(-log_ratio, m)
    out["k3_kl"] = _masked_mean(torch.expm1(log_ratio) - log_ratio, m)
    mu_roll = _row_means(roll, m)
    out["rollout_ppl"] = float(torch.exp(-mu_roll).mean())
    out["rollout_log_ppl"] = float((-mu_roll).mean())
    diff = mu_roll - mu_old
    out["log_ppl_diff"] = float(diff.mean())
    out["log_ppl_abs_diff"] = float(diff.abs().mean())
    out["log_ppl_diff_max"] = float(diff.max())
    out["log_ppl_diff_min"] = float(diff.min())
    out["ppl_ratio"] = float(torch.exp(diff).mean())
    rho = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).to(_F64)
    out["chi2_token"] = _masked_mean(rho * rho, m) - 1.0
    seq_log = _row_sums(log_ratio, m).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    out["chi2_seq"] = float(torch.exp(2.0 * seq_log).mean()) - 1.0
    return out


def verl_data_metrics(
    scores: Tensor, response_attention_mask: Tensor, max_response_length: int | None = None
) -> dict[str, float]:
    """verl's ``compute_data_metrics`` for the score and the response length.

    The response length is the sum of the *response attention mask* (``attention_mask[:, -T:]``), which counts
    observation/tool tokens inside a multi-turn response too (not the loss mask). A response of length 0 is
    *aborted*: ``critic/score/{mean,max,min}`` leave aborted rows out (NaN when all are), while
    ``response_length/{mean,max,min,clip_ratio}`` keep them; ``response_length_non_aborted/*`` leave them out;
    ``response/aborted_ratio`` is their fraction. ``clip_ratio`` is the fraction of lengths equal to
    ``max_response_length`` (default the mask width ``T``).

    Args:
        scores: ``[B]`` sequence scores (verl: ``token_level_scores.sum(-1)``).
        response_attention_mask: ``[B, T]`` attention mask of the response part.
        max_response_length: the response width (verl ``responses.shape[-1]``); default ``T``.

    Example:
        >>> verl_data_metrics(torch.tensor([1.0, 5.0]), torch.tensor([[1, 1], [0, 0]]))["critic/score/mean"]
        1.0
    """
    mask = as_bool_mask(response_attention_mask, "response_attention_mask")
    if mask.ndim != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores {tuple(scores.shape)} must be [B] for a [B, T] mask {tuple(mask.shape)}")
    width = mask.shape[-1] if max_response_length is None else max_response_length
    length = mask.sum(-1).to(_F64)
    s = scores.detach().to(_F64)
    alive = length > 0
    nan = float("nan")

    def _stats(x: Tensor) -> tuple[float, float, float]:
        return (float(x.mean()), float(x.max()), float(x.min())) if x.numel() else (nan, nan, nan)

    out: dict[str, float] = {}
    for name, x in (
        ("critic/score", s[alive]),
        ("response_length", length),
        ("response_length_non_aborted", length[alive]),
    ):
        out[f"{name}/mean"], out[f"{name}/max"], out[f"{name}/min"] = _stats(x)
    out["response_length/clip_ratio"] = float((length == width).to(_F64).mean()) if length.numel() else nan
    alive_len = length[alive]
    out["response_length_non_aborted/clip_ratio"] = (
        float((alive_len == width).to(_F64).mean()) if alive_len.numel() else nan
    )
    out["response/aborted_ratio"] = float((~alive).to(_F64).mean()) if length.numel() else nan
    return out


# ------------------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------------------


def _trl_coef(log_prob: Tensor, old_log_prob: Tensor, m: Tensor, cd: torch.dtype, level: str) -> Tensor:
    """TRL's ``coef_1``: ``exp(ℓ − ℓ_old)`` per token, or the sequence mean log-ratio broadcast (no clamp)."""
    log_ratio = _where(m, log_prob.to(cd) - old_log_prob.detach().to(cd))
    if level == "token":
        return torch.exp(log_ratio)
    if level != "sequence":
        raise ValueError(f"Unknown importance sampling level: {level}. Possible values are 'token' and 'sequence'.")
    n = m.sum(-1, keepdim=True).to(_F64).clamp(min=1.0)
    seq = (log_ratio.to(_F64).sum(-1, keepdim=True) / n).to(cd)
    return torch.exp(seq).expand_as(log_ratio)


def trl_logged_kl(
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    ref_log_prob: Tensor,
    mask: Tensor,
    *,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = True,
) -> float:
    """TRL's logged ``kl``: the token mean of ``k3 = e^{ℓ_ref − ℓ} − (ℓ_ref − ℓ) − 1`` times ``coef_1``.

    TRL 1.16 ``GRPOTrainer._compute_loss`` logs ``global_masked_mean(per_token_kl)`` after the bias
    correction (``use_bias_correction_kl``, default True) has multiplied k3 by the ratio ``coef_1``
    (per token, or the sequence ratio under ``importance_sampling_level="sequence"``); ``old_log_prob=None``
    is TRL's on-policy shortcut (``coef_1 = 1``). An empty mask gives 0 (TRL divides by ``max(Σm, 1)``).

    Example:
        >>> lp = torch.tensor([[-1.0]]); old = lp - math.log(2.0)
        >>> round(trl_logged_kl(lp, old, torch.tensor([[-2.0]]), torch.ones(1, 1)), 6)  # 2·e^-1
        0.735759
    """
    m, cd = _prepare(log_prob, mask, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob)
    lp = _where(m, log_prob.detach().to(cd))
    k3 = kl_estimate(lp, _where(m, ref_log_prob.detach().to(cd)), "k3")
    if use_bias_correction_kl and old_log_prob is not None:
        k3 = k3 * _trl_coef(lp, old_log_prob, m, cd, importance_sampling_level)
    return _masked_mean(k3, m)


def trl_clip_ratio_metrics(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
) -> dict[str, float]:
    """TRL's ``clip_ratio/*`` for the clipped losses (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``).

    ``low = [coef_1 < 1 − ε_low ∧ A < 0]``, ``high = [coef_1 > 1 + ε_high ∧ A > 0]``: ``low_mean``,
    ``high_mean``, ``region_mean`` (low ∨ high) are token means over the mask; ``low_min`` is the minimum and
    ``high_max`` the maximum over sequences of the per-sequence token means (a sequence without valid tokens
    gives NaN there and is skipped, TRL's ``nanmin``/``nanmax``). Under ``importance_sampling_level="sequence"``
    ``coef_1`` is the sequence ratio, TRL keeps one value per sequence and the means run over sequences, so
    per-token advantages are then read at each sequence's first position (TRL's ``(B, 1)`` broadcast).

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 0.5]])); adv = torch.tensor([[1.0, -1.0]])
        >>> trl_clip_ratio_metrics(lp, torch.zeros(1, 2), adv, torch.ones(1, 2))["region_mean"]
        1.0
    """
    eps_lo = check_real(epsilon_low, "epsilon_low", minimum=0.0)
    eps_hi = eps_lo if epsilon_high is None else check_real(epsilon_high, "epsilon_high", minimum=0.0)
    m, cd = _prepare(log_prob, mask, old_log_prob=old_log_prob, advantages=advantages)
    coef = _trl_coef(log_prob.detach(), old_log_prob, m, cd, importance_sampling_level)
    adv = advantages.detach().to(cd)
    if importance_sampling_level == "sequence":
        coef1, adv1 = coef[:, :1], adv[:, :1]
        low = (coef1 < 1 - eps_lo) & (adv1 < 0)
        high = (coef1 > 1 + eps_hi) & (adv1 > 0)
        rows = torch.ones_like(low)
        low_seq, high_seq = low.to(_F64).reshape(-1), high.to(_F64).reshape(-1)
        return {
            "low_mean": _masked_mean(low, rows),
            "high_mean": _masked_mean(high, rows),
            "region_mean": _masked_mean(low | high, rows),
            "low_min": float(low_seq.min()) if low_seq.numel() else math.nan,
            "high_max": float(high_seq.max()) if high_seq.numel() else math.nan,
        }
    low = (coef < 1 - eps_lo) & (adv < 0)
    high = (coef > 1 + eps_hi) & (adv > 0)
    n = m.sum(-1)
    has = n > 0
    low_seq = _row_means(low, m)[has]
    high_seq = _row_means(high, m)[has]
    return {
        "low_mean": _masked_mean(low, m),
        "high_mean": _masked_mean(high, m),
        "region_mean": _masked_mean(low | high, m),
        "low_min": float(low_seq.min()) if low_seq.numel() else math.nan,
        "high_max": float(high_seq.max()) if high_seq.numel() else math.nan,
    }


def trl_cispo_clip_ratio(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_high: float,
    importance_sampling_level: str = "token",
) -> float:
    """TRL's ``cispo_clip_ratio``: token mean of ``[coef_1 > ε_high ∧ A > 0]``.

    TRL's CISPO caps the ratio at the absolute ``epsilon_high`` (recommended 5.0), and only a positive
    advantage can be limited by that cap, so the indicator is gated by the advantage sign. Under
    ``importance_sampling_level="sequence"`` the mean runs over sequences (advantage at the first position).

    Example:
        >>> lp = torch.log(torch.tensor([[6.0, 6.0]])); adv = torch.tensor([[1.0, -1.0]])
        >>> trl_cispo_clip_ratio(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), epsilon_high=5.0)
        0.5
    """
    eps_hi = check_real(epsilon_high, "epsilon_high", minimum=0.0)
    m, cd = _prepare(log_prob, mask, old_log_prob=old_log_prob, advantages=advantages)
    coef = _trl_coef(log_prob.detach(), old_log_prob, m, cd, importance_sampling_level)
    clipped = (coef > eps_hi) & (advantages.detach().to(cd) > 0)
    if importance_sampling_level == "sequence":
        return _masked_mean(clipped[:, :1], torch.ones_like(clipped[:, :1]))
    return _masked_mean(clipped, m)


_TRL_IS_MODES = TRL_VLLM_IS_MODES


def trl_sampling_metrics(
    old_log_prob: Tensor,
    sampling_log_prob: Tensor,
    mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """TRL's vLLM importance-sampling ratio and its ``sampling/*`` figures (``_generate_and_score_completions``).

    ``Δ = (ℓ_old − ℓ_sampling)·m`` with NaN (a token vLLM could not score) as 0; token modes use ``exp(Δ)``
    per token, sequence modes ``exp(Σ_t Δ)`` per row (shape ``[B, 1]``); ``*_truncate`` clamps to
    ``[clip_min, clip_max]``, ``*_mask`` zeroes ratios outside. The defaults are TRL 1.16's ``GRPOConfig``
    (``vllm_importance_sampling_mode="sequence_mask"``, ``clip_min=None``, ``clip_max=3.0``). Figures:

    - ``sampling_logp_difference/mean`` and ``/max``: mean and max of ``|ℓ_old − ℓ_sampling|`` over valid tokens
      that are not NaN (0 when none);
    - ``importance_sampling_ratio/{min,mean,max}``: over valid tokens (token modes) or all rows (sequence
      modes), 0 when empty.

    Returns:
        ``(ratio, figures)``: the ratio ``[B, T]`` or ``[B, 1]`` as TRL multiplies it into the loss.

    Example:
        >>> old = torch.tensor([[-1.0, -2.0]]); samp = torch.tensor([[-1.5, -1.0]])
        >>> _, f = trl_sampling_metrics(old, samp, torch.ones(1, 2))
        >>> f["sampling_logp_difference/mean"], f["sampling_logp_difference/max"]
        (0.75, 1.0)
    """
    if mode not in _TRL_IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling level: {mode}. Possible values are {_TRL_IS_MODES}.")
    m, cd = _prepare(old_log_prob, mask, sampling_log_prob=sampling_log_prob)
    old, samp = old_log_prob.detach().to(cd), sampling_log_prob.detach().to(cd)
    diff = torch.nan_to_num(_where(m, old - samp), nan=0.0)
    sequence = mode.startswith("sequence")
    log_w = diff.to(_F64).sum(-1, keepdim=True).to(cd) if sequence else diff
    ratio = torch.exp(log_w)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    delta = (old - samp).abs()
    keep = m & ~torch.isnan(delta)
    n = int(keep.sum())
    out = {
        "sampling_logp_difference/mean": _masked_mean(delta, keep) if n else 0.0,
        "sampling_logp_difference/max": _masked_max(delta, keep) if n else 0.0,
    }
    flat = ratio.reshape(-1).to(_F64) if sequence else ratio[m].to(_F64)
    empty = flat.numel() == 0
    out["importance_sampling_ratio/min"] = 0.0 if empty else float(flat.min())
    out["importance_sampling_ratio/mean"] = 0.0 if empty else float(flat.mean())
    out["importance_sampling_ratio/max"] = 0.0 if empty else float(flat.max())
    return ratio, out


# ------------------------------------------------------------------------------------------------------------
# AReaL
# ------------------------------------------------------------------------------------------------------------


def areal_token_stats(values: Tensor, mask: Tensor) -> dict[str, float]:
    """AReaL ``stats_tracker.stat`` reductions: ``avg`` (Σ over the denominator mask / its count) and the
    ``min``/``max`` companions over the same mask (AReaL's ``<key>/avg``, ``<key>/min``, ``<key>/max``;
    ``actor_loss``, ``approx_kl``, ``new_logp``, ``old_logp``, ``entropy``, ``kl_div_*``, ``behave_approx_kl``,
    ...). An empty mask gives ``{}``: AReaL drops a reduction whose denominator is empty.

    Example:
        >>> areal_token_stats(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1, 0, 1]))
        {'avg': 2.0, 'min': 1.0, 'max': 3.0}
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("values", values, mask=m)
    if not bool(m.any()):
        return {}
    v = values.detach()
    v = v.to(compute_dtype(v.dtype)) if v.is_floating_point() else v.to(_F64)
    return {"avg": _masked_mean(v, m), "min": _masked_min(v, m), "max": _masked_max(v, m)}


def areal_kl_div_stats(logprobs: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """AReaL's ``compute_logp/kl_div_{direct,taylor,dual}/{avg,min,max}`` (``_log_proximal_approximation_stats``).

    ``log ρ = float32(ℓθ) − float32(ℓ_behave)``: ``direct = −log ρ``, ``taylor = (log ρ)²/2``,
    ``dual = ρ − 1 − log ρ``, reduced by :func:`areal_token_stats` over ``mask`` (AReaL's ``behave_mask``
    when rejection sampling runs, else the loss mask).

    Example:
        >>> s = areal_kl_div_stats(torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([True]))
        >>> s["kl_div_direct/avg"], s["kl_div_taylor/avg"]
        (-1.0, 0.5)
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("logprobs", logprobs, old_logp=old_logp, mask=m)
    dt = torch.promote_types(torch.promote_types(logprobs.dtype, old_logp.dtype), torch.float32)
    log_ratio = _where(m, logprobs.detach().to(dt) - old_logp.detach().to(dt))
    out: dict[str, float] = {}
    for name, v in (
        ("kl_div_direct", -log_ratio),
        ("kl_div_taylor", log_ratio * log_ratio / 2.0),
        ("kl_div_dual", torch.expm1(log_ratio) - log_ratio),
    ):
        for k, x in areal_token_stats(v, m).items():
            out[f"{name}/{k}"] = x
    return out


def areal_version_stats(versions: Tensor, current_version: int, mask: Tensor) -> dict[str, float]:
    """AReaL's ``version_stats/*`` (``_log_version_staleness_stats``).

    Over tokens with ``mask`` and ``version ≥ 0`` (generated tokens): ``sample_staleness_proximal_{avg,max,min}``
    of ``(v − 1) − version`` and ``sample_staleness_theta_{avg,max,min}`` of ``v − version``,
    ``v_theta = v``, ``v_proximal = v − 1``, ``n_valid_generated_tokens``. AReaL passes its ``behave_mask`` as
    ``mask`` when rejection sampling runs, so only the tokens the filter keeps count (pass the mask after
    rejection sampling to match); without rejection sampling the loss mask. Empty: ``{}`` (AReaL logs nothing).

    Example:
        >>> areal_version_stats(torch.tensor([3, 5, -1]), 6, torch.tensor([1, 1, 1]))["sample_staleness_theta_avg"]
        2.0
    """
    m = as_bool_mask(mask, "mask")
    check_same_shape("versions", versions, mask=m)
    keep = m & (versions >= 0)
    n = int(keep.sum())
    if n == 0:
        return {}
    v_behave = versions[keep].to(_F64)
    out: dict[str, float] = {}
    for name, lag in (("proximal", (current_version - 1) - v_behave), ("theta", current_version - v_behave)):
        out[f"sample_staleness_{name}_avg"] = float(lag.mean())
        out[f"sample_staleness_{name}_max"] = float(lag.max())
        out[f"sample_staleness_{name}_min"] = float(lag.min())
    out["v_theta"] = float(current_version)
    out["v_proximal"] = float(current_version - 1)
    out["n_valid_generated_tokens"] = float(n)
    return out


def areal_actor_stats(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: RejectionSamplingConfig | None = None,
    importance_sampling_level: str = "token",
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    convention: str | None = "areal",
) -> dict[str, float]:
    """Everything AReaL's PPO actor logs for one micro-batch (``grpo_loss_fn`` with the PPO loss), by key.

    Keys are those of AReaL's ``stats_tracker.export()`` inside the ``ppo_actor/update`` scope (prefix left
    out). Denominators (sums): ``n_valid_tokens`` (the loss mask, before rejection sampling),
    ``clipped_tokens``, ``dual_clipped_tokens``, ``unclipped_behave_tokens`` (AReaL's ``behave_mask``, with
    rejection sampling). ``<key>/{avg,min,max}`` (:func:`areal_token_stats`) of ``importance_weight``,
    ``approx_kl`` (ℓθ − ℓp), ``new_logp``, ``old_logp`` (behaviour), ``entropy``, ``actor_loss``,
    ``clip_ratio``, ``dual_clip_ratio`` over ``n_valid_tokens``; ``behave_imp_weight``, ``behave_approx_kl``
    over ``unclipped_behave_tokens``; ``clipped_new_logp``, ``clipped_old_logp`` over ``clipped_tokens``;
    ``rs_filtered_fraction``; ``compute_logp/prox_logp_gt/*`` and ``compute_logp/kl_div_*/*``
    (:func:`areal_kl_div_stats`, θ vs behaviour) over the behave mask (else the loss mask); with ``versions``
    and ``current_version`` the ``version_stats/*`` of :func:`areal_version_stats` over the same mask, so only
    the tokens rejection sampling keeps count.

    Under ``importance_sampling_level="sequence"`` ``importance_weight`` and ``clip_ratio`` come from the
    sequence ratio and the sequence-mean advantage (AReaL's GSPO path), never from token ratios. ``convention``
    goes to :func:`~grpo_cli.core.ppo.ppo_actor_loss` (``"areal"``: AReaL 1.0.4's statistics masks). ``n_tokens``
    and the ``vocab_*_logits`` need model data and are left out.

    Example:
        >>> lp = torch.log(torch.tensor([[1.5, 1.0]])); zero = torch.zeros(1, 2)
        >>> s = areal_actor_stats(lp, zero, zero, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
        >>> s["clip_ratio/avg"], s["n_valid_tokens"], s["importance_weight/max"]
        (0.5, 2.0, 1.5)
    """
    m = as_bool_mask(loss_mask, "loss_mask")
    _, st = ppo_actor_loss(
        logprobs.detach(),
        proximal_logprobs,
        old_logprobs,
        advantages,
        eps_clip,
        m,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level,
        convention=convention,
    )
    out: dict[str, float] = {
        "n_valid_tokens": float(m.sum()),
        "clipped_tokens": float(st["clip_mask"].sum()),
        "dual_clipped_tokens": float(st["dual_clip_mask"].sum()),
    }

    def put(prefix: str, values: Tensor, mask: Tensor) -> None:
        for k, v in areal_token_stats(values, mask).items():
            out[f"{prefix}/{k}"] = v

    per_token = {
        "importance_weight": st["importance_weight"],
        "approx_kl": st["approx_kl"],
        "new_logp": logprobs.detach(),
        "old_logp": old_logprobs.detach(),
        "entropy": entropy,
        "actor_loss": st["loss"],
        "clip_ratio": st["clip_mask"].to(torch.float32),
        "dual_clip_ratio": st["dual_clip_mask"].to(torch.float32),
    }
    for key, values in per_token.items():
        if values is not None:
            put(key, values, m)
    logp_mask = m
    if "behave_mask" in st:
        logp_mask = st["behave_mask"]
        out["unclipped_behave_tokens"] = float(logp_mask.sum())
        put("behave_imp_weight", st["behave_imp_weight"], logp_mask)
        put("behave_approx_kl", st["behave_approx_kl"], logp_mask)
        out["rs_filtered_fraction"] = float(st["filtered_fraction"])
    put("clipped_new_logp", logprobs.detach(), st["clip_mask"])
    put("clipped_old_logp", old_logprobs.detach(), st["clip_mask"])
    out["compute_logp/n_valid_tokens"] = float(logp_mask.sum())
    put("compute_logp/prox_logp_gt", proximal_logprobs.detach(), logp_mask)
    for k, v in areal_kl_div_stats(logprobs, old_logprobs, logp_mask).items():
        out[f"compute_logp/{k}"] = v
    if versions is not None and current_version is not None:
        for k, v in areal_version_stats(versions, current_version, logp_mask).items():
            out[f"version_stats/{k}"] = v
    return out
