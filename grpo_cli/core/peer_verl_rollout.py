"""verl's rollout correction as it logs it (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_offpolicy_metrics``; the rejection
sampling is :mod:`grpo_cli.core.peer_verl_rs`). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_cli.core._loss_common import (
    check_real,
)
from grpo_cli.core._peer_common import (
    F64,
    VERL_SAFETY_BOUND,
    fold_one_batch,
    pack,
    prepare,
    sequence_means,
)
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, segment_sum
from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total

__all__ = [
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
    row_w, row_raw = sequence_means(stat, cu_seqlens), sequence_means(raw, cu_seqlens)
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
    counts = verl_counts(train.numel(), cu)
    state = fold_one_batch({**verl_count_specs(), **verl_is_specs()}, train.device, counts, sums)
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
    mu_train = sequence_means(train, cu_seqlens)
    sums = {"ppl_t": torch.exp(-mu_train).sum(), "lppl_t": (-mu_train).sum()}
    if rollout is None:
        return sums
    lt = verl_log_ratio_terms(train, rollout, cu_seqlens) if log_terms is None else log_terms
    log_ratio, ratio = lt["log_ratio"], lt["ratio"]
    mu_rollout = sequence_means(rollout, cu_seqlens)
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
    counts, sums = verl_counts(train.numel(), cu), verl_offpolicy_sums(train, roll, cu)
    state = fold_one_batch({**verl_count_specs(), **verl_offpolicy_specs()}, train.device, counts, sums)
    return verl_offpolicy_figures(state, rollout=roll is not None)
