"""The **lags** family: per lag bin, |new − old| and the error of AReaL's log-linear proximal approximation
against the dumped ``prox_logp``; the lag-0 mismatch figures."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.diagnosis._common import TOP_FIELDS, as_float, table_rows, update_top
from grpo_cli.core.packing import segment_count, segment_sum
from grpo_cli.core.state import MetricState, count, maximum, top_rows, total

__all__ = ["BIG_SEQ_MISMATCH", "MAX_DIAG_LAG", "lags_compute", "lags_state", "lags_update"]

MAX_DIAG_LAG = 32
"""Lags 0 … MAX_DIAG_LAG − 1 get a bin each in :func:`lags_update`; larger lags share one overflow bin."""


def lags_state(device: torch.device | str | None = None, top_k: int = 8) -> MetricState:
    """An empty state for :func:`lags_update` (bins: lags 0 … MAX_DIAG_LAG − 1, then overflow)."""
    bins = (MAX_DIAG_LAG + 1,)
    specs = {
        "n": count(bins), "sum_abs": total(bins), "n_prox": count(bins), "sum_prox_err": total(bins),
        "max_abs0": maximum(), "n_seq0": count(), "n_seq0_big": count(),
        "lag_max": maximum(), "top": top_rows(top_k, len(TOP_FIELDS)),
    }
    return MetricState(specs, device)


BIG_SEQ_MISMATCH = 0.1
"""A lag-0 sequence counts as "big mismatch" when its mean |new − old| exceeds this (nats), about 10× the
healthy bf16 level (``docs/findings.md``, GRP202)."""


def lags_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    old_logp: Tensor,
    lag: Tensor,
    cu_seqlens: Tensor,
    prox_logp: Tensor | None = None,
    file_index: int = 0,
    rows: Tensor | None = None,
    step: Tensor | None = None,
) -> None:
    """Fold one batch of **valid tokens** into ``state``.

    Args:
        state: from :func:`lags_state`.
        new_logp, old_logp, prox_logp: ``[N]`` valid-token log-probs (``prox_logp`` optional).
        lag: ``[N]`` int lag ``current_version − versions``; tokens with a negative lag (not generated) are skipped.
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        file_index, rows, step: locations for the ``top`` table of lag-0 sequences by mean |new − old| (``value``:
            their lag-0 tokens).

    The proximal error is |prox − (old + α(new − old))| with α = (k − 1)/k for k ≥ 1 and 0 at k = 0, AReaL's
    ``loglinear`` approximation (``compute_prox_logp_approximations``; v_prox = v_θ − 1).
    """
    n = new_logp.numel()
    if n == 0:
        return
    device = new_logp.device
    new, old = as_float(new_logp).to(torch.float64), as_float(old_logp).to(torch.float64)
    lag = lag.to(device=device, dtype=torch.int64)
    gen = lag >= 0
    diff = (new - old).abs()
    b = lag.clamp(0, MAX_DIAG_LAG)
    lag_max = lag.max()  # the largest generated lag whenever any token is generated (the others are negative)
    all_generated = bool(lag.min() >= 0)
    # Masked by zero terms rather than by boolean indexing: the same sums (a +0.0 term changes no partial sum of
    # these non-negative values), without one gather per column.
    counts = torch.zeros(MAX_DIAG_LAG + 1, dtype=torch.int64, device=device).index_add_(
        0, b, torch.ones_like(b) if all_generated else gen.to(torch.int64))

    def by_lag(values: Tensor) -> Tensor:
        terms = values if all_generated else torch.where(gen, values, 0.0)
        return torch.zeros(MAX_DIAG_LAG + 1, dtype=torch.float64, device=device).index_add_(0, b, terms)

    state.update(n=counts, sum_abs=by_lag(diff))
    if bool(lag_max >= 0):
        state.update(lag_max=lag_max.to(torch.float64))
    if prox_logp is not None:
        k = lag.to(torch.float64)
        alpha = torch.where(k >= 1, (k - 1) / k.clamp_min(1), torch.zeros_like(k))
        err = (as_float(prox_logp).to(torch.float64) - (old + alpha * (new - old))).abs()
        state.update(n_prox=counts, sum_prox_err=by_lag(err))
    at0 = lag == 0
    d0 = diff[at0]
    if d0.numel():
        state.update(max_abs0=d0.max())
    s_sum = segment_sum(torch.where(at0, diff, 0.0), cu_seqlens, torch.float64)
    s_n = segment_count(at0, cu_seqlens)
    has = s_n > 0
    s_mean = s_sum / s_n.clamp_min(1)
    state.update(n_seq0=has.sum(), n_seq0_big=(has & (s_mean > BIG_SEQ_MISMATCH)).sum())
    update_top(state, s_mean, has, s_n, file_index=file_index, rows=rows, step=step)


def lags_compute(state: MetricState, *, tolerance: float = 0.01) -> dict[str, Any]:
    """``diag/lag0_n_tokens``, ``diag/lag0_abs_diff_mean``, ``diag/lag0_abs_diff_max``, ``diag/lag0_big_seq_frac``
    (lag-0 sequences with mean |new − old| > :data:`BIG_SEQ_MISMATCH`), ``diag/lag0_top``; ``diag/by_lag`` rows
    ``{lag, n_tokens, abs_diff_mean, prox_loglinear_error}`` (the last bin, ``overflow``, holds lags ≥ MAX_DIAG_LAG);
    with ``prox_logp``: ``diag/prox_loglinear_safe_lag`` (the largest k ≥ 1 with every observed lag in [1, k] at a
    mean error ≤ ``tolerance``, 0 when lag 1 already exceeds it; compare-prox's ``max_safe_lag`` rule) and
    ``diag/prox_beyond_safe_frac`` (generated tokens with a lag above it / generated tokens with lag ≥ 1)."""
    n = state["n"].tolist()
    total_n = sum(n)
    if total_n == 0:
        return {}
    sums = state["sum_abs"].tolist()
    n_prox = state["n_prox"].tolist()
    perr = state["sum_prox_err"].tolist()
    out: dict[str, Any] = {"diag/lag_max": int(float(state["lag_max"]))}
    if n[0]:
        out["diag/lag0_n_tokens"] = n[0]
        out["diag/lag0_abs_diff_mean"] = sums[0] / n[0]
        out["diag/lag0_abs_diff_max"] = float(state["max_abs0"])
    if int(state["n_seq0"]):
        out["diag/lag0_big_seq_frac"] = int(state["n_seq0_big"]) / int(state["n_seq0"])
        out["diag/lag0_n_seq"] = int(state["n_seq0"])
    out["diag/lag0_top"] = table_rows(state["top"])
    rows = []
    for k in range(MAX_DIAG_LAG + 1):
        if n[k]:
            row: dict[str, Any] = {"lag": k, "n_tokens": n[k], "abs_diff_mean": sums[k] / n[k]}
            if k == MAX_DIAG_LAG:
                row["overflow"] = True
            row["prox_loglinear_error"] = perr[k] / n_prox[k] if n_prox[k] else None
            rows.append(row)
    out["diag/by_lag"] = rows
    if sum(n_prox[1:]):
        safe = 0
        for k in range(1, MAX_DIAG_LAG):
            if n_prox[k] == 0:
                continue
            if perr[k] / n_prox[k] > tolerance:
                break
            safe = k
        out["diag/prox_loglinear_safe_lag"] = safe
        beyond = sum(n_prox[safe + 1:])
        out["diag/prox_beyond_safe_frac"] = beyond / sum(n_prox[1:])
    return out
