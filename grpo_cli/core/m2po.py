"""AReaL's M2PO masking (:func:`~grpo_cli.core.rejection.m2po_mask`) as a *streamed* figure over a whole dump.

M2PO sorts the second moments ``M2 = (old − prox)²`` of the valid tokens in descending order ``v₁ ≥ v₂ ≥ …`` and
masks the ``k`` largest, ``k`` the first index whose tail mean ``mean(v_{k+1..n})`` is below the threshold τ
(``n − 1`` when none is; non-finite values sort first and are always masked). That is a global rule — it depends on
the largest values *and* on the sum of all the others — so it cannot be applied batch by batch (AReaL applies it
per micro-batch, which makes its figure depend on micro-batching; ours is the rule applied to the whole dump).

Streaming it exactly in one pass: removing the largest value never raises a tail mean, so

    k = min{ j : (S − P_j) / (n − j) < τ },   S = Σ v,  P_j = v₁ + … + v_j,

needs only the exact float64 total ``S``, the count ``n`` and the largest values themselves. The state keeps the
``top_k`` (default :data:`M2PO_TOP_K`) largest values exactly (a ``topk`` entry, mergeable), so whenever M2PO masks
at most ``top_k`` tokens the figure is *exact* (``m2po/exact`` true) and batch-independent. When it masks more, the
rest of the walk uses a fixed-edge histogram of M2 (:mod:`grpo_cli.core.histogram`, bin midpoints within 0.39 % of
each value): the count is then an estimate and ``m2po/exact`` is false. A two-pass alternative (histogram first,
then exact values of one bin) was rejected: ``analyze`` reads the dump once, and one bin can hold every token.
Comparisons use float64 sums in a different order than ``m2po_mask``'s cumulative sums, so a tail mean within
rounding of τ could in principle fall the other way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.histogram import N_BINS, OVERFLOW, UNDERFLOW, ZERO, bin_edges, histogram_counts
from grpo_cli.core.offpolicy import working_logp
from grpo_cli.core.state import MetricState, count, top_rows, total

__all__ = ["M2PO_TOP_K", "m2po_stream_compute", "m2po_stream_state", "m2po_stream_update"]

M2PO_TOP_K = 8192
"""How many of the largest second moments are kept exactly (64 KiB of state)."""


def m2po_stream_state(top_k: int = M2PO_TOP_K, device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`m2po_stream_update` keeping the ``top_k`` largest M2 values exactly."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    specs = {
        "n": count(),
        "n_nonfinite": count(),
        "sum_m2": total(),
        "top": top_rows(top_k, 1),
        "hist": count((N_BINS,)),
    }
    return MetricState(specs, device)


def m2po_stream_update(state: MetricState, *, old_logp: Tensor, prox_logp: Tensor, temperature: float = 1.0) -> None:
    """Fold one batch of valid tokens: their M2 = (old − prox)² in float64, as :func:`m2po_mask` computes it."""
    old = working_logp(old_logp, temperature).detach().to(torch.float64)
    prox = working_logp(prox_logp, temperature).detach().to(torch.float64)
    delta = old - prox
    m2 = delta * delta
    finite = torch.isfinite(m2)
    values = m2[finite]
    state.update(n=torch.tensor(m2.numel()), n_nonfinite=(~finite).sum(), hist=histogram_counts(values))
    if values.numel():
        state.update(sum_m2=values.sum())
        # Only values above the smallest kept one can enter the table (equal ones are interchangeable): skipping
        # the rest keeps tiny batches from re-sorting the whole table.
        candidates = values[values > state["top"][-1, 0]]
        if candidates.numel():
            k = min(state["top"].shape[0], candidates.numel())
            state.update(top=torch.topk(candidates, k).values.unsqueeze(1))


def _bin_value(b: int, ceiling: float) -> float:
    # A representative of the values left in bin b; they all lie at or below the smallest kept value ``ceiling``.
    if b == ZERO:
        return 0.0
    if b == UNDERFLOW:
        return 0.0
    if b == OVERFLOW:
        return ceiling
    lo, hi = bin_edges(b)
    return min((lo + hi) / 2, ceiling)


def m2po_stream_compute(state: MetricState, threshold: float) -> dict[str, Any]:
    """``m2po/masked_fraction`` (tokens M2PO would mask with ``threshold`` / valid tokens), ``m2po/m2_mean``
    (mean finite M2: M2PO masks nothing when it is below τ) and ``m2po/exact``; ``{}`` when no token was seen."""
    n = int(state["n"])
    if n == 0:
        return {}
    tau = float(threshold)
    n_bad = int(state["n_nonfinite"])
    n_fin = n - n_bad
    total_m2 = float(state["sum_m2"])
    top = state["top"][:, 0].detach().to("cpu", torch.float64)
    top = top[top > -math.inf]  # filled rows, already in descending order
    exact = True
    j_star: int | None = None
    if n_fin > 0:
        last = min(top.numel(), n_fin - 1)  # the tail must keep at least one value
        prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(top, 0)])[: last + 1]
        j = torch.arange(last + 1, dtype=torch.float64)
        hits = torch.nonzero((total_m2 - prefix) / (n_fin - j) < tau).flatten()
        if hits.numel():
            j_star = int(hits[0])
        elif top.numel() < n_fin:
            j_star = _walk_histogram(state["hist"], top, total_m2, n_fin, tau)
            exact = False
    n_masked = n - 1 if j_star is None else min(n_bad + j_star, n - 1)
    out: dict[str, Any] = {"m2po/masked_fraction": n_masked / n, "m2po/exact": exact}
    if n_fin > 0:
        out["m2po/m2_mean"] = total_m2 / n_fin
    return out


def _walk_histogram(hist: Tensor, top: Tensor, total_m2: float, n_fin: int, tau: float) -> int | None:
    """Continue the search for k past the exact top values with the histogram of the remaining ones."""
    k0 = top.numel()
    remaining = hist.detach().to("cpu", torch.int64) - histogram_counts(top)
    ceiling = float(top[-1])
    # D(j) = S − P_j − τ·(n − j); the rule stops at the first j with D(j) < 0, and D(j + 1) = D(j) − (v_{j+1} − τ).
    deficit = total_m2 - float(top.sum()) - tau * (n_fin - k0)
    j = k0
    order = [OVERFLOW, *range(OVERFLOW - 1, UNDERFLOW, -1), UNDERFLOW, ZERO]
    for b in order:
        c = int(remaining[b])
        if c == 0:
            continue
        v = _bin_value(b, ceiling)
        if v <= tau:
            return None  # removing values ≤ τ never brings the tail mean below τ
        need = max(math.floor(deficit / (v - tau)) + 1, 1)
        if need <= c:
            return j + need if j + need <= n_fin - 1 else None
        deficit -= c * (v - tau)
        j += c
        if j > n_fin - 1:
            return None
    return None
