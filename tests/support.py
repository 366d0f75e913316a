"""Shared by the tests: whether torchtitan imports here and its skip mark (parity, DCP checkpoints,
cross-framework resume), and a free local port (the multi-process tests)."""

from __future__ import annotations

import socket

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
