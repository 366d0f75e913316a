"""Swapping the last two axes of numpy arrays fast: jaxmoe stores some weights transposed from
their HF / torchtitan orientation (``[in, out]`` against ``nn.Linear``'s ``[out, in]``), so every
format that reads or writes those (``hf:``, ``torch:``, ``dcp:``, ``orbax:`` from them) copies
through here, in cache-sized tiles rather than one strided copy.
"""

from __future__ import annotations

import numpy as np


def transpose_into(dst: np.ndarray, src: np.ndarray, tile: int | None = None) -> None:
    """``dst[...] = src`` with its last two dims swapped (2-D: the transpose), in column tiles.

    A tile is ``tile`` columns of ``dst`` (default one 64-byte cache line: 16 fp32 / 32 bf16)
    and as many rows of ``src``: both stay in cache, where ``dst[...] = src.T`` strides through
    memory (several times slower; docs/MEASUREMENTS.md, "Conversion"). Stacked arrays go matrix
    by matrix.
    """
    if tile is None:
        tile = max(8, 64 // dst.dtype.itemsize)
    if src.ndim > 2:
        for i in range(src.shape[0]):
            transpose_into(dst[i], src[i], tile)
        return
    if src.ndim != 2:
        dst[...] = src.T
        return
    for j in range(0, src.shape[0], tile):
        dst[:, j : j + tile] = src[j : j + tile].T


def transposed(src: np.ndarray, dtype=None) -> np.ndarray:
    """``src`` with its last two axes swapped (``src.T`` for 2-D; a fused ``[E, a, b]`` ->
    ``[E, b, a]``) as a C-contiguous array, optionally cast: a copy made with
    :func:`transpose_into`, or ``src``'s own memory when ``src`` is a transposed view of it."""
    back = np.swapaxes(src, -1, -2)  # src a transposed view (HfLeafView): no bytes to move
    if back.flags.c_contiguous and (dtype is None or np.dtype(dtype) == src.dtype):
        return back
    out = np.empty(src.shape[:-2] + (src.shape[-1], src.shape[-2]), dtype or src.dtype)
    transpose_into(out, src)
    return out


__all__ = ["transpose_into", "transposed"]
