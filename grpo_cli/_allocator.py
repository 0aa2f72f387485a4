"""glibc ``malloc`` settings for the streaming pass (set by the CLI, which owns its process; a library never is).

Every element-wise torch op on a CPU allocates its output afresh, a few MiB per op at the default
``--batch-tokens``. glibc serves blocks that large with ``mmap`` (its dynamic threshold rises only as far as the
largest block freed so far) and gives freed heap tops back to the kernel above ``M_TRIM_THRESHOLD``, so the same
megabytes are mapped, zero-filled page by page and unmapped again hundreds of times per batch. With the metric
threads that also serialises them on the kernel's memory-map lock. Keeping blocks up to 32 MiB on the heap and not
trimming it lets the allocator reuse them: measured on the 20 M-token benchmark dump, half the page faults and
about 10 % less CPU time in one thread, 10–15 % less wall time with two (``docs/performance.md``). The resident
set then stays at the high-water mark of one pass, which is what peak RSS measures anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory"]

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap and are reused (glibc's largest allowed value on 64-bit systems)."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap's top kept for reuse rather than returned to the kernel."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Apply the settings above where the C library is glibc; returns whether they were applied.

    Example:
        >>> isinstance(keep_freed_memory(), bool)
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: other libcs' mallopt (musl's stub) has other semantics  # noqa: B018
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
