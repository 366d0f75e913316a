"""Streaming Orbax saves of numpy leaves, one Zarr chunk at a time (``save_model(stream=True)``,
i.e. ``jaxmoe convert --to orbax:``): :class:`StreamingNumpyHandler` and the state handler that
uses it (:func:`streaming_state_handler`, taken by :class:`jaxmoe.checkpoint.checkpointer.Checkpointer` with
``stream_numpy=True``), and :class:`StreamLeaf`, a leaf filled from its source chunk by chunk as
it is written. The files are those a normal save of numpy leaves writes.

Relies on orbax-checkpoint 0.12.x internals (``NumpyHandler._open_and_write``,
``StandardCheckpointHandler._impl`` / ``_supported_types``); ``tests/test_port_io.py`` checks
them.
"""

from __future__ import annotations

import asyncio
import mmap

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmoe.storage import page_cache


def _file_mapping(arr) -> mmap.mmap | None:
    """The ``mmap`` behind a numpy array (an ``np.memmap`` or a view of one), else None."""
    base = arr
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


def release_pages(arr) -> None:
    """Drop the resident pages of a file-backed numpy array from this process (no-op for others).

    Touched pages of a shared file mapping count in RSS (and ``VmHWM``) until unmapped;
    ``MADV_DONTNEED`` unmaps them (the data stays in the file / page cache, read back on access).
    """
    mm = _file_mapping(arr)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


# Chunk writes in flight (TensorStore writes while the next are issued; 8 broke test_port_io's RSS
# bound), stored uncompressed (zstd-1 spends CPU on both sides to save little of the bytes).
# Measured: docs/history/MEASUREMENTS-2026-12.md, "Conversion at disk speed".
STREAM_WRITES_IN_FLIGHT = 4

def _chunk_boxes(shape, chunk):
    """Index tuples of the chunk grid of an array of ``shape`` (C order; edge chunks clipped to
    the array: TensorStore rejects out-of-bounds boxes)."""
    grid = [range(0, n, max(c, 1)) for n, c in zip(shape, chunk)]
    for starts in np.ndindex(*[len(g) for g in grid]):
        yield tuple(slice(g[i], min(g[i] + c, n))
                    for g, i, c, n in zip(grid, starts, chunk, shape))


def _slab_chunks(shape, itemsize: int, limit: int):
    """A chunk shape of at most ``limit`` bytes that is one contiguous run in C order: whole
    trailing dims, split only along the leading ones (``[4, 64, 1024, 512]`` fp32, 64 MiB ->
    ``[1, 32, 1024, 512]``)."""
    shape = tuple(max(int(n), 1) for n in shape)
    for axis in range(len(shape)):
        trailing = int(np.prod(shape[axis + 1:], dtype=np.int64)) * itemsize
        if trailing <= limit:
            k = max(1, min(shape[axis], limit // max(trailing, 1)))
            return (1,) * axis + (k,) + shape[axis + 1:]
    return (1,) * len(shape)


def _zarr_metadata(spec, field: str = "chunks"):
    """The Zarr v2 ``metadata`` dicts (with ``field``) inside a TensorStore JSON spec."""
    if isinstance(spec, dict):
        if isinstance(spec.get("metadata"), dict) and field in spec["metadata"]:
            yield spec["metadata"]
        for v in spec.values():
            yield from _zarr_metadata(v, field)


def kvstore_root(spec) -> str | None:
    """The local directory a TensorStore spec writes under (an OCDBT ``base`` or a ``file``
    kvstore's ``path``), or None (another kvstore)."""
    if isinstance(spec, dict):
        base = spec.get("base")
        if isinstance(base, str) and base.startswith("file://"):
            return base[len("file://"):]
        if isinstance(base, dict) and base.get("driver") == "file":
            return base.get("path")
        if spec.get("driver") == "file" and isinstance(spec.get("path"), str):
            return spec["path"]
        for v in spec.values():
            root = kvstore_root(v)
            if root is not None:
                return root
    return None


class StreamLeaf:
    """A leaf a streaming save writes without it ever being in memory whole: its ``shape`` and
    ``dtype``, and ``fill(box, out)``, which writes the values of ``box`` (a tuple of slices, one
    Zarr chunk) into ``out`` (a C-contiguous array of the box's shape and ``dtype``).

    ``leaf[box]`` returns a new chunk filled that way; :class:`StreamingNumpyHandler` asks for
    the chunks in order, a few at a time, then calls :meth:`release` (which calls ``on_release``,
    e.g. to drop what the filler cached). The checkpoint is the one an ``np.ndarray`` of the same
    values writes (same typestr, Zarr metadata and chunks): only :func:`save_model`
    ``(stream=True)`` accepts these leaves. No ``__array__`` on purpose: Orbax's ``StandardSave``
    would turn the leaf into an array, reading it whole (see :func:`streaming_state_handler`).
    """

    def __init__(self, shape, dtype, fill, on_release=None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self._fill, self._on_release = fill, on_release

    def fill(self, box: tuple, out: np.ndarray) -> None:
        """Write the values of ``box`` (slices within the shape) into ``out``."""
        self._fill(box, out)

    def __getitem__(self, box) -> np.ndarray:
        box = box if isinstance(box, tuple) else (box,)
        if len(box) != self.ndim or not all(isinstance(b, slice) and b.step in (None, 1)
                                            for b in box):
            raise TypeError("StreamLeaf takes one slice per axis (a chunk's box)")
        box = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, self.shape))
        out = np.empty(tuple(b.stop - b.start for b in box), self.dtype)
        self._fill(box, out)
        return out

    def release(self) -> None:
        if self._on_release is not None:
            self._on_release()

    def __repr__(self) -> str:
        return f"StreamLeaf(shape={list(self.shape)}, dtype={self.dtype})"


class StreamingNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, writing one chunk of one leaf at a time and never copying a leaf.

    Same typestr (``np.ndarray``) and the same TensorStore specs as
    :class:`orbax.checkpoint.type_handlers.NumpyHandler`, so the files are in the format a
    normal save of numpy leaves writes and any reader restores them. Differences:

    * no defensive deep copy of the leaves (``deepcopy_host_arrays=False``): only safe when the
      caller keeps the arrays unchanged until the save is committed, which
      :func:`save_model` does (it blocks);
    * the stock handler starts every leaf's write at once; here a lock makes them run one
      after another, each leaf chunk by chunk (:data:`STREAM_WRITES_IN_FLIGHT` chunks in
      flight), and as each chunk completes the leaf's file-backed pages are dropped
      (:func:`release_pages`);
    * leaves over :data:`jaxmoe.checkpoint.checkpointer.STREAM_CHUNK_BYTES` get Zarr chunks that split
      only the leading axes (:func:`_slab_chunks`), so a chunk is one contiguous byte range of the leaf. Orbax's
      own choice (``SaveArgs.chunk_byte_size``) splits the largest axis first, e.g. the
      ``D`` axis of ``[L, E, D, I]``; such a chunk is strided over the whole leaf and reading
      it through an ``mmap`` faulted in 434 MB of a 537 MB leaf for a 64 MB chunk (the kernel
      maps whole large folios). The chunk shape (and no compressor) is recorded in the array's
      own Zarr metadata, so every reader handles it. (As one 537 MB chunk per leaf, TensorStore
      also kept ~474 MB of encoded data per leaf until the save ended.)

    * a :class:`StreamLeaf` (a leaf that is not in memory) fills each chunk from its source
      as the chunk is written, into one of a few reused buffers (TensorStore copies it:
      ``can_reference_source_data_indefinitely=False``), then is released.

    With ``np.memmap`` or StreamLeaf leaves the process then holds a few chunks, not the tree
    (plus what TensorStore keeps until the OCDBT write is flushed: ~17 / ~44 MiB for a 64 MiB
    leaf in 1 / 4 MiB chunks, either kind; tests/test_port_io.py). Relies on
    ``NumpyHandler._open_and_write`` (one call per leaf) in orbax-checkpoint 0.12.x; tests check
    the write order and chunks, bit-exact reads, and that peak RSS grows by less than a leaf.
    """

    def __init__(self, chunk_bytes: int):
        super().__init__(deepcopy_host_arrays=False)
        self.chunk_bytes = int(chunk_bytes)
        self._lock: asyncio.Lock | None = None
        self.trace: list[tuple[str, int]] = []  # ("start"|"end", chunk count) per leaf, for tests

    async def _background_serialize(self, values, infos, args=None):
        self._lock = asyncio.Lock()  # bound to this save's event loop
        await super()._background_serialize(values, infos, args)

    async def _open_and_write(self, value, tspec, ts_context):
        import tensorstore as ts

        if value.nbytes > self.chunk_bytes:
            for md in _zarr_metadata(tspec):
                md["chunks"] = _slab_chunks(value.shape, value.dtype.itemsize, self.chunk_bytes)
        for md in _zarr_metadata(tspec, "compressor"):
            md["compressor"] = None  # see STREAM_WRITES_IN_FLIGHT
        async with self._lock:
            self.trace.append(("start", 0))
            n, pending = 0, []  # pending: up to STREAM_WRITES_IN_FLIGHT chunk writes
            root = kvstore_root(tspec)  # TensorStore's files: flushed and dropped as they grow
            dropper = page_cache.TreeDropper(root) if root is not None else None
            try:  # (Orbax refuses 0-size arrays before this point)
                t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
                lazy = isinstance(value, StreamLeaf)
                free: list[np.ndarray] = []  # chunk buffers of a StreamLeaf, written: reused
                grid = t.chunk_layout.write_chunk.shape
                chunks = int(np.prod([-(-n_ // max(c, 1)) for n_, c in zip(value.shape, grid)]))
                for box in _chunk_boxes(value.shape, grid):
                    if lazy:  # filled from the source here, copied by TensorStore, reused after
                        shape = tuple(b.stop - b.start for b in box)
                        buf = next((i for i, b in enumerate(free) if b.shape == shape), None)
                        data = free.pop(buf) if buf is not None else np.empty(shape, value.dtype)
                        value.fill(box, data)
                    else:  # a view of the leaf (a memmap's pages, dropped as chunks complete)
                        data = value[box]
                    pending.append((t[box].write(data, can_reference_source_data_indefinitely=not lazy),
                                    data))
                    n += 1
                    while pending and (len(pending) >= STREAM_WRITES_IN_FLIGHT or n == chunks):
                        w, done = pending.pop(0)
                        await w
                        if lazy:
                            free.append(done)
                        else:  # the memmap's pages: out of this process and of the page cache
                            release_pages(value)
                            page_cache.drop_view(done)
                        if dropper is not None:
                            dropper.moved(done.nbytes)
                if dropper is not None:
                    page_cache.drop_tree(root)
            finally:
                release_pages(value)
                if isinstance(value, StreamLeaf):
                    value.release()
                self.trace.append(("end", n))


def streaming_registry(numpy_handler):
    """Orbax's default type handlers with ``np.ndarray`` (and np.memmap) and :class:`StreamLeaf`
    -> ``numpy_handler``. The registry picks a handler by ``isinstance``; the tree metadata
    records the handler's typestr (``np.ndarray``), so a StreamLeaf is saved and described
    exactly as a numpy leaf of its shape and dtype."""
    get = ocp.type_handlers.get_type_handler
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, numpy_handler), (StreamLeaf, numpy_handler),
        (jax.Array, get(jax.Array)),
        (int, get(int)), (float, get(float)), (bytes, get(bytes)), (np.number, get(np.number)),
        (str, get(str)),
    )


def streaming_state_handler(numpy_handler) -> ocp.StandardCheckpointHandler:
    """The state item's handler for streaming saves: a ``StandardCheckpointHandler`` whose inner
    PyTree handler writes numpy leaves with ``numpy_handler``.

    ``StandardCheckpointHandler`` is a thin wrapper that delegates to a
    ``PyTreeCheckpointHandler`` (its ``_impl`` in orbax-checkpoint 0.12.x); only that inner
    handler takes a type-handler registry. Swapping it keeps everything else -- the
    ``StandardSave`` args, the handler name in the step metadata, the files -- exactly as a
    normal :meth:`Checkpointer.save` writes them. (A ``PyTreeCheckpointHandler`` subclass is
    not an option: Orbax matches save args to handler classes exactly.)
    """
    handler = ocp.StandardCheckpointHandler()
    if not isinstance(getattr(handler, "_impl", None), ocp.PyTreeCheckpointHandler):
        raise RuntimeError("this orbax-checkpoint version has no StandardCheckpointHandler._impl "
                           "PyTree handler; streaming saves need updating (jaxmoe/checkpoint/stream.py)")
    handler._impl = ocp.PyTreeCheckpointHandler(
        use_ocdbt=True, type_handler_registry=streaming_registry(numpy_handler))
    # StandardSave refuses leaves not in its ``_supported_types`` (and turns anything with an
    # ``__array__`` into an ndarray, i.e. would read a lazy leaf whole): StreamLeaf has no
    # ``__array__`` and is let through here, in the instance only.
    supported = getattr(handler, "_supported_types", None)
    if not isinstance(supported, tuple):
        raise RuntimeError("this orbax-checkpoint version has no StandardCheckpointHandler."
                           "_supported_types; streaming saves need updating (jaxmoe/checkpoint/stream.py)")
    handler._supported_types = supported + (StreamLeaf,)
    return handler


__all__ = ["STREAM_WRITES_IN_FLIGHT", "StreamLeaf", "StreamingNumpyHandler", "kvstore_root", "release_pages",
           "streaming_registry", "streaming_state_handler"]
