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

import logging
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxmoe.checkpoint.stream import (  # StreamLeaf, release_pages: re-exported
    StreamingNumpyHandler,
    StreamLeaf,
    release_pages,
    streaming_state_handler,
)
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


# Streaming saves (jaxmoe.checkpoint.stream) cut numpy leaves into contiguous Zarr chunks of at
# most this many bytes (Orbax: one chunk per leaf up to 2 GiB). A chunk is what a partial read
# decodes (port/orbax_read), and TensorStore keeps written chunks resident until a save commits:
# 4 MiB keeps both small (64 MiB: hf -> orbax peak 585 vs 298 MB for 134 vs 17 MB leaves; tests/test_convert_memory.py).
STREAM_CHUNK_BYTES = 4 * 2**20


class Checkpointer:
    """Save / restore ``(state, meta)`` by step in ``directory`` (normally ``RUN_DIR/checkpoints``).

    ``save`` is asynchronous (with ``async_save``): it returns once the arrays are copied off the
    devices, and writes in a background thread; call :meth:`wait` (or :meth:`close`) before
    reading the files or exiting. Only the newest ``keep`` checkpoints are kept.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True,
                 stream_numpy: bool = False):
        """``stream_numpy``: write numpy leaves one at a time without copying them (see
        :class:`StreamingNumpyHandler`); needs ``async_save=False``. Same files either way."""
        if stream_numpy and async_save:
            raise ValueError("stream_numpy=True needs async_save=False (leaves are not copied)")
        self.stream_numpy = stream_numpy
        # the handler that writes numpy leaves when streaming (its .trace records the writes)
        self.stream_handler = StreamingNumpyHandler(STREAM_CHUNK_BYTES) if stream_numpy else None
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
                state_handler = streaming_state_handler(self.stream_handler)
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
    leaves (files on disk) or :class:`~jaxmoe.checkpoint.stream.StreamLeaf` (filled from their
    source chunk by chunk) and peak memory stays at a few chunks instead of the model (used
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
