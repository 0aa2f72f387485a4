"""Fixed-edge histograms of non-negative values, mergeable by summing int64 counts, and quantiles from them.

The bins are the float32 binades ``[2^e, 2^(e+1))`` for ``e`` in ``[MIN_EXPONENT, MAX_EXPONENT)``, each split into
``2^MANTISSA_BITS`` equal parts (the HDR-histogram layout). A value's bin is read straight off its float32 bit
pattern (``bits >> (23 − MANTISSA_BITS)``), so assignment is exact: no ``log``, no rounding at the edges, the same
bin on every device. Counting is an unweighted integer ``bincount``, which is deterministic on CPU and CUDA (unlike
``histc`` or a weighted ``bincount``, see torch's ``histc``/``bincount`` notes), and two histograms merge by
adding their counts, so a histogram does not depend on batching, workers or ranks.

Each bin ``[lo, hi)`` has ``hi − lo = 2^(e − MANTISSA_BITS) ≤ lo · 2^−MANTISSA_BITS``; reporting its midpoint
is within ``2^−(MANTISSA_BITS + 1)`` of any value in it, relative to that value. Float64 inputs are first rounded
to float32 (a monotone map, so order statistics commute with it) which adds at most ``2^−24``: hence
:data:`QUANTILE_REL_ERROR`. Outside ``[2^MIN_EXPONENT, 2^MAX_EXPONENT)`` there is no relative bound: values below
fall in an *underflow* bin (absolute error < 2^MIN_EXPONENT), values above (and +inf) in an *overflow* bin whose
quantiles are reported as the exact maximum. Exact zeros have their own bin; NaN and negative values are counted
as *invalid* and take no part in quantiles.

Example:
    >>> counts = histogram_counts(torch.tensor([0.5, 1.0, 1.0, 2.0, 4.0]))
    >>> [round(q, 3) for q in histogram_quantiles(counts, [0.2, 0.5, 1.0], vmin=0.5, vmax=4.0)]
    [0.502, 1.004, 4.0]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.state import MetricState, StateSpec, count, maximum, minimum, total

__all__ = [
    "DEFAULT_QUANTILES",
    "INVALID",
    "MANTISSA_BITS",
    "MAX_EXPONENT",
    "MIN_EXPONENT",
    "N_BINS",
    "OVERFLOW",
    "QUANTILE_REL_ERROR",
    "UNDERFLOW",
    "ZERO",
    "bin_edges",
    "display_histogram",
    "distribution_compute",
    "distribution_specs",
    "distribution_update",
    "histogram_bins",
    "histogram_counts",
    "histogram_quantiles",
    "quantile_rank",
]

MANTISSA_BITS = 7
"""Sub-bins per binade: 2^7 = 128, so a bin is at most 0.78 % wide."""
MIN_EXPONENT = -64
MAX_EXPONENT = 64
"""Binades covered: ``[2^−64, 2^64)`` ≈ ``[5.4e−20, 1.8e19)``."""

_SHIFT = 23 - MANTISSA_BITS
_FIRST_KEY = (127 + MIN_EXPONENT) << MANTISSA_BITS  # bits >> _SHIFT of 2^MIN_EXPONENT
N_MAIN = (MAX_EXPONENT - MIN_EXPONENT) << MANTISSA_BITS

ZERO = 0
UNDERFLOW = 1
_MAIN0 = 2
OVERFLOW = _MAIN0 + N_MAIN
INVALID = OVERFLOW + 1
N_BINS = INVALID + 1
"""Bin layout: ``[ZERO, UNDERFLOW, main bins in increasing order..., OVERFLOW, INVALID]``."""

QUANTILE_REL_ERROR = 2.0 ** -(MANTISSA_BITS + 1) + 2.0**-24
"""Bound on ``|q̂ − q| / |q|`` for a quantile ``q`` in ``[2^MIN_EXPONENT, 2^MAX_EXPONENT)`` (≈ 0.39 %)."""

DEFAULT_QUANTILES: dict[str, float] = {"p001": 0.001, "p01": 0.01, "p50": 0.5, "p99": 0.99, "p999": 0.999}
"""Reported quantiles, by key suffix (p001 is the 0.1 % quantile)."""


def histogram_bins(values: Tensor) -> Tensor:
    """The int64 bin index of every value (same shape), see the module layout.

    Example:
        >>> histogram_bins(torch.tensor([0.0, 1.0, float("nan"), -1.0, float("inf")])).tolist()[2:]
        [16387, 16387, 16386]
    """
    return _bins32(values).to(torch.int64)


def _bins32(values: Tensor) -> Tensor:
    """:func:`histogram_bins` as int32 (every index fits), built in place: fresh full-size temporaries, not the
    arithmetic, are what this costs on a CPU."""
    x = values.detach().to(torch.float32)
    # The key bits >> _SHIFT of a positive value is its main bin shifted by a constant; keys past the top land on
    # OVERFLOW (the next index) and below the bottom on UNDERFLOW (the previous one), so one clamp places every
    # positive value, +inf included. The sign bit makes negative values (−0.0, −NaN) negative keys.
    idx = (x.view(torch.int32) >> _SHIFT).sub_(_FIRST_KEY - _MAIN0).clamp_(UNDERFLOW, OVERFLOW)
    # Zeros, negative values and NaN are rare: on a CPU one reduction says which of the two masks below are needed
    # (amin propagates NaN, which then fails both tests and takes the full path); a GPU builds both masks faster
    # than it would sync for the answer.
    low = float(x.amin()) if x.numel() and x.device.type == "cpu" else -math.inf
    if low > 0:
        return idx
    idx.masked_fill_(x == 0, ZERO)  # +0.0 and −0.0
    if low == 0:  # nothing below ±0.0 and no NaN
        return idx
    return idx.masked_fill_(~(x >= 0), INVALID)  # exactly NaN and negative values fail x >= 0


def histogram_counts(values: Tensor) -> Tensor:
    """``[N_BINS]`` int64 counts of ``values`` (an unweighted ``bincount``: deterministic on every device)."""
    return torch.bincount(_bins32(values).reshape(-1), minlength=N_BINS)


def bin_edges(index: int) -> tuple[float, float]:
    """``[lo, hi)`` of a main bin (exact Python floats).

    Example:
        >>> bin_edges(histogram_bins(torch.tensor([1.0])).item())
        (1.0, 1.0078125)
    """
    if not _MAIN0 <= index < OVERFLOW:
        raise ValueError(f"bin {index} is not a main bin")
    key = index - _MAIN0 + _FIRST_KEY
    exponent, sub = divmod(key, 1 << MANTISSA_BITS)
    lo = math.ldexp(1.0 + sub / (1 << MANTISSA_BITS), exponent - 127)
    return lo, lo + math.ldexp(1.0, exponent - 127 - MANTISSA_BITS)


def quantile_rank(q: float, n: int) -> int:
    """1-based rank of the lower (inverted-CDF) ``q``-quantile of ``n`` values: ``max(1, ⌈q·n⌉)``, in exact
    rational arithmetic so that e.g. ``q = 0.001, n = 1000`` gives rank 1, not 2."""
    return max(1, math.ceil(Fraction(str(q)) * n))


def histogram_quantiles(counts: Tensor, qs: Sequence[float], *, vmin: float, vmax: float) -> list[float]:
    """Lower quantiles (``x_(k)``, ``k = quantile_rank(q, n)``) of the values counted in ``counts``.

    A main bin is reported by its midpoint clamped to the exact ``[vmin, vmax]`` (still inside the interval that
    holds the true value, so the :data:`QUANTILE_REL_ERROR` bound holds); the zero bin by 0; the underflow bin by
    ``2^(MIN_EXPONENT − 1)`` clamped likewise; the overflow bin by ``vmax``. Invalid values are ignored.
    Returns NaN for every ``q`` when no valid value was counted.
    """
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
    c = counts.detach().to("cpu", torch.int64)
    c[INVALID] = 0
    n = int(c.sum())
    if n == 0:
        return [math.nan] * len(qs)
    cumulative = torch.cumsum(c, 0)
    out = []
    for q in qs:
        k = quantile_rank(q, n)
        b = int(torch.searchsorted(cumulative, torch.tensor(k)))  # first bin with cumulative ≥ k
        if b == ZERO:
            value = 0.0
        elif b == UNDERFLOW:
            value = math.ldexp(1.0, MIN_EXPONENT - 1)
        elif b == OVERFLOW:
            value = vmax
        else:
            lo, hi = bin_edges(b)
            value = (lo + hi) / 2
        out.append(min(max(value, vmin), vmax))
    return out


@functools.lru_cache(maxsize=1)
def _main_midpoints() -> Tensor:
    return torch.tensor([sum(bin_edges(i)) / 2 for i in range(_MAIN0, OVERFLOW)], dtype=torch.float64)


def display_histogram(counts: Tensor, *, lo: float, hi: float, n_bins: int = 24) -> dict[str, Any]:
    """A coarse, log-spaced view of a fine histogram between ``lo`` and ``hi`` (for tables and JSON readers).

    Fine bins are assigned to display bins by their midpoint, so display edges are fuzzy by one fine bin (≤ 0.8 %);
    the figures themselves never come from this view. ``below`` counts zeros, underflow and fine bins under ``lo``;
    ``above`` the overflow bin and fine bins over ``hi``. With ``lo == hi`` there is one display bin.

    Returns:
        ``{"scale": "log", "edges": [n + 1 floats], "counts": [n ints], "zero": int, "below": int, "above": int}``.
    """
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise ValueError(f"display range must satisfy 0 < lo <= hi < inf, got [{lo}, {hi}]")
    c = counts.detach().to("cpu", torch.int64)
    n_bins = 1 if lo == hi else n_bins
    edges = [lo * (hi / lo) ** (i / n_bins) for i in range(n_bins + 1)] if lo < hi else [lo, hi]
    occupied = torch.nonzero(c[_MAIN0:OVERFLOW]).flatten()
    mids = _main_midpoints()[occupied]
    main = c[_MAIN0:OVERFLOW][occupied]
    # Tolerate one fine bin of fuzz: lo/hi are clamped quantiles, so their fine bin's midpoint may lie outside.
    inside = (mids >= lo * (1 - 2.0**-MANTISSA_BITS)) & (mids <= hi * (1 + 2.0**-MANTISSA_BITS))
    where = torch.bucketize(mids, torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    binned = torch.zeros(n_bins, dtype=torch.int64).index_add_(0, where[inside], main[inside])
    low_side = mids < lo
    return {
        "scale": "log",
        "edges": edges,
        "counts": binned.tolist(),
        "zero": int(c[ZERO]),
        "below": int(c[ZERO] + c[UNDERFLOW] + main[~inside & low_side].sum()),
        "above": int(c[OVERFLOW] + main[~inside & ~low_side].sum()),
    }


# -- a distribution: exact moments + the histogram --------------------------------------------------------------


def distribution_specs(prefix: str) -> dict[str, StateSpec]:
    """State entries of one streamed distribution: ``n``, shifted ``Σ(x − c)``, ``Σ(x − c)²``, min, max, histogram."""
    return {
        f"{prefix}_n": count(),
        f"{prefix}_s1": total(),
        f"{prefix}_s2": total(),
        f"{prefix}_min": minimum(),
        f"{prefix}_max": maximum(),
        f"{prefix}_hist": count((N_BINS,)),
    }


def distribution_update(state: MetricState, prefix: str, values: Tensor, *, shift: float = 0.0) -> None:
    """Fold non-negative ``values`` into the entries of :func:`distribution_specs`.

    ``shift`` is subtracted before the float64 moment sums (1 for ratios, 0 for log-prob differences) so that the
    variance ``E[(x − c)²] − E[x − c]²`` does not cancel catastrophically when the values sit near ``c``; that keeps
    the standard deviation batch-size independent to ~1e−15 instead of ~1e−8.
    """
    n = values.numel()
    state.update(**{f"{prefix}_n": torch.tensor(n), f"{prefix}_hist": histogram_counts(values)})
    if n == 0:
        return
    centred = values.to(torch.float64) - shift
    state.update(
        **{
            f"{prefix}_s1": centred.sum(),
            f"{prefix}_s2": (centred * centred).sum(),
            f"{prefix}_min": values.min(),
            f"{prefix}_max": values.max(),
        }
    )


def distribution_compute(
    state: MetricState,
    prefix: str,
    *,
    shift: float = 0.0,
    quantiles: dict[str, float] | None = None,
    display_bins: int = 24,
) -> dict[str, Any]:
    """``mean``, ``std`` (population), ``min``, ``max``, the quantiles and a ``hist`` display view; ``{}`` when
    nothing was seen. Keys are the bare suffixes (``"mean"``, ``"p50"``, ``"hist"``, ...)."""
    n = int(state[f"{prefix}_n"])
    if n == 0:
        return {}
    quantiles = DEFAULT_QUANTILES if quantiles is None else quantiles
    m1 = float(state[f"{prefix}_s1"]) / n
    m2 = float(state[f"{prefix}_s2"]) / n
    vmin, vmax = float(state[f"{prefix}_min"]), float(state[f"{prefix}_max"])
    counts = state[f"{prefix}_hist"]
    out: dict[str, Any] = {"mean": shift + m1, "std": math.sqrt(max(m2 - m1 * m1, 0.0)), "min": vmin, "max": vmax}
    # The display spans the 0.1 %–99.9 % quantiles, so a few spikes do not squash the bulk into one bar.
    *values, lo_q, hi_q = histogram_quantiles(counts, [*quantiles.values(), 0.001, 0.999], vmin=vmin, vmax=vmax)
    out.update(zip(quantiles, values))
    positive = [v for v in (lo_q, hi_q) if v > 0 and math.isfinite(v)]
    if positive:
        lo = lo_q if lo_q > 0 else min(positive)
        hi = hi_q if math.isfinite(hi_q) and hi_q > 0 else max(positive)
        out["hist"] = display_histogram(counts, lo=lo, hi=hi, n_bins=display_bins)
    return out
