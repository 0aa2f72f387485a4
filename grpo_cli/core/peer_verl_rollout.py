"""verl's rollout correction as it logs it (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_rollout_rejection_mask``,
``compute_rs_metrics``, ``compute_offpolicy_metrics``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.core._loss_common import (
    check_real,
)
from grpo_cli.core._peer_common import (
    F64,
    VERL_SAFETY_BOUND,
    pack,
    packed_mean,
    prepare,
)
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_max, segment_sum

__all__ = [
    "VERL_RS_OPTIONS",
    "verl_is_spread_values",
    "verl_is_terms",
    "verl_is_threshold",
    "verl_is_weights",
    "verl_log_ratio_terms",
    "verl_offpolicy_metrics",
    "verl_offpolicy_terms",
    "verl_rollout_is",
    "verl_rollout_rs",
    "verl_rs_bounds",
    "verl_rs_keep",
    "verl_rs_options",
    "verl_rs_statistics",
    "VerlRsOption",
    "verl_rs_terms",
    "verl_rs_thresholds",
]


def _sequence_means(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence means of packed values in float64, 0 for an empty sequence (verl's ``masked_mean(axis=-1)``)."""
    lengths = lengths_from_cu_seqlens(cu_seqlens).to(values.device)
    return segment_sum(values, cu_seqlens, F64) / lengths.to(F64).clamp(min=1.0)


def verl_log_ratio_terms(train: Tensor, rollout: Tensor, cu_seqlens: Tensor) -> dict[str, Tensor]:
    """What verl's IS weights and off-policy metrics both read of ``ℓ = train − rollout`` (packed valid tokens, in
    their dtype): per token ``log_ratio`` (ℓ) and ``ratio`` (``exp(clamp(ℓ, ±20))``), per sequence ``log_sum``
    (Σℓ in float64, 0 for an empty sequence).

    Example:
        >>> t = verl_log_ratio_terms(torch.tensor([0.0, 1.0, 2.0]), torch.zeros(3), torch.tensor([0, 2, 3]))
        >>> t["log_sum"].tolist()
        [1.0, 2.0]
    """
    log_ratio = train - rollout
    return {"log_ratio": log_ratio, "ratio": torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)),
            "log_sum": segment_sum(log_ratio, cu_seqlens, F64)}


def verl_is_weights(raw: Tensor, threshold: float, threshold_lower: float | None) -> Tensor:
    """verl's processed rollout IS weights from the raw ``w``: TIS ``min(w, C)`` without ``threshold_lower``,
    IcePop ``w·[lower ≤ w ≤ C]`` with it (``compute_rollout_correction_weights``). The batch function
    :func:`verl_rollout_is` and the streaming ``--names verl`` group both call it.

    Example:
        >>> w = torch.tensor([4.0, 0.25, 1.0])
        >>> verl_is_weights(w, 2.0, None).tolist(), verl_is_weights(w, 2.0, 0.5).tolist()
        ([2.0, 0.25, 1.0], [0.0, 0.0, 1.0])
    """
    if threshold_lower is None:
        return raw.clamp(max=threshold)
    zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
    return torch.where((raw >= threshold_lower) & (raw <= threshold), raw, zero)


def verl_is_spread_values(raw: Tensor, weights: Tensor, threshold: float, lower: float, truncate: bool) -> Tensor:
    """The values ``rollout_is_std`` and ``rollout_is_eff_sample_size`` are taken over: the processed weights
    clamped to ``[0, C]`` (verl 0.8 and later, ``truncate``), or the raw ones clamped to ``[lower, C]`` (verl 0.7
    and earlier; ``lower`` = IcePop's bound or ``1/C``)."""
    return weights.clamp(min=0.0, max=threshold) if truncate else raw.clamp(min=lower, max=threshold)


def verl_is_terms(
    log_terms: dict[str, Tensor],
    cu_seqlens: Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    truncate: bool = True,
) -> dict[str, Tensor]:
    """verl's rollout IS weights of packed valid tokens and the per-token and per-sequence values its
    ``rollout_is_*`` metrics reduce (``compute_rollout_correction_weights``, ``compute_is_metrics``). The batch
    function :func:`verl_rollout_is` and the streaming ``--names verl`` group both call it.

    Args:
        log_terms: :func:`verl_log_ratio_terms` of the batch.
        cu_seqlens: ``[B + 1]`` offsets of the packed tokens.
        level, threshold, threshold_lower, truncate: as in :func:`verl_rollout_is`.

    Returns:
        Per token: ``weights`` (the processed weights the loss uses), ``stat`` (the weights ``mean``/``max``/``min``
        describe), ``spread`` (those ``std`` and ESS take), with IcePop ``oob`` (raw ``w`` outside ``[lo, C]``);
        ``high`` and ``low`` (raw ``w > C``, ``< lo``) per token, or per sequence at sequence level (its log-sum
        against ``log C``, ``log lo``). Per sequence (float64): at sequence level ``seq_log_ratio`` (Σℓ, rounded to
        the tokens' dtype: the extremes are exp of its extremes), ``seq_mean`` (mean of ``stat``), ``seq_deviation``
        (``|seq_mean − 1|``), ``seq_high``/``seq_low`` (mean raw ``w`` above ``C``, below ``lo``). ``lo`` is
        ``threshold_lower`` or ``1/C``.
    """
    c, lower = threshold, threshold_lower
    lo = 1.0 / c if lower is None else lower
    ratio = log_terms["ratio"]
    out: dict[str, Tensor] = {}
    if level == "sequence":
        seq_log = log_terms["log_sum"].to(ratio.dtype).to(F64)  # verl's sums are in the log-probs' dtype
        bounded = seq_log.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
        raw = torch.exp(broadcast_to_tokens(bounded, cu_seqlens, ratio.numel()).to(ratio.dtype))
        high, low = seq_log > math.log(c), seq_log < (math.log(lo) if lo > 0 else -math.inf)
        out["seq_log_ratio"] = seq_log
    else:
        raw = ratio
        high, low = raw > c, raw < lo
    weights = verl_is_weights(raw, c, lower)
    stat = weights if truncate else raw
    seq_mean = _sequence_means(stat, cu_seqlens)
    seq_raw = _sequence_means(raw, cu_seqlens)
    out.update({
        "weights": weights, "stat": stat, "spread": verl_is_spread_values(raw, weights, c, lo, truncate),
        "high": high, "low": low, "seq_mean": seq_mean, "seq_deviation": (seq_mean - 1.0).abs(),
        "seq_high": seq_raw > c, "seq_low": seq_raw < lo,
    })
    if lower is not None:
        out["oob"] = (raw < lo) | (raw > c)
    return out


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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    cu, (train, roll) = pack(m, old_log_prob.detach().to(cd), rollout_log_prob.detach().to(cd))
    t = verl_is_terms(verl_log_ratio_terms(train, roll, cu), cu, level=level, threshold=c, threshold_lower=lo_given,
                      truncate=truncate)
    stat = t["stat"]
    out: dict[str, float] = {"rollout_is_mean": packed_mean(stat)}
    if level == "sequence":  # the extremes are exp of the row log-sums (the max capped at 20), over all rows
        out["rollout_is_max"] = math.exp(min(float(t["seq_log_ratio"].max()), VERL_SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(t["seq_log_ratio"].min()))
    else:
        out["rollout_is_max"], out["rollout_is_min"] = float(stat.max()), float(stat.min())
    out["rollout_is_ratio_fraction_high"] = packed_mean(t["high"])
    out["rollout_is_ratio_fraction_low"] = packed_mean(t["low"])
    v = t["spread"].to(F64)
    mean_v = packed_mean(v)
    out["rollout_is_std"] = math.sqrt(max(packed_mean(v * v) - mean_v**2, 0.0)) if v.numel() > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / packed_mean((v / (mean_v + 1e-8)) ** 2)
    seq = t["seq_mean"]
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float(t["seq_deviation"].max())
    out["rollout_is_seq_fraction_high"] = packed_mean(t["seq_high"])
    out["rollout_is_seq_fraction_low"] = packed_mean(t["seq_low"])
    if lo_given is not None:
        out["rollout_is_oob_ratio"] = packed_mean(t["oob"])
    weights = torch.zeros_like(m, dtype=cd)
    weights[m] = t["weights"]
    return weights, out


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


def verl_rs_statistics(log_ratio: Tensor) -> dict[str, Tensor]:
    """verl's per-token rejection statistics (``compute_rollout_rejection_mask``) of ``ℓ = clamp(train − rollout,
    ±20)``: ``k1 = −ℓ``, ``k2 = ℓ²/2``, ``k3 = e^ℓ − 1 − ℓ``. The one place they are written: the batch function
    :func:`verl_rollout_rs` and the streaming ``--names verl`` group both call it.

    Example:
        >>> {k: round(v.item(), 4) for k, v in verl_rs_statistics(torch.tensor([1.0])).items()}
        {'k1': -1.0, 'k2': 0.5, 'k3': 0.7183}
    """
    return {"k1": -log_ratio, "k2": 0.5 * log_ratio * log_ratio, "k3": k3_of_log_weight(log_ratio)}


def verl_rs_bounds(option: str, lower: float | None, upper: float) -> tuple[float, float]:
    """The interval an option's statistic must lie in to keep a token: ``[log lower, log upper]`` for the k1
    options (their statistic is a log-ratio; ``lower`` absent: 0), ``[0, upper]`` for k2/k3 (only the upper bound
    is tested, :func:`verl_rs_keep`).

    Example:
        >>> verl_rs_bounds("token_k1", None, math.e), verl_rs_bounds("seq_mean_k3", None, 0.5)
        ((0.0, 1.0), (0.0, 0.5))
    """
    k1 = option.endswith("k1")
    return (math.log(lower) if k1 and lower is not None else 0.0), (math.log(upper) if k1 else upper)


def verl_rs_keep(stat: Tensor, option: str, low: float, high: float) -> Tensor:
    """Where ``option`` keeps a token: ``low ≤ stat ≤ high`` for k1, ``stat ≤ high`` for k2/k3 (verl)."""
    return (stat >= low) & (stat <= high) if option.endswith("k1") else stat <= high


@dataclass(frozen=True)
class VerlRsOption:
    """One rejection-sampling option of a batch (:func:`verl_rs_terms`)."""

    low: float
    """The lower end of the interval the statistic must lie in (:func:`verl_rs_bounds`)."""
    high: float
    """Its upper end."""
    stat: Tensor
    """Per token: the option's statistic (a sequence option's value repeated over its tokens)."""
    seq: Tensor
    """Per sequence (float64): the option's statistic (a token option's: its mean); 0 for an empty sequence."""
    keep: Tensor
    """Per token: the option keeps it."""
    rejected: Tensor
    """Per sequence: holds a token the option rejects."""


def _rejected(keep: Tensor, cu_seqlens: Tensor) -> Tensor:
    return segment_sum((~keep).to(F64), cu_seqlens, F64) > 0


def verl_rs_terms(
    train: Tensor, rollout: Tensor, cu_seqlens: Tensor, bounds: dict[str, tuple[float | None, float]]
) -> tuple[dict[str, VerlRsOption], Tensor, Tensor]:
    """verl's rejection sampling of packed valid tokens (``compute_rollout_rejection_mask``): ``ℓ = clamp(train −
    rollout, ±20)``, the statistics of :func:`verl_rs_statistics` per token, reduced per sequence by the
    ``seq_sum``/``seq_mean``/``seq_max`` options. The batch function :func:`verl_rollout_rs` and the streaming
    ``--names verl`` group both call it.

    Args:
        train, rollout: ``[N]`` log-probs of the valid tokens (their dtype is the working dtype).
        cu_seqlens: ``[B + 1]`` offsets.
        bounds: ``{option: (lower, upper)}`` of :func:`verl_rs_thresholds`.

    Returns:
        ``(options, keep, rejected)``: each option's :class:`VerlRsOption`, then where all options together keep a
        token and which sequences hold a token any option rejects.
    """
    log_ratio = (train - rollout).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    per_token = verl_rs_statistics(log_ratio)
    has = lengths_from_cu_seqlens(cu_seqlens).to(log_ratio.device) > 0
    n_tok = log_ratio.numel()
    keep_all = torch.ones(n_tok, dtype=torch.bool, device=log_ratio.device)
    out: dict[str, VerlRsOption] = {}
    for option, (lower, upper) in bounds.items():
        low, high = verl_rs_bounds(option, lower, upper)
        values = per_token[option[-2:]]
        if option.startswith("token"):
            seq, stat = _sequence_means(values, cu_seqlens), values
        else:
            if option.startswith("seq_sum"):
                seq = segment_sum(values, cu_seqlens, F64)
            elif option.startswith("seq_mean"):
                seq = _sequence_means(values, cu_seqlens)
            else:
                seq = torch.where(has, segment_max(values, cu_seqlens).to(F64), 0.0)
            stat = broadcast_to_tokens(seq, cu_seqlens, n_tok).to(values.dtype)
        keep = verl_rs_keep(stat, option, low, high)
        keep_all &= keep
        out[option] = VerlRsOption(low, high, stat, seq, keep, _rejected(keep, cu_seqlens))
    return out, keep_all, _rejected(keep_all, cu_seqlens)


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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    cu, (train, roll) = pack(m, old_log_prob.detach().to(cd), rollout_log_prob.detach().to(cd))
    terms, keep_all, rejected_all = verl_rs_terms(train, roll, cu, bounds)
    has = m.any(-1)
    out: dict[str, float] = {}
    for option, t in terms.items():
        p = f"rollout_rs_{option}"
        k1 = option.endswith("k1")
        valid_seq = t.seq[has]
        units = t.stat if option.startswith("token") else valid_seq  # what max, min and the fractions run over
        out[f"{p}_mean"] = packed_mean(t.stat)
        out[f"{p}_max"], out[f"{p}_min"] = float(units.max()), float(units.min())
        out[f"{p}_fraction_high"] = packed_mean(units > t.high)
        out[f"{p}_fraction_low"] = packed_mean(units < t.low) if k1 else 0.0
        if t.stat.numel() > 1:
            clamped = t.stat.to(F64).clamp(min=t.low, max=t.high)
            mean_c = packed_mean(clamped)
            out[f"{p}_std"] = math.sqrt(max(packed_mean(clamped * clamped) - mean_c**2, 0.0))
        else:
            out[f"{p}_std"] = 0.0
        out[f"{p}_seq_mean"] = float(valid_seq.mean())
        out[f"{p}_seq_std"] = float(valid_seq.std()) if valid_seq.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = float(valid_seq.max())
        out[f"{p}_seq_min"] = float(valid_seq.min())
        out[f"{p}_seq_max_deviation"] = float(valid_seq.abs().max())
        out[f"{p}_seq_fraction_high"] = packed_mean(valid_seq > t.high)
        if k1:
            out[f"{p}_seq_fraction_low"] = packed_mean(valid_seq < t.low)
        out[f"{p}_masked_fraction"] = packed_mean(~t.keep)
        out[f"{p}_seq_masked_fraction"] = packed_mean(t.rejected[has])
    out["rollout_rs_masked_fraction"] = packed_mean(~keep_all)
    out["rollout_rs_seq_masked_fraction"] = packed_mean(rejected_all)
    kept = torch.zeros_like(m)
    kept[m] = keep_all
    return kept, out


def verl_offpolicy_terms(
    train: Tensor, rollout: Tensor | None, cu_seqlens: Tensor, log_terms: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """The per-token and per-sequence values verl's ``compute_offpolicy_metrics`` averages, of packed valid
    tokens. The batch function :func:`verl_offpolicy_metrics` and the streaming ``--names verl`` group both call it.

    Args:
        train, rollout: ``[N]`` log-probs of the valid tokens (``rollout`` None: only the training perplexities).
        cu_seqlens: ``[B + 1]`` offsets.
        log_terms: :func:`verl_log_ratio_terms` of ``train`` and ``rollout`` when the caller has them already.

    Returns:
        Keyed by verl's figure: per token ``kl`` (``−ℓ``), ``k3_kl`` (``e^ℓ − ℓ − 1``), ``chi2_token`` (``ρ²``,
        ``ρ = exp(clamp(ℓ, ±20))``); per sequence (float64; μ the sequence means of the log-probs, 0 when empty)
        ``training_ppl`` (``exp(−μ_train)``), ``training_log_ppl`` (``−μ_train``), ``rollout_ppl``,
        ``rollout_log_ppl``, ``log_ppl_diff`` (``μ_rollout − μ_train``), ``log_ppl_abs_diff``, ``ppl_ratio``
        (``exp`` of the difference), ``chi2_seq`` (``exp(2·clamp(Σℓ, ±20))``). Each figure is the mean of its
        values (the two χ² less 1).
    """
    mu_train = _sequence_means(train, cu_seqlens)
    out = {"training_ppl": torch.exp(-mu_train), "training_log_ppl": -mu_train}
    if rollout is None:
        return out
    lt = verl_log_ratio_terms(train, rollout, cu_seqlens) if log_terms is None else log_terms
    log_ratio, ratio = lt["log_ratio"], lt["ratio"]
    mu_rollout = _sequence_means(rollout, cu_seqlens)
    diff = mu_rollout - mu_train
    out.update({
        "kl": -log_ratio, "k3_kl": k3_of_log_weight(log_ratio), "chi2_token": ratio * ratio,
        "rollout_ppl": torch.exp(-mu_rollout), "rollout_log_ppl": -mu_rollout, "log_ppl_diff": diff,
        "log_ppl_abs_diff": diff.abs(), "ppl_ratio": torch.exp(diff),
        "chi2_seq": torch.exp(2.0 * lt["log_sum"].clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)),
    })
    return out


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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("Expected at least one valid token in response_mask")
    cu, (train,) = pack(m, old_log_prob.detach().to(cd))
    roll = None if rollout_log_prob is None else pack(m, rollout_log_prob.detach().to(cd))[1][0]
    t = verl_offpolicy_terms(train, roll, cu)
    out = {key: float(t[key].mean()) for key in ("training_ppl", "training_log_ppl")}  # over all rows
    if roll is None:
        return out
    out["kl"], out["k3_kl"] = packed_mean(t["kl"]), packed_mean(t["k3_kl"])  # token means
    for key in ("rollout_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff"):
        out[key] = float(t[key].mean())
    out["log_ppl_diff_max"] = float(t["log_ppl_diff"].max())
    out["log_ppl_diff_min"] = float(t["log_ppl_diff"].min())
    out["ppl_ratio"] = float(t["ppl_ratio"].mean())
    out["chi2_token"] = packed_mean(t["chi2_token"]) - 1.0
    out["chi2_seq"] = float(t["chi2_seq"].mean()) - 1.0
    return out
