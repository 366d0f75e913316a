"""Partial reads of one array of an Orbax checkpoint: a layer's or an expert's slice of a leaf.

Orbax restores whole leaves; a stacked expert leaf ``[L, E, D, I]`` of a DeepSeek-V3-sized model
is hundreds of GB. The arrays Orbax writes are Zarr arrays in an OCDBT key-value store (one per
leaf, named by the pytree path joined with ``.``), which TensorStore opens directly and reads
any box of, decoding only the chunks that box touches. :class:`LeafSlices` reads one chunk-row
of the leading (layer, expert) axes at a time, so memory holds at most one Zarr chunk of the leaf
(``jaxmoe convert --to orbax:`` writes chunks of at most 4 MiB, see
:data:`jaxmoe.checkpoint.checkpointer.STREAM_CHUNK_BYTES`; a training checkpoint's chunk is one device's shard
of the leaf) instead of the whole leaf.

Checked against orbax-checkpoint 0.12.8 (OCDBT on, Orbax's default) by ``tests/test_convert_memory.py``;
a checkpoint written without OCDBT (one directory per array) is opened with the ``file`` driver.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmoe.storage import page_cache


def open_array(state_dir, key: str):
    """A TensorStore handle for the array at pytree path ``key`` (``"params/moe/..."``) of the
    Orbax PyTree item in ``state_dir``; nothing is read yet."""
    import tensorstore as ts  # late: an Orbax dependency, needed only to read slices

    state_dir = Path(state_dir).absolute()
    name = key.replace("/", ".")
    specs = [{"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}",
                                            "path": name}},
             {"driver": "zarr", "kvstore": {"driver": "file", "path": str(state_dir / name)}}]
    err = None
    for spec in specs if (state_dir / "manifest.ocdbt").exists() else specs[1:]:
        try:
            return ts.open(spec, open=True, read=True).result()
        except Exception as e:  # noqa: BLE001 - try the next layout, report the last failure
            err = e
    raise OSError(f"cannot open array {name} in {state_dir}: {err}")


class LeafSlices:
    """A read-only, array-like view of one stored leaf, read a block at a time.

    ``view[index]`` with ``index`` an int tuple over the leading axes (``(layer,)`` or
    ``(layer, expert)``, as :class:`jaxmoe.port.maps.hf_map.Entry.index`) returns that slice as a numpy
    array of ``dtype``. The read covers the block of the leading axes that holds ``index``, aligned
    to the array's read chunks, and is kept until an index outside it is asked for: reading the
    slices in order (what :class:`jaxmoe.port.formats.hf.HfTensorSink` does) reads each chunk once,
    and the next block is read while this one is used (so memory holds two blocks).
    ``view[()]`` reads the whole leaf; :meth:`rows` the first ``n`` rows of the leading axis.
    """

    def __init__(self, store, dtype=None, root=None):
        self.store = store
        # the checkpoint's files: their pages are dropped as blocks are read (page_cache)
        self._dropper = page_cache.TreeDropper(root) if root is not None else None
        self.shape = tuple(int(n) for n in store.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(dtype if dtype is not None else store.dtype.numpy_dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        chunk = store.chunk_layout.read_chunk.shape
        self.chunk = tuple(int(c) if c else n for c, n in zip(chunk, self.shape))
        self._start: tuple | None = None
        self._block: np.ndarray | None = None
        self._next: tuple | None = None  # (start, TensorStore read future) of the next block
        self.reads = 0  # number of blocks read (tests)
        self.max_block_bytes = 0

    def _read(self, box, pending=None) -> np.ndarray:
        arr = np.asarray((pending if pending is not None else self.store[box].read()).result())
        if self._dropper is not None:
            self._dropper.moved(arr.nbytes)
        self.reads += 1
        self.max_block_bytes = max(self.max_block_bytes, arr.nbytes)
        return arr.astype(self.dtype, copy=False)

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        if index == () or index == (Ellipsis,):
            return self._read(tuple(slice(None) for _ in self.shape))
        if not all(isinstance(i, (int, np.integer)) for i in index):
            raise TypeError("LeafSlices takes integer indices over the leading axes")
        lead = len(index)
        start = tuple((int(i) // c) * c for i, c in zip(index, self.chunk[:lead]))
        if self._start != start:
            self._block = None  # free the previous block before reading the next
            pending = self._next[1] if self._next is not None and self._next[0] == start else None
            self._next = None
            self._block = self._read(self._box(start), pending)
            self._start = start
            # readers go through the blocks in order: start reading the next one now
            # (TensorStore reads in its own threads while this block is used)
            following = self._following(start)
            if following is not None:
                self._next = (following, self.store[self._box(following)].read())
        return self._block[tuple(int(i) - s for i, s in zip(index, start))]

    def _box(self, start: tuple) -> tuple:
        return tuple(slice(s, min(s + c, n)) for s, c, n in zip(start, self.chunk, self.shape))

    def _following(self, start: tuple) -> tuple | None:
        """The start of the block after ``start`` in C order over the leading axes, or None."""
        nxt = list(start)
        for ax in reversed(range(len(start))):
            nxt[ax] += self.chunk[ax]
            if nxt[ax] < self.shape[ax]:
                return tuple(nxt)
            nxt[ax] = 0
        return None

    def rows(self, n: int) -> np.ndarray:
        """The first ``n`` rows of the leading axis (a truncated layer stack)."""
        return self._read((slice(0, min(int(n), self.shape[0])),))

    def __array__(self, dtype=None, copy=None):
        arr = self[()]
        return arr if dtype is None else arr.astype(dtype, copy=False)


__all__ = ["LeafSlices", "open_array"]
