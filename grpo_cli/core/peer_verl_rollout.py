"""verl's rollout correction as it logs it (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_rollout_rejection_mask``,
``compute_rs_metrics``, ``compute_offpolicy_metrics``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math
from collections.abc import Mapping

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
    prepare,
)
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_max, segment_sum
from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total

__all__ = [
    "VERL_RS_OPTIONS",
    "verl_count_specs",
    "verl_counts",
    "verl_is_figures",
    "verl_is_specs",
    "verl_is_spread_values",
    "verl_is_sums",
    "verl_is_threshold",
    "verl_is_weights",
    "verl_log_ratio_terms",
    "verl_offpolicy_figures",
    "verl_offpolicy_metrics",
    "verl_offpolicy_specs",
    "verl_offpolicy_sums",
    "verl_rollout_is",
    "verl_rollout_rs",
    "verl_rs_bounds",
    "verl_rs_figures",
    "verl_rs_keep",
    "verl_rs_options",
    "verl_rs_specs",
    "verl_rs_statistics",
    "verl_rs_sums",
    "verl_rs_thresholds",
]

# verl logs its rollout-correction metrics per training batch. Each family is written once as *_sums (the float64
# sums, int64 counts and extrema of one batch of packed valid tokens), folded into a MetricState declared by
# *_specs, and *_figures (the metrics from the folded state): the batch functions fold their one batch, the
# streaming --names verl group every batch of the dump.


def _f64(x: Tensor) -> Tensor:
    return x.to(F64)


def verl_count_specs() -> dict[str, StateSpec]:
    """The denominators every ``*_figures`` function reads: ``n`` valid tokens, ``rows`` sequences (all of them)."""
    return {"n": count(), "rows": count()}


def verl_counts(n_tokens: int, cu_seqlens: Tensor) -> dict[str, Tensor]:
    """One batch's :func:`verl_count_specs` entries."""
    return {"n": torch.tensor(n_tokens), "rows": torch.tensor(cu_seqlens.numel() - 1)}


def _fold(specs: dict[str, StateSpec], device: torch.device, *partials: Mapping[str, Tensor]) -> MetricState:
    """A state holding one batch (the batch functions' path through ``*_figures``)."""
    state = MetricState({**verl_count_specs(), **specs}, device)
    for partial in partials:
        state.update(**partial)
    return state


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
    IcePop ``w·[lower ≤ w ≤ C]`` with it (``compute_rollout_correction_weights``), for :func:`verl_is_sums`.

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


def verl_is_specs() -> dict[str, StateSpec]:
    """The state :func:`verl_is_sums` folds into (besides :func:`verl_count_specs`)."""
    specs = {k: total() for k in ("w", "v", "v2", "r", "r2")}
    specs.update({k: count() for k in ("n_high", "n_low", "n_oob", "rows_high", "rows_low")})
    specs.update({k: maximum() for k in ("w_max", "r_max", "dev_max", "lr_max")})
    specs.update({k: minimum() for k in ("w_min", "r_min", "lr_min")})
    return specs


def verl_is_sums(
    log_terms: dict[str, Tensor],
    cu_seqlens: Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    truncate: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's rollout IS weights of packed valid tokens (``compute_rollout_correction_weights``) and what its
    ``rollout_is_*`` metrics (``compute_is_metrics``, :func:`verl_is_figures`) need of them. The weights and their
    statistics are computed in the tokens' dtype, the sums in float64.

    Args:
        log_terms: :func:`verl_log_ratio_terms` of the batch.
        cu_seqlens: ``[B + 1]`` offsets of the packed tokens.
        level, threshold, threshold_lower, truncate: as in :func:`verl_rollout_is`.

    Returns:
        ``(weights, sums)``: the processed weights ``[N]`` the loss uses and the entries of :func:`verl_is_specs`:
        of the weights the statistics describe (``w``: ``min(w, C)`` or, ``truncate=False``, the raw ``w``) the sum
        and token extremes, of the spread values ``v`` (:func:`verl_is_spread_values`) the sum and sum of
        squares, the raw weights above ``C`` and below ``lo`` (per sequence at sequence level: its log-sum
        against ``log C``, ``log lo``, with the extremes of the log-sums), with IcePop those outside ``[lo, C]``;
        of the per-sequence means ``r`` of ``w`` (an empty sequence 0) the sum, sum of squares, extremes and
        largest ``|r − 1|``, and the sequences whose mean raw weight is above ``C``, below ``lo``. ``lo`` is
        ``threshold_lower`` or ``1/C``.
    """
    c, lower = threshold, threshold_lower
    lo = 1.0 / c if lower is None else lower
    ratio = log_terms["ratio"]
    if level == "sequence":
        seq_log = _f64(log_terms["log_sum"].to(ratio.dtype))  # verl's sums are in the log-probs' dtype
        bounded = seq_log.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
        raw = torch.exp(broadcast_to_tokens(bounded, cu_seqlens, ratio.numel()).to(ratio.dtype))
        high, low = seq_log > math.log(c), seq_log < (math.log(lo) if lo > 0 else -math.inf)
    else:
        raw = ratio
        high, low = raw > c, raw < lo
    weights = verl_is_weights(raw, c, lower)
    stat = weights if truncate else raw
    w, v = _f64(stat), _f64(verl_is_spread_values(raw, weights, c, lo, truncate))
    row_w, row_raw = _sequence_means(stat, cu_seqlens), _sequence_means(raw, cu_seqlens)
    sums = {
        "w": w.sum(), "v": v.sum(), "v2": (v * v).sum(), "n_high": high.sum(), "n_low": low.sum(),
        "r": row_w.sum(), "r2": (row_w * row_w).sum(), "rows_high": (row_raw > c).sum(),
        "rows_low": (row_raw < lo).sum(),
    }
    if lower is not None:  # IcePop
        sums["n_oob"] = ((raw < lo) | (raw > c)).sum()
    if level == "token" and w.numel():  # at sequence level the extremes come from the log-sums
        sums.update(w_max=w.max(), w_min=w.min())
    if row_w.numel():
        sums.update(r_max=row_w.max(), r_min=row_w.min(), dev_max=(row_w - 1.0).abs().max())
        if level == "sequence":
            sums.update(lr_max=seq_log.max(), lr_min=seq_log.min())
    return weights, sums


def verl_is_figures(
    state: MetricState, *, level: str = "token", icepop: bool = False, prefix: str = ""
) -> dict[str, float]:
    """verl's ``rollout_is_*`` metrics (:func:`verl_rollout_is`) from the sums :func:`verl_is_sums` folded into
    ``state`` (entries named ``prefix + key``); ``{}`` without a valid token (verl raises)."""
    def get(key: str) -> Tensor:
        return state[prefix + key]

    n, rows = int(get("n")), int(get("rows"))
    if n == 0 or rows == 0:
        return {}
    sequence = level == "sequence"
    v_mean, v_sq = float(get("v")) / n, float(get("v2")) / n
    r_mean = float(get("r")) / rows
    r_var = (float(get("r2")) - rows * r_mean * r_mean) / (rows - 1) if rows > 1 else 0.0
    if sequence:  # verl: exp of the extreme log-sums (the max capped at exp(20)), fractions over sequences
        is_max = math.exp(min(float(get("lr_max")), VERL_SAFETY_BOUND))
        is_min = math.exp(float(get("lr_min")))
    else:
        is_max, is_min = float(get("w_max")), float(get("w_min"))
    frac_den = rows if sequence else n
    out = {
        "rollout_is_mean": float(get("w")) / n,
        "rollout_is_max": is_max,
        "rollout_is_min": is_min,
        "rollout_is_std": math.sqrt(max(v_sq - v_mean * v_mean, 0.0)) if n > 1 else 0.0,
        # 1 / mean((v / (mean v + 1e-8))²), from the moments
        "rollout_is_eff_sample_size": (v_mean + 1e-8) ** 2 / v_sq if v_sq > 0 else math.nan,
        "rollout_is_ratio_fraction_high": int(get("n_high")) / frac_den,
        "rollout_is_ratio_fraction_low": int(get("n_low")) / frac_den,
        "rollout_is_seq_mean": r_mean,
        "rollout_is_seq_std": math.sqrt(max(r_var, 0.0)),
        "rollout_is_seq_max": float(get("r_max")),
        "rollout_is_seq_min": float(get("r_min")),
        "rollout_is_seq_max_deviation": float(get("dev_max")),
        "rollout_is_seq_fraction_high": int(get("rows_high")) / rows,
        "rollout_is_seq_fraction_low": int(get("rows_low")) / rows,
    }
    if icepop:
        out["rollout_is_oob_ratio"] = int(get("n_oob")) / n
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
    weights, sums = verl_is_sums(verl_log_ratio_terms(train, roll, cu), cu, level=level, threshold=c,
                                 threshold_lower=lo_given, truncate=truncate)
    state = _fold(verl_is_specs(), train.device, verl_counts(train.numel(), cu), sums)
    padded = torch.zeros_like(m, dtype=cd)
    padded[m] = weights
    return padded, verl_is_figures(state, level=level, icepop=lo_given is not None)


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
    ±20)``: ``k1 = −ℓ``, ``k2 = ℓ²/2``, ``k3 = e^ℓ − 1 − ℓ``, for :func:`verl_rs_sums`.

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


def _rejected(keep: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per sequence: holds a token that ``keep`` rejects."""
    return segment_sum((~keep).to(F64), cu_seqlens, F64) > 0


def verl_rs_specs(bounds: dict[str, tuple[float | None, float]]) -> dict[str, StateSpec]:
    """The state :func:`verl_rs_sums` folds into for the options of ``bounds`` (besides :func:`verl_count_specs`)."""
    specs: dict[str, StateSpec] = {"rows_ne": count(), "rs_masked": count(), "rs_seq_masked": count()}
    for option in bounds:
        q = f"rs_{option}_"
        specs.update({q + k: total() for k in ("sum", "c", "c2", "seq", "seq2")})
        specs.update({q + k: count() for k in ("hi", "lo", "seq_hi", "seq_lo", "masked", "seq_masked")})
        specs.update({q + k: maximum() for k in ("max", "seq_max", "seq_dev")})
        specs.update({q + k: minimum() for k in ("min", "seq_min")})
    return specs


def verl_rs_sums(
    train: Tensor, rollout: Tensor, cu_seqlens: Tensor, bounds: dict[str, tuple[float | None, float]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's rejection sampling of packed valid tokens (``compute_rollout_rejection_mask``) and what its
    ``rollout_rs_*`` metrics (``compute_rs_metrics``, :func:`verl_rs_figures`) need: ``ℓ = clamp(train − rollout,
    ±20)``, the statistics of :func:`verl_rs_statistics` per token (in the tokens' dtype), reduced per sequence by
    the ``seq_sum``/``seq_mean``/``seq_max`` options (float64; ``seq_max`` of an empty sequence 0).

    Args:
        train, rollout: ``[N]`` log-probs of the valid tokens.
        cu_seqlens: ``[B + 1]`` offsets.
        bounds: ``{option: (lower, upper)}`` of :func:`verl_rs_thresholds`.

    Returns:
        ``(keep, sums)``: where all options together keep a token, and the entries of :func:`verl_rs_specs`: per
        option the sum of its statistic over tokens (a sequence option's value on each of its tokens), the sum and
        sum of squares of the statistic clamped to its interval, the units (tokens, or non-empty sequences for a
        sequence option) above and below it with their extremes, over non-empty sequences the sum, sum of squares,
        extremes and largest ``|·|`` of the per-sequence statistic (a token option's: its mean) and those above
        and below the interval, and the rejected tokens and the non-empty sequences holding one; then the tokens
        any option rejects and the sequences holding one.
    """
    log_ratio = (train - rollout).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    per_token = verl_rs_statistics(log_ratio)
    has = lengths_from_cu_seqlens(cu_seqlens).to(log_ratio.device) > 0
    n_tok = log_ratio.numel()
    zero = torch.zeros((), dtype=torch.int64, device=log_ratio.device)
    keep_all = torch.ones(n_tok, dtype=torch.bool, device=log_ratio.device)
    sums: dict[str, Tensor] = {"rows_ne": has.sum()}
    for option, (lower, upper) in bounds.items():
        k1 = option.endswith("k1")
        lo_t, hi_t = verl_rs_bounds(option, lower, upper)
        values = per_token[option[-2:]]
        if option.startswith("token"):
            seq_values, stat = _sequence_means(values, cu_seqlens), values
        else:
            if option.startswith("seq_sum"):
                seq_values = segment_sum(values, cu_seqlens, F64)
            elif option.startswith("seq_mean"):
                seq_values = _sequence_means(values, cu_seqlens)
            else:
                seq_values = torch.where(has, _f64(segment_max(values, cu_seqlens)), 0.0)
            stat = broadcast_to_tokens(seq_values, cu_seqlens, n_tok).to(values.dtype)
        keep = verl_rs_keep(stat, option, lo_t, hi_t)
        keep_all &= keep
        sv = seq_values[has]
        extreme = stat if option.startswith("token") else sv
        clamped = _f64(stat.clamp(min=lo_t, max=hi_t))
        q = f"rs_{option}_"
        sums.update({
            q + "sum": _f64(stat).sum(), q + "c": clamped.sum(), q + "c2": (clamped * clamped).sum(),
            q + "hi": (extreme > hi_t).sum(), q + "lo": (extreme < lo_t).sum() if k1 else zero,
            q + "seq": sv.sum(), q + "seq2": (sv * sv).sum(), q + "seq_hi": (sv > hi_t).sum(),
            q + "seq_lo": (sv < lo_t).sum() if k1 else zero, q + "masked": (~keep).sum(),
            q + "seq_masked": _rejected(keep, cu_seqlens).sum(),
        })
        if extreme.numel():
            sums.update({q + "max": extreme.max(), q + "min": extreme.min()})
        if sv.numel():
            sums.update({q + "seq_max": sv.max(), q + "seq_min": sv.min(), q + "seq_dev": sv.abs().max()})
    sums["rs_masked"] = (~keep_all).sum()
    sums["rs_seq_masked"] = _rejected(keep_all, cu_seqlens).sum()
    return keep_all, sums


def verl_rs_figures(
    state: MetricState, bounds: dict[str, tuple[float | None, float]], *, prefix: str = ""
) -> dict[str, float]:
    """verl's ``rollout_rs_*`` metrics (:func:`verl_rollout_rs`) from the sums :func:`verl_rs_sums` folded into
    ``state`` (entries named ``prefix + key``); ``{}`` without a valid token (verl raises)."""
    def get(key: str) -> Tensor:
        return state[prefix + key]

    n, rows, ne = int(get("n")), int(get("rows")), int(get("rows_ne"))
    if n == 0 or ne == 0:
        return {}
    out: dict[str, float] = {}
    for option in bounds:
        q, key = f"rs_{option}_", f"rollout_rs_{option}_"
        frac_den = n if option.startswith("token") else ne
        c_mean = float(get(q + "c")) / n
        s_mean = float(get(q + "seq")) / ne
        s_var = (float(get(q + "seq2")) - ne * s_mean * s_mean) / (ne - 1) if ne > 1 else 0.0
        out.update({
            key + "mean": float(get(q + "sum")) / n,
            key + "max": float(get(q + "max")),
            key + "min": float(get(q + "min")),
            key + "fraction_high": int(get(q + "hi")) / frac_den,
            key + "fraction_low": int(get(q + "lo")) / frac_den,
            key + "std": math.sqrt(max(float(get(q + "c2")) / n - c_mean * c_mean, 0.0)) if n > 1 else 0.0,
            key + "seq_mean": s_mean,
            key + "seq_std": math.sqrt(max(s_var, 0.0)),
            key + "seq_max": float(get(q + "seq_max")),
            key + "seq_min": float(get(q + "seq_min")),
            key + "seq_max_deviation": float(get(q + "seq_dev")),
            key + "seq_fraction_high": int(get(q + "seq_hi")) / ne,
            key + "masked_fraction": int(get(q + "masked")) / n,
            key + "seq_masked_fraction": int(get(q + "seq_masked")) / ne,
        })
        if option.endswith("k1"):
            out[key + "seq_fraction_low"] = int(get(q + "seq_lo")) / ne
    out["rollout_rs_masked_fraction"] = int(get("rs_masked")) / n
    out["rollout_rs_seq_masked_fraction"] = int(get("rs_seq_masked")) / rows
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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    cu, (train, roll) = pack(m, old_log_prob.detach().to(cd), rollout_log_prob.detach().to(cd))
    keep, sums = verl_rs_sums(train, roll, cu, bounds)
    state = _fold(verl_rs_specs(bounds), train.device, verl_counts(train.numel(), cu), sums)
    kept = torch.zeros_like(m)
    kept[m] = keep
    return kept, verl_rs_figures(state, bounds)


_OFFPOLICY_SUMS = ("ppl_t", "lppl_t", "kl", "k3", "ppl_r", "lppl_r", "diff", "adiff", "pplratio", "rho2", "chi2seq")


def verl_offpolicy_specs() -> dict[str, StateSpec]:
    """The state :func:`verl_offpolicy_sums` folds into (besides :func:`verl_count_specs`)."""
    return {**{k: total() for k in _OFFPOLICY_SUMS}, "diff_max": maximum(), "diff_min": minimum()}


def verl_offpolicy_sums(
    train: Tensor, rollout: Tensor | None, cu_seqlens: Tensor, log_terms: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """What verl's ``compute_offpolicy_metrics`` (:func:`verl_offpolicy_figures`) needs of a batch of packed
    valid tokens: with ``μ`` the per-sequence means of the log-probs (float64; 0 for an empty sequence), the
    sums over sequences of ``exp(−μ_train)``, ``−μ_train``, ``exp(−μ_rollout)``, ``−μ_rollout``, the difference
    ``μ_rollout − μ_train`` (with its extremes), its absolute value and ``exp``, and ``exp(2·clamp(Σℓ, ±20))``;
    the sums over tokens of ``−ℓ``, ``e^ℓ − ℓ − 1`` and ``exp(clamp(ℓ, ±20))²`` (``ℓ = train − rollout``, in the
    tokens' dtype). ``rollout`` None: only the training perplexities. ``log_terms``: :func:`verl_log_ratio_terms`
    when the caller has them already."""
    mu_train = _sequence_means(train, cu_seqlens)
    sums = {"ppl_t": torch.exp(-mu_train).sum(), "lppl_t": (-mu_train).sum()}
    if rollout is None:
        return sums
    lt = verl_log_ratio_terms(train, rollout, cu_seqlens) if log_terms is None else log_terms
    log_ratio, ratio = lt["log_ratio"], lt["ratio"]
    mu_rollout = _sequence_means(rollout, cu_seqlens)
    diff = mu_rollout - mu_train
    rho = _f64(ratio)
    sums.update({
        "kl": _f64(-log_ratio).sum(), "k3": _f64(k3_of_log_weight(log_ratio)).sum(),
        "ppl_r": torch.exp(-mu_rollout).sum(), "lppl_r": (-mu_rollout).sum(), "diff": diff.sum(),
        "adiff": diff.abs().sum(), "pplratio": torch.exp(diff).sum(), "rho2": (rho * rho).sum(),
        "chi2seq": torch.exp(2.0 * lt["log_sum"].clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).sum(),
    })
    if diff.numel():
        sums.update(diff_max=diff.max(), diff_min=diff.min())
    return sums


def verl_offpolicy_figures(state: MetricState, *, rollout: bool = True, prefix: str = "") -> dict[str, float]:
    """verl's off-policy metrics (:func:`verl_offpolicy_metrics`) from the sums :func:`verl_offpolicy_sums`
    folded into ``state`` (entries named ``prefix + key``); ``{}`` without a valid token (verl raises)."""
    def get(key: str) -> float:
        return float(state[prefix + key])

    n, rows = int(get("n")), int(get("rows"))
    if n == 0 or rows == 0:
        return {}
    out = {"training_ppl": get("ppl_t") / rows, "training_log_ppl": get("lppl_t") / rows}
    if not rollout:
        return out
    out.update({
        "kl": get("kl") / n,
        "k3_kl": get("k3") / n,
        "rollout_ppl": get("ppl_r") / rows,
        "rollout_log_ppl": get("lppl_r") / rows,
        "log_ppl_diff": get("diff") / rows,
        "log_ppl_abs_diff": get("adiff") / rows,
        "log_ppl_diff_max": get("diff_max"),
        "log_ppl_diff_min": get("diff_min"),
        "ppl_ratio": get("pplratio") / rows,
        "chi2_token": get("rho2") / n - 1.0,
        "chi2_seq": get("chi2seq") / rows - 1.0,
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
    state = _fold(verl_offpolicy_specs(), train.device, verl_counts(train.numel(), cu),
                  verl_offpolicy_sums(train, roll, cu))
    return verl_offpolicy_figures(state, rollout=roll is not None)
