"""Confidence intervals shared by the core's statistics and the findings (torch-free): Student's t quantiles for
jackknife intervals and Wilson's score interval for fractions of units."""

from __future__ import annotations

import math

__all__ = ["jackknife_interval", "t975", "wilson"]

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 0.975 quantiles for 1 … 30 degrees of freedom (any statistics table)."""


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (1.96 beyond 30, ∞ below 1)."""
    if dof < 1:
        return math.inf
    return _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.4 / dof


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for a proportion ``k / n`` (Wilson 1927, JASA 22(158)): honest at k = 0 and at small n,
    where the normal interval collapses. ``(0, 1)`` when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def jackknife_interval(value: float, leave_one_out: list[float]) -> tuple[float, float]:
    """The 95 % interval ``value ± t(g − 1)·se`` from the g leave-one-group-out values, with the delete-a-group
    jackknife variance (g − 1)/g · Σ (θ_(k) − θ_(·))² (Efron & Stein 1981); (−∞, ∞) below two groups."""
    g = len(leave_one_out)
    if g < 2 or not math.isfinite(value):
        return -math.inf, math.inf
    mean = math.fsum(leave_one_out) / g
    half = t975(g - 1) * math.sqrt((g - 1) / g * math.fsum((x - mean) ** 2 for x in leave_one_out))
    return value - half, value + half
