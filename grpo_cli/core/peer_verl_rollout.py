"""verl's rollout correction as it logs it (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_correction_weights``, ``compute_is_metrics``, ``compute_rollout_rejection_mask``,
``compute_rs_metrics``, ``compute_offpolicy_metrics``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.core._loss_common import (
    check_real,
)
from grpo_cli.core._peer_common import (
    F64,
    VERL_SAFETY_BOUND,
    masked_max,
    masked_mean,
    masked_min,
    prepare,
    row_means,
    row_sums,
    where,
)
from grpo_cli.core.kl import k3_of_log_weight

__all__ = [
    "VERL_RS_OPTIONS",
    "verl_is_spread_values",
    "verl_is_threshold",
    "verl_is_weights",
    "verl_offpolicy_metrics",
    "verl_rollout_is",
    "verl_rollout_rs",
    "verl_rs_bounds",
    "verl_rs_keep",
    "verl_rs_options",
    "verl_rs_statistics",
    "verl_rs_thresholds",
]


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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    log_ratio = where(m, old_log_prob.detach().to(cd) - rollout_log_prob.detach().to(cd))
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    else:
        log_for_metrics = log_ratio.to(F64).sum(-1, keepdim=True).to(cd)
        raw = torch.exp(log_for_metrics.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).expand_as(log_ratio)
    raw = where(m, raw)
    weights = verl_is_weights(raw, c, lo_given)
    stat_w = weights if truncate else raw
    out: dict[str, float] = {"rollout_is_mean": masked_mean(stat_w, m)}
    if level == "sequence":
        log_c, log_lo = math.log(c), (math.log(lo) if lo > 0 else -math.inf)
        row_log = log_for_metrics.to(F64).reshape(-1)
        out["rollout_is_max"] = math.exp(min(float(row_log.max()), VERL_SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(row_log.min()))
        out["rollout_is_ratio_fraction_high"] = float((row_log > log_c).to(F64).mean())
        out["rollout_is_ratio_fraction_low"] = float((row_log < log_lo).to(F64).mean())
    else:
        out["rollout_is_ratio_fraction_high"] = masked_mean(raw > c, m)
        out["rollout_is_ratio_fraction_low"] = masked_mean(raw < lo, m)
        out["rollout_is_max"] = masked_max(stat_w, m)
        out["rollout_is_min"] = masked_min(stat_w, m)
    v = verl_is_spread_values(raw, weights, c, lo, truncate)
    mean_v = masked_mean(v, m)
    if int(m.sum()) > 1:
        out["rollout_is_std"] = math.sqrt(max(masked_mean(v.to(F64) ** 2, m) - mean_v**2, 0.0))
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((v.to(F64) / (mean_v + 1e-8)) ** 2, m)
    seq = row_means(stat_w, m)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    raw_seq = row_means(raw, m)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > c).to(F64).mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < lo).to(F64).mean())
    if lo_given is not None:
        out["rollout_is_oob_ratio"] = masked_mean((raw < lo_given) | (raw > c), m)
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
    log_ratio = where(m, old_log_prob.detach().to(cd) - rollout_log_prob.detach().to(cd))
    log_ratio = log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    per_token = verl_rs_statistics(log_ratio)
    has = m.any(-1)
    keep_all = torch.ones_like(m)
    out: dict[str, float] = {}
    for option in options:
        lo_t, hi_t = verl_rs_bounds(option, *bounds[option])
        k1 = option.endswith("k1")
        values = per_token[option[-2:]]
        if option.startswith("token"):
            stat = values
            seq_values = row_means(stat, m)
        else:
            if option.startswith("seq_sum"):
                seq_values = row_sums(values, m)
            elif option.startswith("seq_mean"):
                seq_values = row_means(values, m)
            else:
                seq_values = where(m, values.to(F64), -math.inf).max(-1).values
                seq_values = torch.where(torch.isinf(seq_values), torch.zeros_like(seq_values), seq_values)
            stat = seq_values.to(cd)[:, None].expand_as(values)
        keep = verl_rs_keep(stat, option, lo_t, hi_t)
        keep_all = keep_all & keep
        p = f"rollout_rs_{option}"
        valid_seq = seq_values[has]
        sequence_level = not option.startswith("token")
        out[f"{p}_mean"] = masked_mean(stat, m)
        if sequence_level:
            out[f"{p}_max"], out[f"{p}_min"] = float(valid_seq.max()), float(valid_seq.min())
            out[f"{p}_fraction_high"] = float((valid_seq > hi_t).to(F64).mean())
            out[f"{p}_fraction_low"] = float((valid_seq < lo_t).to(F64).mean()) if k1 else 0.0
        else:
            out[f"{p}_max"], out[f"{p}_min"] = masked_max(stat, m), masked_min(stat, m)
            out[f"{p}_fraction_high"] = masked_mean(stat > hi_t, m)
            out[f"{p}_fraction_low"] = masked_mean(stat < lo_t, m) if k1 else 0.0
        if int(m.sum()) > 1:
            clamped = stat.to(F64).clamp(min=lo_t, max=hi_t)
            mean_c = masked_mean(clamped, m)
            out[f"{p}_std"] = math.sqrt(max(masked_mean(clamped * clamped, m) - mean_c**2, 0.0))
        else:
            out[f"{p}_std"] = 0.0
        out[f"{p}_seq_mean"] = float(valid_seq.mean())
        out[f"{p}_seq_std"] = float(valid_seq.std()) if valid_seq.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = float(valid_seq.max())
        out[f"{p}_seq_min"] = float(valid_seq.min())
        out[f"{p}_seq_max_deviation"] = float(valid_seq.abs().max())
        out[f"{p}_seq_fraction_high"] = float((valid_seq > hi_t).to(F64).mean())
        if k1:
            out[f"{p}_seq_fraction_low"] = float((valid_seq < lo_t).to(F64).mean())
        out[f"{p}_masked_fraction"] = masked_mean(~keep, m)
        out[f"{p}_seq_masked_fraction"] = float((~keep & m).any(-1)[has].to(F64).mean())
    out["rollout_rs_masked_fraction"] = masked_mean(~keep_all, m)
    out["rollout_rs_seq_masked_fraction"] = float((~keep_all & m).any(-1).to(F64).mean())
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
    m, cd = prepare(old_log_prob, response_mask, rollout_log_prob=rollout_log_prob)
    if not bool(m.any()):
        raise ValueError("Expected at least one valid token in response_mask")
    old = where(m, old_log_prob.detach().to(cd))
    mu_old = row_means(old, m)
    out = {
        "training_ppl": float(torch.exp(-mu_old).mean()),
        "training_log_ppl": float((-mu_old).mean()),
    }
    if rollout_log_prob is None:
        return out
    roll = where(m, rollout_log_prob.detach().to(cd))
    log_ratio = old - roll
    out["kl"] = masked_mean(-log_ratio, m)
    out["k3_kl"] = masked_mean(k3_of_log_weight(log_ratio), m)
    mu_roll = row_means(roll, m)
    out["rollout_ppl"] = float(torch.exp(-mu_roll).mean())
    out["rollout_log_ppl"] = float((-mu_roll).mean())
    diff = mu_roll - mu_old
    out["log_ppl_diff"] = float(diff.mean())
    out["log_ppl_abs_diff"] = float(diff.abs().mean())
    out["log_ppl_diff_max"] = float(diff.max())
    out["log_ppl_diff_min"] = float(diff.min())
    out["ppl_ratio"] = float(torch.exp(diff).mean())
    rho = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).to(F64)
    out["chi2_token"] = masked_mean(rho * rho, m) - 1.0
    seq_log = row_sums(log_ratio, m).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    out["chi2_seq"] = float(torch.exp(2.0 * seq_log).mean()) - 1.0
    return out
