"""Shared by the tests: whether torchtitan imports here and its skip mark (parity, DCP checkpoints,
cross-framework resume), and a free local port (the multi-process tests)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import socket

import numpy as np
import pytest


def titan_importable() -> bool:
    """torchtitan's models and its checkpoint manager import (``pip install -e '.[titan]'``)."""
    try:
        return bool(__import__("torchtitan.models.deepseek_v3")) and bool(
            __import__("torchtitan.components.checkpoint"))
    except Exception:  # noqa: BLE001 (a missing dependency of torchtitan: triton, tyro, spmd_types, torch)
        return False


needs_titan = pytest.mark.skipif(not titan_importable(),
                                 reason="torchtitan is not importable: pip install -e '.[titan]'")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo / jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident(path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` on a read-only map: mapping faults
    nothing in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(mm, np.uint8)
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del view
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        mm.close()
