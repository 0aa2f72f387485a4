"""verl's rejection sampling as it logs it (``verl/trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_rejection_mask``, ``compute_rs_metrics``). Re-exported by :mod:`grpo_cli.core.peer_figures`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_cli._choices import VERL_RS_OPTIONS
from grpo_cli.core._peer_common import F64, VERL_SAFETY_BOUND, fold_one_batch, pack, prepare, sequence_means
from grpo_cli.core.kl import k3_of_log_weight
from grpo_cli.core.packing import broadcast_to_tokens, lengths_from_cu_seqlens, segment_max, segment_sum
from grpo_cli.core.peer_verl_rollout import verl_count_specs, verl_counts
from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total

__all__ = [
    "VERL_RS_OPTIONS",
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


def _to_f64(x: Tensor) -> Tensor:
    return x.to(F64)


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
            seq_values, stat = sequence_means(values, cu_seqlens), values
        else:
            if option.startswith("seq_sum"):
                seq_values = segment_sum(values, cu_seqlens, F64)
            elif option.startswith("seq_mean"):
                seq_values = sequence_means(values, cu_seqlens)
            else:
                seq_values = torch.where(has, _to_f64(segment_max(values, cu_seqlens)), 0.0)
            stat = broadcast_to_tokens(seq_values, cu_seqlens, n_tok).to(values.dtype)
        keep = verl_rs_keep(stat, option, lo_t, hi_t)
        keep_all &= keep
        sv = seq_values[has]
        extreme = stat if option.startswith("token") else sv
        clamped = _to_f64(stat.clamp(min=lo_t, max=hi_t))
        q = f"rs_{option}_"
        sums.update({
            q + "sum": _to_f64(stat).sum(), q + "c": clamped.sum(), q + "c2": (clamped * clamped).sum(),
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
    counts = verl_counts(train.numel(), cu)
    state = fold_one_batch({**verl_count_specs(), **verl_rs_specs(bounds)}, train.device, counts, sums)
    kept = torch.zeros_like(m)
    kept[m] = keep
    return kept, verl_rs_figures(state, bounds)
