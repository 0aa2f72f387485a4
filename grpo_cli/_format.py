"""How numbers read in every message and report (one format, shared by the commands' messages and the renderers)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["format_value"]


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1e5 or magnitude < 1e-3:
            return f"{value:.4e}"
        return f"{value:.6g}"
    return str(value)
