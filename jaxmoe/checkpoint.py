"""Checkpoints (Orbax): async saves, keep the last K, atomic commits, exact resume, resharding.

Layout on disk (``RUN_DIR/checkpoints`` is the Checkpointer's directory)::

    RUN_DIR/config.toml                    the run's config (written by training / save_model)
    RUN_DIR/checkpoints/<step>/state/      the state pytree (Orbax PyTree/OCDBT + TensorStore)
    RUN_DIR/checkpoints/<step>/meta/       JSON: data position, config dict, metrics, ...

``state`` is any pytree of arrays; training saves a dict with at least ``"params"`` and
``"buffers"`` (plus ``"opt_state"``, ``"rng"``, ...), which is what :func:`load_model` reads back.

Atomicity (checked for orbax-checkpoint 0.12.8 by ``tests/test_checkpoint.py``): Orbax writes a
step into ``<step>.orbax-checkpoint-tmp-<n>/`` and renames it to ``<step>/`` only after every
file is written (on local file systems; on GCS it writes a ``commit_success.txt`` instead). A
process killed mid-save therefore leaves only a tmp directory, which Orbax never lists as a step
(and deletes when the next CheckpointManager opens the directory), so :meth:`latest_step` skips
it. We add no marker of our own.

Typed PRNG keys (``jax.random.key``) are not serialisable by Orbax: they are saved as their raw
``uint32`` key data and re-wrapped on restore when the target holds a typed key.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmoe.errors import UserError

_STATE, _META = "state", "meta"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _is_key(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _keys_to_data(tree):
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _target_keys_to_data(tree):
    """Abstract target with typed-key leaves replaced by their uint32 key-data shapes."""

    def conv(x):
        if not _is_key(x):
            return x
        data = jax.eval_shape(jax.random.key_data, x)
        sharding = getattr(x, "sharding", None)
        if sharding is not None and not isinstance(x, jax.Array):
            # key data has trailing dims the key sharding does not name: replicate those
            spec = tuple(sharding.spec) + (None,) * (data.ndim - x.ndim) if hasattr(
                sharding, "spec") else None
            if spec is not None:
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
        elif isinstance(x, jax.Array):
            sharding = None
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)

    return jax.tree_util.tree_map(conv, tree)


def _rewrap_keys(restored, target):
    def back(r, t):
        if _is_key(t):
            impl = jax.random.key_impl(t) if isinstance(t, jax.Array) else None
            return jax.random.wrap_key_data(r, impl=impl) if impl else jax.random.wrap_key_data(r)
        return r

    return jax.tree_util.tree_map(back, restored, target)


def _abstract(x):
    """A ShapeDtypeStruct restore target for a leaf (keeps a concrete array's sharding)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _with_default_sharding(tree):
    """Leaves without a sharding are restored onto the first local device, unsharded."""
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def fix(x):
        if getattr(x, "sharding", None) is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev)
        return x

    return jax.tree_util.tree_map(fix, tree)


# --------------------------------------------------------------------------------------------
# Streaming numpy leaves (used by ``save_model(..., stream=True)``, i.e. ``jaxmoe convert``)
# --------------------------------------------------------------------------------------------


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


# Streaming saves cut numpy leaves into contiguous Zarr chunks of at most this many bytes (Orbax:
# one chunk per leaf up to 2 GiB). A chunk is what a partial read decodes (port/orbax_read), and
# TensorStore keeps written chunks resident until a save commits: 4 MiB keeps both small (64 MiB:
# hf -> orbax peak 585 vs 298 MB for 134 vs 17 MB leaves; tests/test_convert_memory.py).
STREAM_CHUNK_BYTES = 4 * 2**20
# Chunk writes in flight (TensorStore writes while the next are issued; 8 broke test_port_io's RSS
# bound), stored uncompressed (zstd-1: CPU on both sides for ~12% of the bytes). Measured:
# docs/MEASUREMENTS.md, "Conversion at disk speed".
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


class StreamLeaf:
    """A leaf a streaming save writes without it ever being in memory whole: its ``shape`` and
    ``dtype``, and ``fill(box, out)``, which writes the values of ``box`` (a tuple of slices, one
    Zarr chunk) into ``out`` (a C-contiguous array of the box's shape and ``dtype``).

    ``leaf[box]`` returns a new chunk filled that way; :class:`_StreamingNumpyHandler` asks for
    the chunks in order, a few at a time, then calls :meth:`release` (which calls ``on_release``,
    e.g. to drop what the filler cached). The checkpoint is the one an ``np.ndarray`` of the same
    values writes (same typestr, Zarr metadata and chunks): only :func:`save_model`
    ``(stream=True)`` accepts these leaves. No ``__array__`` on purpose: Orbax's ``StandardSave``
    would turn the leaf into an array, reading it whole (see :func:`_streaming_state_handler`).
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


class _StreamingNumpyHandler(ocp.type_handlers.NumpyHandler):
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
    * leaves over :data:`STREAM_CHUNK_BYTES` get Zarr chunks that split only the leading axes
      (:func:`_slab_chunks`), so a chunk is one contiguous byte range of the leaf. Orbax's
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

    def __init__(self, chunk_bytes: int | None = None):
        super().__init__(deepcopy_host_arrays=False)
        self.chunk_bytes = int(chunk_bytes or STREAM_CHUNK_BYTES)
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
            try:  # (Orbax refuses 0-size arrays before this point)
                t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
                lazy = isinstance(value, StreamLeaf)
                free: list[np.ndarray] = []  # chunk buffers of a StreamLeaf, written: reused
                for box in _chunk_boxes(value.shape, t.chunk_layout.write_chunk.shape):
                    if lazy:  # filled from the source here, copied by TensorStore, reused after
                        shape = tuple(b.stop - b.start for b in box)
                        buf = next((i for i, b in enumerate(free) if b.shape == shape), None)
                        data = free.pop(buf) if buf is not None else np.empty(shape, value.dtype)
                        value.fill(box, data)
                    else:  # a view of the leaf (a memmap's pages, dropped as chunks complete)
                        data = value[box]
                    pending.append((t[box].write(data, can_reference_source_data_indefinitely=not lazy),
                                    data if lazy else None))
                    n += 1
                    if len(pending) >= STREAM_WRITES_IN_FLIGHT:
                        w, done = pending.pop(0)
                        await w
                        if done is not None:
                            free.append(done)
                        release_pages(value)
                for w, _ in pending:
                    await w
            finally:
                release_pages(value)
                if isinstance(value, StreamLeaf):
                    value.release()
                self.trace.append(("end", n))


def _streaming_registry(numpy_handler):
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


def _streaming_state_handler(numpy_handler) -> ocp.StandardCheckpointHandler:
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
                           "PyTree handler; streaming saves need updating (jaxmoe/checkpoint.py)")
    handler._impl = ocp.PyTreeCheckpointHandler(
        use_ocdbt=True, type_handler_registry=_streaming_registry(numpy_handler))
    # StandardSave refuses leaves not in its ``_supported_types`` (and turns anything with an
    # ``__array__`` into an ndarray, i.e. would read a lazy leaf whole): StreamLeaf has no
    # ``__array__`` and is let through here, in the instance only.
    supported = getattr(handler, "_supported_types", None)
    if not isinstance(supported, tuple):
        raise RuntimeError("this orbax-checkpoint version has no StandardCheckpointHandler."
                           "_supported_types; streaming saves need updating (jaxmoe/checkpoint.py)")
    handler._supported_types = supported + (StreamLeaf,)
    return handler


class Checkpointer:
    """Save / restore ``(state, meta)`` by step in ``directory`` (normally ``RUN_DIR/checkpoints``).

    ``save`` is asynchronous (with ``async_save``): it returns once the arrays are copied off the
    devices, and writes in a background thread; call :meth:`wait` (or :meth:`close`) before
    reading the files or exiting. Only the newest ``keep`` checkpoints are kept.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True,
                 stream_numpy: bool = False):
        """``stream_numpy``: write numpy leaves one at a time without copying them (see
        :class:`_StreamingNumpyHandler`); needs ``async_save=False``. Same files either way."""
        if stream_numpy and async_save:
            raise ValueError("stream_numpy=True needs async_save=False (leaves are not copied)")
        self.stream_numpy = stream_numpy
        # the handler that writes numpy leaves when streaming (its .trace records the writes)
        self.stream_handler = _StreamingNumpyHandler() if stream_numpy else None
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"checkpoint directory {self.directory} is a file, not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        state_handler = ocp.StandardCheckpointHandler()
        if stream_numpy:
            try:
                state_handler = _streaming_state_handler(self.stream_handler)
            except (RuntimeError, AttributeError, TypeError) as e:
                # Another orbax-checkpoint release without the 0.12.x internals: write the same
                # files the ordinary way (memory then scales with the model, not the leaf).
                print(f"jaxmoe: streaming Orbax save unavailable ({e}); saving without streaming",
                      file=sys.stderr)
        self._mgr = ocp.CheckpointManager(
            self.directory,
            item_names=(_STATE, _META),
            item_handlers={_STATE: state_handler,
                           _META: ocp.JsonCheckpointHandler()},
            options=options,
        )

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving ``state`` (pytree of arrays) and ``meta`` (JSON-able dict) as ``step``."""
        step = int(step)
        if step in self._mgr.all_steps():
            raise UserError(f"checkpoint step {step} already exists in {self.directory}")
        ok = self._mgr.save(
            step,
            args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardSave(_keys_to_data(state)),
                _META: ocp.args.JsonSave(dict(meta)),
            }),
            force=True,
        )
        if not ok:
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    # -- reading -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (re-reads the directory)."""
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none (partial saves never count)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _check_step(self, step) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise UserError(f"no checkpoints in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise UserError(f"no checkpoint for step {step} in {self.directory} (steps: {have})")
        return int(step)

    def restore(self, target, step: int | None = None) -> tuple[Any, dict]:
        """Restore ``(state, meta)`` of ``step`` (default: the latest).

        ``target`` gives the structure, dtypes and placement: a pytree of arrays or
        ``jax.ShapeDtypeStruct`` (with ``.sharding`` to restore sharded; leaves without one land
        unsharded on the first local device). The saved sharding does not matter.
        """
        step = self._check_step(step)
        abstract = jax.tree_util.tree_map(_abstract, target)
        abstract = _with_default_sharding(_target_keys_to_data(abstract))
        try:
            out = self._mgr.restore(
                step,
                args=ocp.args.Composite(**{
                    _STATE: ocp.args.StandardRestore(abstract),
                    _META: ocp.args.JsonRestore(),
                }),
            )
        except Exception as e:  # noqa: BLE001 - any failure here means an unusable checkpoint
            raise UserError(
                f"checkpoint {self.directory / str(step)} cannot be restored onto this target "
                f"({_one_line(e)})"
            ) from None
        return _rewrap_keys(out[_STATE], target), dict(out[_META] or {})

    def restore_newest_good(self, target, *, log=None) -> tuple[Any, dict, int, list[str]]:
        """Restore the newest checkpoint that restores cleanly onto ``target``.

        Returns ``(state, meta, step, skipped)``; every newer checkpoint that failed is reported
        through ``log`` (and listed in ``skipped``) with why. One-line UserError when none
        restores."""
        skipped: list[str] = []
        steps = self.all_steps()
        if not steps:
            raise UserError(f"no checkpoints in {self.directory}")
        for step in reversed(steps):
            try:
                state, meta = self.restore(target, step)
            except UserError as e:
                skipped.append(f"checkpoint {step} skipped: {e}")
                continue
            for msg in skipped if log is not None else ():
                log(msg)
            return state, meta, step, skipped
        raise UserError(f"none of the checkpoints in {self.directory} restores (steps "
                        f"{', '.join(map(str, steps))}); the newest failed with: {skipped[0]}")

    def restore_subtree(self, keys: tuple[str, ...], step: int | None = None) -> tuple[dict, dict]:
        """Restore only the top-level entries ``keys`` of a dict state, unsharded, without
        knowing the rest of its structure (e.g. params without the optimizer state)."""
        step = self._check_step(step)
        try:
            meta_tree = self._mgr.item_metadata(step)[_STATE]
            tree = getattr(meta_tree, "tree", meta_tree)
            missing = [k for k in keys if k not in tree]
            if missing:
                raise UserError(f"checkpoint {self.directory / str(step)} has no "
                                f"{', '.join(missing)} (it has: {', '.join(tree)})")
            dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            abstract = {
                k: jax.tree_util.tree_map(
                    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree[k])
                for k in keys
            }
            # The state item is an ordinary Orbax PyTree checkpoint; its PyTree handler can
            # restore a subset of the top-level entries (StandardRestore cannot).
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                state = reader.restore(
                    self.directory / str(step) / _STATE,
                    args=ocp.args.PyTreeRestore(
                        abstract,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                        partial_restore=True,
                    ),
                )
            meta = self._mgr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"checkpoint {self.directory / str(step)} is unreadable ({_one_line(e)})"
            ) from None
        return dict(state), dict(meta[_META] or {})


# --------------------------------------------------------------------------------------------
# Params-only model checkpoints (convert, evaluation)
# --------------------------------------------------------------------------------------------


def save_model(run_dir, cfg, params, buffers, step: int = 0, *, stream: bool = False) -> None:
    """Write ``RUN_DIR/config.toml`` and a checkpoint of ``{"params", "buffers"}`` at ``step``
    (the layout training uses, minus the optimizer state); blocks until committed.

    ``stream=True`` writes numpy leaves one at a time without copying them: pass ``np.memmap``
    leaves (files on disk) and peak memory stays at about one leaf instead of the model (used
    by ``jaxmoe convert --to orbax:``). The checkpoint is the same either way."""
    from jaxmoe.config import config_to_toml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    ckpt = Checkpointer(run_dir / "checkpoints", keep=0, async_save=False, stream_numpy=stream)
    try:
        ckpt.save(step, {"params": params, "buffers": buffers},
                  {"step": int(step), "config": cfg.to_dict(), "kind": "model"})
    finally:
        ckpt.close()


def load_model(run_dir, step: int | None = None):
    """``(cfg, params, buffers, meta)`` from ``RUN_DIR`` (config.toml + a checkpoint).

    Only ``params`` and ``buffers`` are read, so this works on a training checkpoint without
    knowing its optimizer state; arrays land unsharded on the first local device.
    """
    from jaxmoe.config import load_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir} is not a jaxmoe run directory (no config.toml)")
    if not (run_dir / "checkpoints").is_dir():
        raise UserError(f"{run_dir} has no checkpoints/ directory")
    cfg = load_config(path=run_dir / "config.toml")
    ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
    try:
        tree, meta = ckpt.restore_subtree(("params", "buffers"), step)
    finally:
        ckpt.close()
    buffers = tree.get("buffers")
    return cfg, tree["params"], {} if buffers is None else buffers, meta


# Orbax logs every save/restore at INFO through absl; keep it quiet unless asked.
logging.getLogger("absl").setLevel(logging.WARNING)

__all__ = ["Checkpointer", "StreamLeaf", "load_model", "release_pages", "save_model"]
