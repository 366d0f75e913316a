"""The emergency (local) checkpoint tier: frequent per-process checkpoints on local disk, beside
the persistent Orbax ones (``train.local_checkpoint_every``, ``train.local_checkpoint_dir``).

Layout (``ROOT`` = ``train.local_checkpoint_dir``, default ``RUN_DIR/local_checkpoints``)::

    ROOT/process_<i>/<step>/manifest.json   step, process index/count, every leaf's global shape
                                            and dtype, and the shards this process wrote (their
                                            index box, byte offset, size, CRC32), and the meta
    ROOT/process_<i>/<step>/shards.bin      the shards' raw bytes, one after the other

Each process writes the shards of its addressable devices (each distinct index box once) into
``<step>.tmp/``, fsyncs, and renames it to ``<step>/``: a committed step is complete or absent.
The newest :data:`KEEP` steps are kept per process. A step is **complete** for a target when the
manifests of it in the process directories this process can see are readable, every shard's
bytes are there with their CRC32, and the union of the shards covers every leaf of the target
(replicated copies count once). With one data-parallel replica per host (``mesh.replica`` >= 2),
each host's directory alone covers the state, so a restart onto whatever hosts remain (fewer
replicas, another mesh) restores from them; a step that fails the check is skipped with one line
saying why, and the next older one is tried. Restoring reassembles each device's shard of the
target sharding from the stored boxes, so the saved and the restoring mesh may differ.

Why not Orbax's emergency checkpointer (``orbax.checkpoint.experimental.emergency``,
orbax-checkpoint 0.12.8): it runs on CPU (checked: its ``CheckpointManager`` saved and restored a
state on a ``replica=2`` mesh of 8 fake CPU devices in one process), but on a mesh with one replica
slice it drops the local directory (``del local_directory``) and reads the persistent tier only,
so the restart onto one replica -- the case this tier is for -- would lose the local steps; it
restores onto the global mesh and abstract state fixed when it is created (a slice broadcasts to
the others of that mesh), not onto a smaller one; it saves only the state item (our data
position and config would need its separate non-replicated manager); and it is marked
experimental ("do not use without specific approval"). The tier here is small, atomic, and
restores onto any mesh.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import jax
import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.storage.file_copy import fsync_path
from jaxmoe.trees import key_path_str

KEEP = 2  # local steps kept per process (the newest may be torn by a crash; the one before is not)
MANIFEST, SHARDS = "manifest.json", "shards.bin"


def _box(index, shape) -> list[list[int]]:
    """A shard's index (a tuple of slices) as ``[[start, stop], ...]`` per dim."""
    return [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(index, shape)]


class LocalTier:
    """The local tier of one process (see the module doc)."""

    def __init__(self, root, process_index: int = 0, process_count: int = 1):
        self.root = Path(root).absolute()
        self.process_index, self.process_count = process_index, process_count
        self.dir = self.root / f"process_{process_index}"

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, state, meta: dict) -> None:
        """Write this process's shards of ``state`` and ``meta`` as ``step`` (blocking, atomic)."""
        step = int(step)
        tmp, final = self.dir / f"{step}.tmp", self.dir / str(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        leaves, offset = {}, 0
        with open(tmp / SHARDS, "wb") as f:
            for kp, x in jax.tree_util.tree_leaves_with_path(state):
                x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                rec = {"shape": list(x.shape), "dtype": str(x.dtype), "shards": []}
                seen = set()
                for sh in x.addressable_shards:
                    box = _box(sh.index, x.shape)
                    if str(box) in seen:
                        continue
                    seen.add(str(box))
                    raw = np.ascontiguousarray(np.asarray(sh.data)).tobytes()
                    f.write(raw)
                    rec["shards"].append({"box": box, "offset": offset, "nbytes": len(raw),
                                          "crc32": zlib.crc32(raw)})
                    offset += len(raw)
                leaves[key_path_str(kp)] = rec
            f.flush()
            os.fsync(f.fileno())
        man = {"step": step, "process_index": self.process_index, "process_count": self.process_count,
               "leaves": leaves, "meta": meta}
        (tmp / MANIFEST).write_text(json.dumps(man))
        fsync_path(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(self.dir)
        for old in self.steps(self.dir)[:-KEEP]:
            shutil.rmtree(self.dir / str(old), ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """Remove local steps newer than ``step`` (a restart's timeline replaces them): this
        process's, and on process 0 those of process directories the run no longer has."""
        dirs = [self.dir]
        if self.process_index == 0:
            dirs += [d for d in self.process_dirs() if int(d.name.split("_")[1]) >= self.process_count]
        for d in dirs:
            for s in self.steps(d):
                if s > step:
                    shutil.rmtree(d / str(s), ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------
    @staticmethod
    def steps(d: Path) -> list[int]:
        """Committed steps in one process directory, ascending (``.tmp`` ones never count)."""
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir())

    def process_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("process_")
                      and p.name.split("_")[1].isdigit())

    def all_steps(self) -> list[int]:
        return sorted({s for d in self.process_dirs() for s in self.steps(d)})

    def check(self, step: int, target) -> list[dict]:
        """The manifests of ``step`` (with ``_dir``) if the step is complete for ``target``
        (see the module doc); else a UserError naming what is torn or missing."""
        mans = []
        for d in self.process_dirs():
            p = d / str(step)
            if not p.is_dir():
                continue
            try:
                man = json.loads((p / MANIFEST).read_text())
                data = (p / SHARDS).read_bytes()
            except (OSError, ValueError) as e:
                raise UserError(f"{p}: manifest or shards unreadable ({type(e).__name__})") from None
            for path, rec in man["leaves"].items():
                for sh in rec["shards"]:
                    raw = data[sh["offset"]:sh["offset"] + sh["nbytes"]]
                    if len(raw) != sh["nbytes"] or zlib.crc32(raw) != sh["crc32"]:
                        raise UserError(f"{p}: the shard {sh['box']} of {path} is torn "
                                        f"({len(raw)} of {sh['nbytes']} bytes, CRC32 "
                                        f"{'ok' if zlib.crc32(raw) == sh['crc32'] else 'wrong'})")
            man["_dir"], man["_data"] = p, data
            mans.append(man)
        if not mans:
            raise UserError(f"no process directory under {self.root} has step {step}")
        for kp, x in jax.tree_util.tree_leaves_with_path(target):
            path = key_path_str(kp)
            boxes = {str(sh["box"]): sh["box"] for m in mans for sh in m["leaves"].get(path, {}).get("shards", [])}
            have = sum(int(np.prod([b - a for a, b in box])) for box in boxes.values())
            if have != int(np.prod(x.shape, dtype=np.int64)):
                got = ", ".join(m["_dir"].parent.name for m in mans)
                raise UserError(f"step {step}: the shards of {path} in {got} cover {have} of "
                                f"{int(np.prod(x.shape))} elements (a process's shard is missing)")
        return mans

    def newest_complete(self, target, log) -> tuple[int, list[dict]] | None:
        """``(step, manifests)`` of the newest complete step, every newer one skipped with one
        ``log`` line; None when none is complete. Several processes agree on the step: the
        newest complete on all of them."""
        found = None
        complete = []
        for step in reversed(self.all_steps()):
            try:
                mans = self.check(step, target)
            except UserError as e:
                log(f"local checkpoint {step} skipped: {e}")
                continue
            complete.append(step)
            found = found or (step, mans)
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            mine = np.full(8, -1, np.int64)
            mine[:min(8, len(complete))] = complete[:8]
            every = multihost_utils.process_allgather(mine)
            common = set(every[0].tolist()).intersection(*map(set, every.tolist())) - {-1}
            if not common:
                return None
            best = max(common)
            return best, self.check(best, target) if found is None or found[0] != best else found[1]
        return found

    def restore(self, target, mans: list[dict]):
        """``(state, meta)`` from a complete step's manifests, placed as ``target`` (a pytree of
        ShapeDtypeStructs with shardings; typed-key leaves get their key data wrapped back)."""
        def leaf(kp, x):
            path = key_path_str(kp)
            stored = [(m, sh) for m in mans for sh in m["leaves"][path]["shards"]]
            is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            dt = np.dtype(mans[0]["leaves"][path]["dtype"]) if not is_key else np.dtype(np.uint32)
            shape = tuple(mans[0]["leaves"][path]["shape"])

            def fetch(index):
                want = _box(index, shape)
                out = np.empty([b - a for a, b in want], dt)
                for m, sh in stored:
                    lo = [max(a, c) for (a, _), (c, _) in zip(want, sh["box"])]
                    hi = [min(b, d) for (_, b), (_, d) in zip(want, sh["box"])]
                    if any(h <= lo_ for lo_, h in zip(lo, hi)) and shape:
                        continue
                    src = np.frombuffer(m["_data"], dt, count=sh["nbytes"] // dt.itemsize, offset=sh["offset"])
                    src = src.reshape([d - c for c, d in sh["box"]])
                    out[tuple(slice(lo_ - a, h - a) for lo_, h, (a, _) in zip(lo, hi, want))] = src[
                        tuple(slice(lo_ - c, h - c) for lo_, h, (c, _) in zip(lo, hi, sh["box"]))]
                return out

            sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            if is_key:
                spec = tuple(sharding.spec) + (None,) * (len(shape) - x.ndim)
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
                # (a typed key's sharding names only the key's dims; its data has one more)
                arr = jax.make_array_from_callback(shape, sharding, fetch)
                return jax.random.wrap_key_data(arr)
            return jax.make_array_from_callback(shape, sharding, fetch)

        state = jax.tree_util.tree_map_with_path(leaf, target)
        return state, dict(mans[0]["meta"])


__all__ = ["KEEP", "LocalTier"]
