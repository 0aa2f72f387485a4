"""Staleness and the step-0 sanity check as a functional core.

Over valid *generated* tokens (behaviour version ``v ≥ 0``) with the trainer's current version ``c`` (per sequence
or one int, see :func:`~grpo_cli.core.prox.broadcast_current_version`):

- lag ``k = c − v`` (AReaL ``sample_staleness_theta``) and ``k − 1 = c − 1 − v`` (``sample_staleness_proximal``,
  v_prox = c − 1): token-weighted mean over the whole dump and *global* extrema (AReaL logs the mean of
  micro-batch means and the mean of micro-batch maxima instead);
- ``staleness/hist``: tokens per lag, in :data:`N_LAG_BINS` fixed bins (lags ``0 … MAX_LAG − 1``, one overflow
  bin for lags ≥ :data:`MAX_LAG`, one for negative lags, i.e. tokens stamped with a version newer than the
  trainer's, which points at a broken dump) so the state stays bounded;
- ``by_staleness``: per lag bin, tokens, mean k3 KL (new vs old), PPO clip fraction, mean IS weight
  ``w = exp(new − old)`` and mean ``|new − old|``, to see whether stale samples are the ones that clip;
- ``sanity/on_policy_ratio_dev`` = max |w − 1| over lag-0 tokens (sampled by the trainer's own weights, so
  w ≡ 1 up to numerics; slime checks this in CI).

Per-bin float sums (:func:`lag_bin_sums`) are segmented sums over runs of equal lag followed by ordinary
reductions per bin, never atomics, so the figures are bit-reproducible on CUDA too; per-bin counts are an integer
``bincount``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.kl import kl_estimate
from grpo_cli.core.offpolicy import working_logp
from grpo_cli.core.prox import broadcast_current_version
from grpo_cli.core.state import MetricState, count, maximum, minimum, total

__all__ = [
    "MAX_LAG", "N_LAG_BINS", "lag_bin_sums", "lag_bins", "staleness_compute", "staleness_state", "staleness_update",
]

MAX_LAG = 64
"""Lags ``0 … MAX_LAG − 1`` get a bin each; larger lags share the overflow bin."""
_OVERFLOW = MAX_LAG
_NEGATIVE = MAX_LAG + 1
N_LAG_BINS = MAX_LAG + 2


def staleness_state(device: torch.device | str | None = None) -> MetricState:
    """An empty state for :func:`staleness_update`."""
    bins = (N_LAG_BINS,)
    specs = {
        "n": count(),
        "sum_lag": count(),  # an exact int64 sum of integer lags
        "min_lag": minimum(),
        "max_lag": maximum(),
        "hist": count(bins),
        "n_old": count(),
        "k3": total(bins),
        "w": total(bins),
        "abs_diff": total(bins),
        "n_clip_tokens": count(),
        "clipped": count(bins),
        "n_on_policy": count(),
        "on_policy_dev": maximum(),
    }
    return MetricState(specs, device)


def lag_bins(lag: Tensor, max_lag: int = MAX_LAG, *, lowest: Tensor | None = None) -> Tensor:
    """The bin of each integer lag: its own for ``0 … max_lag − 1``, ``max_lag`` for larger lags (overflow),
    ``max_lag + 1`` for negative ones (a version newer than the trainer's). ``lowest``: ``lag.min()`` if the caller
    has it; a negative lag means a broken dump, so the negative bin's mask is built only when one occurs.

    Example:
        >>> lag_bins(torch.tensor([0, 3, 9, -2]), max_lag=4).tolist()
        [0, 3, 4, 5]
    """
    bins = lag.clamp(max=max_lag)
    if lag.numel() and (lag.min() if lowest is None else lowest) < 0:
        bins = torch.where(lag < 0, max_lag + 1, bins)
    return bins


def lag_bin_sums(bins: Tensor, present: list[int], columns: list[Tensor], n_bins: int = N_LAG_BINS) -> list[Tensor]:
    """Float64 ``Σ values`` per lag bin for each tensor of ``columns`` (``present``: the bins that occur).

    Tokens of one sequence usually share a lag, so the bins form long runs in token order: each column is summed
    run by run (a segmented reduction, in token order within a run), and the run sums of each bin are then added
    with an ordinary (pairwise) reduction. No float ``index_add_`` (whose CUDA atomics would make the last bits
    depend on scheduling) and no full-length mask per bin: the figures are bit-reproducible on every device and
    agree with any other summation order to float64 rounding.

    Example:
        >>> bins = torch.tensor([0, 0, 2, 2, 0])
        >>> lag_bin_sums(bins, [0, 2], [torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])], n_bins=3)[0].tolist()
        [8.0, 0.0, 7.0]
    """
    run_bins, run_lengths = torch.unique_consecutive(bins, return_counts=True)
    in_bin = {b: run_bins == b for b in present} if len(present) > 1 else {}
    outs = []
    for values in columns:
        out = torch.zeros(n_bins, dtype=torch.float64, device=bins.device)
        if values.numel():
            runs = torch.segment_reduce(values.to(torch.float64), "sum", lengths=run_lengths, unsafe=True)
            for b in present:
                out[b] = runs.sum() if len(present) == 1 else torch.where(in_bin[b], runs, 0.0).sum()
        outs.append(out)
    return outs


def staleness_update(
    state: MetricState,
    *,
    new_logp: Tensor,
    versions: Tensor,
    current_version: int | Tensor,
    cu_seqlens: Tensor,
    old_logp: Tensor | None = None,
    ratio_base_logp: Tensor | None = None,
    advantages: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
    kl_clamp: float | None = None,
) -> None:
    """Fold one batch of valid tokens into ``state``.

    Args:
        state: from :func:`staleness_state`.
        new_logp: ``[N]`` log π_θ of the valid tokens.
        versions: ``[N]`` int behaviour versions (``< 0``: prompt tokens, skipped).
        current_version: the trainer's version: an int, or ``[B]`` per sequence (with ``cu_seqlens``).
        cu_seqlens: ``[B + 1]`` offsets of the valid tokens.
        old_logp: ``[N]`` behaviour log-probs (k3, w, |x|, the sanity check).
        ratio_base_logp: ``[N]`` base of the PPO ratio for the clip fraction (default ``old_logp``).
        advantages: ``[N]`` advantages (the clip fraction needs them).
        epsilon, epsilon_high: PPO clip widths, as for ``clip/ratio``.
        temperature: sampling temperature (log-probs are rescaled by it).
        kl_clamp: ``--kl-clamp`` for the per-lag k3, as for ``kl/k3``.
    """
    current = broadcast_current_version(current_version, versions, cu_seqlens=cu_seqlens)
    # The generated tokens' positions, found once and gathered from every column (boolean indexing would search
    # the mask again per column).
    everything = bool(versions.min() >= 0) if versions.numel() else True  # usual: valid tokens are generated ones
    generated = None if everything else torch.nonzero(versions >= 0).flatten()
    n = versions.numel() if generated is None else generated.numel()
    if n == 0:
        return

    def pick(values: Tensor) -> Tensor:
        return values if generated is None else values.index_select(0, generated)

    lag = pick(current.to(torch.int64)) - pick(versions.to(torch.int64))
    min_lag = lag.min()
    bins = lag_bins(lag, lowest=min_lag)
    hist = torch.bincount(bins, minlength=N_LAG_BINS)
    state.update(n=torch.tensor(n), sum_lag=lag.sum(), min_lag=min_lag, max_lag=lag.max(), hist=hist)
    new = pick(working_logp(new_logp, temperature))
    if old_logp is not None:
        old = pick(working_logp(old_logp, temperature))
        x = new - old
        w = torch.exp(x)
        present = torch.nonzero(hist).flatten().tolist()
        k3, w_sum, abs_diff = lag_bin_sums(bins, present, [kl_estimate(old, new, "k3", kl_clamp), w, x.abs()])
        state.update(n_old=torch.tensor(n), k3=k3, w=w_sum, abs_diff=abs_diff)  # k3: eˣ − 1 − x, as kl/k3
        if hist[0] > 0:  # lag-0 tokens (bin 0 holds exactly lag 0)
            on_policy = lag == 0
            state.update(n_on_policy=hist[0], on_policy_dev=(w[on_policy].to(torch.float64) - 1).abs().max())
    base = old_logp if ratio_base_logp is None else ratio_base_logp
    if base is not None and advantages is not None:
        eps_high = epsilon if epsilon_high is None else epsilon_high
        ratio = torch.exp(new - pick(working_logp(base, temperature)))
        adv = pick(advantages)
        # The GRPO clip set of policy_stats (clip/ratio): r < 1 − ε with A < 0, or r > 1 + ε_high with A > 0.
        clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        state.update(n_clip_tokens=torch.tensor(n), clipped=torch.bincount(bins[clipped], minlength=N_LAG_BINS))


def _lag_label(b: int, lag_max: int) -> dict[str, Any]:
    if b == _OVERFLOW:
        return {"lag": MAX_LAG, "overflow": True, "lag_max": lag_max}
    if b == _NEGATIVE:
        return {"lag": -1, "underflow": True}
    return {"lag": b}


def staleness_compute(state: MetricState) -> dict[str, Any]:
    """``staleness/n_tokens``, ``staleness/theta_{mean,min,max}``, ``staleness/proximal_{mean,min,max}``,
    ``staleness/hist``, ``by_staleness``, ``sanity/n_on_policy_tokens`` and ``sanity/on_policy_ratio_dev``.

    Histogram and cross-tab rows exist for non-empty lag bins only, in the order lag 0, 1, …, overflow
    (``{"lag": MAX_LAG, "overflow": true, "lag_max": largest lag}``: lags ≥ MAX_LAG), negative
    (``{"lag": -1, "underflow": true}``).
    """
    s = state
    n = int(s["n"])
    if n == 0:
        return {}
    mean = int(s["sum_lag"]) / n
    lo, hi = int(s["min_lag"]), int(s["max_lag"])
    out: dict[str, Any] = {
        "staleness/n_tokens": n,
        "staleness/theta_mean": mean,
        "staleness/theta_min": lo,
        "staleness/theta_max": hi,
        # v_prox = c − 1, so the proximal staleness is the theta staleness minus one, token by token.
        "staleness/proximal_mean": mean - 1,
        "staleness/proximal_min": lo - 1,
        "staleness/proximal_max": hi - 1,
    }
    hist = s["hist"].cpu().tolist()
    order = [*range(MAX_LAG), _OVERFLOW, _NEGATIVE]
    out["staleness/hist"] = [{**_lag_label(b, hi), "n_tokens": hist[b]} for b in order if hist[b] > 0]
    has_old, has_clip = int(s["n_old"]) > 0, int(s["n_clip_tokens"]) > 0
    k3, w, absd = (s[name].cpu().tolist() for name in ("k3", "w", "abs_diff"))
    clipped = s["clipped"].cpu().tolist()
    rows = []
    for b in order:
        if hist[b] == 0:
            continue
        row: dict[str, Any] = {**_lag_label(b, hi), "n_tokens": hist[b]}
        if has_old:
            row["kl/k3"] = k3[b] / hist[b]
        if has_clip:
            row["clip/ratio"] = clipped[b] / hist[b]
        if has_old:
            row["is/mean"] = w[b] / hist[b]
            row["abs_diff/mean"] = absd[b] / hist[b]
        rows.append(row)
    out["by_staleness"] = rows
    if has_old:
        out["sanity/n_on_policy_tokens"] = int(s["n_on_policy"])
        if int(s["n_on_policy"]) > 0:
            out["sanity/on_policy_ratio_dev"] = float(s["on_policy_dev"])
    return out
