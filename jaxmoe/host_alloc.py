"""Keep freed host memory in the process (glibc): no mmap/munmap churn for XLA:CPU buffers.

XLA:CPU allocates every executable's outputs and temporaries with ``malloc`` on each call. With
glibc's defaults a large block is served by a fresh ``mmap`` and handed back with ``munmap`` when
freed, and the heap is trimmed whenever its free top grows past a threshold; the next call then
touches fresh pages and pays a page fault for every 4 KiB (figures: docs/MEASUREMENTS.md, "Host
allocator").

:func:`keep_freed_memory` sets ``M_MMAP_MAX=0`` (every block comes from the heap) and a huge
``M_TRIM_THRESHOLD`` (the heap is never trimmed), so memory freed by one call is reused by the
next. The price: the process keeps its peak heap size until it exits. Not glibc (macOS, musl):
nothing happens. Opt out with ``JAXMOE_SYSTEM_MALLOC=1``.

Only ``bench/experts.py`` applies it: it alternates very different executables (the dense and
ragged paths churn hundreds of MB per call) and times the next one. ``jaxmoe train`` does not: it
calls the same step executable over and over, where the setting made no measurable difference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the glibc settings once per process; True if they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("JAXMOE_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied
