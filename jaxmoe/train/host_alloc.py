"""Keep freed host memory in the process (glibc): no mmap/munmap churn for XLA:CPU buffers.

XLA:CPU allocates every executable's outputs and temporaries with ``malloc`` on each call. With
glibc's defaults a large block is served by a fresh ``mmap`` and handed back with ``munmap`` when
freed, the heap is trimmed whenever its free top grows past a threshold, and each of XLA's worker
threads allocates from an arena of its own (mmap-backed heaps of at most 64 MiB); the next call
then touches fresh pages and pays a page fault for every 4 KiB (the coarse train step of
``bench/train_step.py``: 870 MB of page faults per step).

:func:`keep_freed_memory` sets ``M_MMAP_MAX=0`` (every block comes from the heap), an unbounded
``M_TRIM_THRESHOLD`` (the heap is never trimmed) and ``M_ARENA_MAX=1`` (every thread allocates
from the main heap), so memory freed by one call is reused by the next. The arena limit only binds
threads that have not allocated yet: call it before jax starts its backend. The price: the process
keeps its peak heap size until it exits. Not glibc (macOS, musl): nothing happens. Opt out with
``JAXMOE_SYSTEM_MALLOC=1``.

``jaxmoe train`` applies it at start-up, and so do ``bench/experts.py`` and ``bench/train_step.py``'s
jaxmoe worker. On a quiet machine it made no measurable difference to the train step; on a
2-core machine with other processes holding memory (the bench's peer workers) the step ran
markedly faster with it (docs/MEASUREMENTS.md, "Host allocator").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
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
    # M_TRIM_THRESHOLD -1: mallopt takes an int and glibc stores it as a size_t, so -1 is SIZE_MAX
    # (never trim). The largest positive int, 2 GiB, is not enough: a train step frees more than
    # that at once (bench/train_step.py's fine shape: the heap was trimmed by 2.9 GB and the next
    # step page-faulted 1.4 GB back in)
    _applied = (bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))
                and bool(mallopt(_M_ARENA_MAX, 1)))
    return _applied
