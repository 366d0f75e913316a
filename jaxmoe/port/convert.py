"""``jaxmoe convert``'s engine: move weights between HF, torch_ref and jaxmoe (Orbax).

The endpoints (``hf:DIR``, ``torch:FILE``, ``orbax:DIR``) and the sources that read them live in
:mod:`jaxmoe.port.sources` and are re-exported here; this module holds the sinks that write them,
:func:`convert`, which joins a source to a sink, and :func:`load_numpy_tree`.

How a conversion runs (:func:`convert`):

1. Open the source: read its config and every tensor header, and check them against the mapping
   table built from that config (missing / extra / mis-shaped tensors, i.e. also a config.json that
   contradicts the weights). Any problem -> one-line :class:`UserError`, nothing written.
2. Write into a hidden temporary sibling of DST, one jaxmoe leaf at a time: a leaf (e.g. all
   experts of all MoE layers, ``[Lm, E, D, I]``) is assembled from, or split into, its HF tensors.
   Peak memory is about the largest leaf plus one HF tensor, not the model. For an ``orbax:``
   destination the leaves are assembled in files next to DST and streamed into Orbax (see
   :class:`OrbaxSink`), so peak memory does not grow with the model either.
   From an ``orbax:`` source to ``hf:`` / ``torch:``, leaves are not restored whole: the sink
   reads one layer's / expert's slice at a time (:meth:`OrbaxSource.leaf_view`, one Zarr chunk
   in memory). An ``orbax:`` destination says how much disk it needs and checks it first.
3. Carry the non-weight files (tokenizer*, generation_config.json, token ids; see
   :func:`carry_metadata`): an HF dir's go into ``RUN_DIR/hf_meta/`` and come back out of it.
4. Rename the temporary into place (replacing DST only with ``--force``); on any failure the
   temporary is removed, so DST is either the complete result or untouched.

Running checkpoints (``jaxmoe logits``, ``--verify``) is :mod:`jaxmoe.port.logits`; the commands
are :mod:`jaxmoe.port.cli`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmoe.archs.base import LAYOUTS
from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.hfconfig import to_hf_config
from jaxmoe.port import hf_map
from jaxmoe.port.safetensors_io import FLOAT_DTYPES, SafetensorsWriter, parse_size
from jaxmoe.run_dir import RunDir
from jaxmoe.port.sources import (  # noqa: F401 (API: the endpoints and sources, re-exported)
    FP8,
    KINDS,
    TORCH_CONFIG_KEY,
    Endpoint,
    OrbaxSource,
    TensorSource,
    _transpose_into,
    open_source,
    parse_endpoint,
)


def _float_dtype(name: str | None):
    if name is None:
        return None
    if name not in FLOAT_DTYPES:
        raise UserError(f"--dtype {name!r}: choose float32 or bfloat16")
    return FLOAT_DTYPES[name]


def _transposed(src: np.ndarray, dtype=None) -> np.ndarray:
    """A contiguous copy of ``src`` with its last two axes swapped (``src.T`` for 2-D; a fused
    ``[E, a, b]`` -> ``[E, b, a]``), optionally cast, made with :func:`_transpose_into`."""
    out = np.empty(src.shape[:-2] + (src.shape[-1], src.shape[-2]), dtype or src.dtype)
    _transpose_into(out, src)
    return out


class _PartWriter(SafetensorsWriter):
    """A :class:`SafetensorsWriter` that also writes *parts* of a tensor (a fused
    ``gate_up_proj``'s gate or up half, :attr:`hf_map.Entry.hf_part`) straight to their place in
    the file, so a fused tensor is assembled on disk: nothing waits in memory for its other part.
    The tensor counts as written once its parts cover it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts: dict[str, list[tuple[int, int]]] = {}

    def write_part(self, name: str, part: tuple[int, int, int], array: np.ndarray) -> None:
        p = self.planned[name]
        dim, start, stop = part
        want = p.shape[:dim] + (stop - start,) + p.shape[dim + 1:]
        if p.written or tuple(array.shape) != want or not 0 <= start < stop <= p.shape[dim]:
            raise ValueError(f"tensor {name}: part {part} of shape {list(array.shape)} does not "
                             f"fit planned {list(p.shape)} (or written twice)")
        got = self.parts.setdefault(name, [])
        if any(a < stop and start < b for a, b in got):
            raise ValueError(f"tensor {name}: part {part} overlaps one already written")
        data = np.ascontiguousarray(array, dtype=p.dtype)
        inner = int(np.prod(p.shape[dim + 1:], dtype=np.int64)) * p.dtype.itemsize
        # one contiguous byte run per index of the axes before ``dim``
        runs = data.reshape(int(np.prod(p.shape[:dim], dtype=np.int64)), -1).view(np.uint8)
        fd = os.open(p.file, os.O_WRONLY)
        try:
            for i, run in enumerate(runs):
                at, view, done = p.offset + (i * p.shape[dim] + start) * inner, memoryview(run), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], at + done)
        finally:
            os.close(fd)
        got.append((start, stop))
        p.written = sum(b - a for a, b in got) == p.shape[dim]


# --------------------------------------------------------------------------------------------
# Sinks: take jaxmoe leaves one at a time
# --------------------------------------------------------------------------------------------


class TensorSink:
    """Write leaves as HF-named tensors: an HF dir (+ config.json) or a torch_ref file.

    ``layout`` is the HF expert layout written (:data:`jaxmoe.archs.base.LAYOUTS`): per-expert
    (hub names, one ``[I, H]`` tensor per expert) or fused (``save_pretrained(...,
    save_original_format=False)``: one ``[E, 2I, H]`` ``gate_up_proj`` and one ``[E, H, I]``
    ``down_proj`` per layer). A fused ``gate_up_proj`` gets its gate half from the gate leaf and
    its up half from the up leaf, each written in place as its leaf arrives
    (:meth:`_PartWriter.write_part`): the sink holds no more than one layer's part (the
    transposed copy) beyond what the source hands it, and never a whole fused tensor."""

    def __init__(self, kind: str, target: Path, cfg: Config, dtypes: dict, shard_size=None,
                 layout: str = "per-expert"):
        self.table = hf_map.entries(cfg, layout)
        self.groups = hf_map.leaf_entries(cfg, self.table)
        by_tensor = hf_map.tensors(self.table)  # a fused gate_up_proj: two rows, one tensor
        self.zeros = [rows[0] for rows in by_tensor.values() if rows[0].key == hf_map.ZERO]
        plan = [(name, rows[0].hf_shape,
                 np.float32 if rows[0].key == hf_map.ZERO else dtypes[rows[0].key])
                for name, rows in by_tensor.items()]
        self.tensors = len(plan)
        if kind == "hf":
            target.mkdir(parents=True)
            hf_cfg = to_hf_config(cfg, dtype=str(np.dtype(dtypes["params/embed"])))
            (target / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
            self.writer = _PartWriter(target, plan, shard_size=shard_size)
        else:
            if shard_size is not None:
                raise UserError("--shard-size applies to hf: destinations only")
            self.writer = _PartWriter(target, plan, metadata={TORCH_CONFIG_KEY: cfg.to_json()},
                                      single_file=True)

    def write_leaf(self, key: str, arr: np.ndarray) -> None:
        for ent in self.groups[key]:
            t = arr[ent.index]
            t = _transposed(t) if ent.transpose else t
            if ent.hf_part is None:
                self.writer.write(ent.hf_name, t)
            else:
                self.writer.write_part(ent.hf_name, ent.hf_part, t)

    def close(self) -> None:
        for ent in self.zeros:
            self.writer.write(ent.hf_name, np.zeros(ent.hf_shape, np.float32))
        self.writer.close()


class OrbaxSink:
    """Write a jaxmoe run dir (``config.toml`` + an Orbax checkpoint at step 0) leaf by leaf.

    Orbax writes a pytree in one save, so every leaf must exist at once; to keep them out of
    memory, each leaf is assembled in a raw ``np.memmap`` file under ``scratch`` (a directory
    next to the destination, removed afterwards; it needs disk for one copy of the model).
    :meth:`buffer` hands out that file for the source to fill (its pages are dropped as it
    fills, see :meth:`TensorSource.read_leaf`); at :meth:`close` the files are re-opened
    read-only and saved with :func:`jaxmoe.checkpoint.save_model` ``(stream=True)``, which
    writes them one Zarr chunk (:data:`~jaxmoe.checkpoint.STREAM_CHUNK_BYTES`) at a time without copying. Measured by ``bench/convert.py
    --gb 2`` (largest leaf 537 MB): peak RSS 618 MB, where holding every leaf for one save
    peaked at 5.8 GB. Disk: the scratch files are a second copy of the model. The checkpoint is
    the one ``save_model`` writes for in-memory leaves, up to the Zarr chunk shapes of leaves over
    that size, which :func:`jaxmoe.checkpoint.load_model` and ``Checkpointer.restore`` read as usual.
    """

    def __init__(self, target: Path, cfg: Config, scratch: Path | None = None):
        self.target, self.cfg = target, cfg
        self.scratch = Path(scratch) if scratch is not None else target.parent / "leaves"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, tuple[Path | None, tuple, np.dtype, np.ndarray | None]] = {}
        self.tensors = 0

    def buffer(self, key: str, shape, dtype) -> np.ndarray:
        """A writable file-backed array for leaf ``key`` (pass it back to :meth:`write_leaf`)."""
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        if 0 in shape:  # an empty file cannot be mapped
            return np.empty(shape, dtype)
        path = self.scratch / f"{len(self.files):05d}.bin"
        return np.memmap(path, dtype=dtype, mode="w+", shape=shape)

    def write_leaf(self, key: str, arr: np.ndarray) -> None:
        # late: jaxmoe.checkpoint imports jax and Orbax, which hf:/torch: conversions never need
        from jaxmoe.checkpoint import release_pages

        if not isinstance(arr, np.memmap):  # not from buffer(): copy it into a file
            buf = self.buffer(key, arr.shape, arr.dtype)
            buf[...] = arr
            arr = buf
        if isinstance(arr, np.memmap):
            arr.flush()
            release_pages(arr)
            self.files[key] = (Path(arr.filename), arr.shape, arr.dtype, None)
        else:
            self.files[key] = (None, arr.shape, arr.dtype, arr)
        self.tensors += 1

    def close(self) -> None:
        from jaxmoe import checkpoint

        leaves = {}
        for key, (path, shape, dtype, arr) in self.files.items():
            leaves[key] = arr if path is None else np.memmap(path, dtype=dtype, mode="r",
                                                             shape=shape)
        tree = hf_map.unflatten(leaves)
        checkpoint.save_model(str(self.target), self.cfg, tree.get("params", {}),
                              tree.get("buffers", {}), step=0, stream=True)
        del leaves, tree
        self.files = {}
        shutil.rmtree(self.scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------


def _is_nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def _check_replaceable(src: Endpoint, dst: Endpoint) -> None:
    """``--force`` replaces only what a conversion writes, and never the source or a folder around it."""
    s, d = src.path.resolve(), dst.path.resolve()
    if d == s or d in s.parents or s in d.parents:
        how = "is" if d == s else "contains" if d in s.parents else "is inside"
        raise UserError(f"{dst}: {how} the source {src}; --force never deletes the source: "
                        f"pick another --to path")
    if dst.kind == "torch":
        ok = d.is_file() and d.suffix == ".safetensors"
        what = "a .safetensors file"
    elif dst.kind == "hf":
        ok = d.is_dir() and (d / "config.json").is_file() and not any(p.is_dir() for p in d.iterdir())
        what = "an HF checkpoint folder (config.json, no sub-folders)"
    else:
        ok = d.is_dir() and RunDir(d).is_run()
        what = "a jaxmoe run folder"
    if not ok:
        raise UserError(f"{dst}: is not {what} from an earlier conversion; --force replaces only those "
                        f"(remove it yourself if you mean it)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _out_dtypes(source, dst_kind: str, dtype) -> dict:
    """Per-leaf output dtype: buffers, the router weight and the expert bias stay fp32
    (:func:`hf_map.fp32_leaves`); else --dtype, else fp32 for orbax (jaxmoe master params are
    fp32), else the source dtype."""
    out = {}
    fp32 = hf_map.fp32_leaves(source.cfg)
    for key in source.keys():
        if key in fp32:
            out[key] = np.dtype(np.float32)
        elif dtype is not None:
            out[key] = np.dtype(dtype)
        elif dst_kind == "orbax":
            out[key] = np.dtype(np.float32)
        else:
            out[key] = source.leaf_dtype(key)
    return out


# --------------------------------------------------------------------------------------------
# Non-weight files: tokenizer, generation config, token ids (carried hf -> orbax -> hf)
# --------------------------------------------------------------------------------------------

# A run dir keeps the non-weight files of the HF checkpoint it came from here (config.json as it
# was, tokenizer*.json, generation_config.json, ...), so that converting back restores them.
HF_META_DIR = "hf_meta"
# config.json keys that are not architecture but must survive a round trip
CARRIED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
                       "decoder_start_token_id")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_META_MAX_BYTES = 256 * 2**20  # a "non-weight" file larger than this is not copied (with a note)


def meta_dir(ep: Endpoint) -> Path | None:
    """Where ``ep``'s non-weight HF files live: the HF dir itself, a run dir's ``hf_meta/``."""
    if ep.kind == "hf":
        return ep.path
    if ep.kind == "orbax" and (ep.path / HF_META_DIR).is_dir():
        return ep.path / HF_META_DIR
    return None


def meta_files(directory: Path | None, log=None) -> list[Path]:
    """The non-weight regular files at the top of ``directory`` (config.json included)."""
    if directory is None or not directory.is_dir():
        return []
    out = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name in _WEIGHT_NAMES:
            continue
        if f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if f.stat().st_size > _META_MAX_BYTES:
            if log is not None:
                log(f"note: not carrying {f} ({f.stat().st_size / 1e6:.0f} MB; not a weight file "
                    "jaxmoe knows, too large for metadata)")
            continue
        out.append(f)
    return out


def carry_metadata(src: Endpoint, target: Path, dst_kind: str, log=None) -> list[str]:
    """Copy ``src``'s non-weight HF files next to the converted weights in ``target``.

    * to ``orbax:``: into ``target/hf_meta/`` (the original config.json included);
    * to ``hf:``: into ``target`` itself, except config.json, which the sink wrote from the
      model config; its token ids (:data:`CARRIED_CONFIG_KEYS`) are taken from the original.
    Returns the names carried."""
    files = meta_files(meta_dir(src), log)
    if not files or dst_kind == "torch":
        return []
    carried = []
    if dst_kind == "orbax":
        out = target / HF_META_DIR
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, out / f.name)
            carried.append(f.name)
        return carried
    for f in files:
        if f.name == "config.json":
            try:
                orig = json.loads(f.read_text())
            except ValueError:
                continue
            written = json.loads((target / "config.json").read_text())
            keep = {k: orig[k] for k in CARRIED_CONFIG_KEYS if k in orig}
            if keep:
                written.update(keep)
                (target / "config.json").write_text(json.dumps(written, indent=2) + "\n")
                carried.append("config.json:" + ",".join(keep))
            continue
        shutil.copy2(f, target / f.name)
        carried.append(f.name)
    return carried


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_scratch(source, dtypes: dict, where: Path, log) -> int:
    """An orbax: destination needs disk for the checkpoint plus the scratch leaf files it is
    streamed from (:class:`OrbaxSink`): say how much before starting, and refuse (one line,
    nothing written) when the file system holding DST has less free space. Returns the bytes."""
    model = sum(int(np.prod(source.shapes[k], dtype=np.int64)) * np.dtype(dtypes[k]).itemsize
                for k in source.keys())
    need = 2 * model  # scratch copy + the checkpoint (removed scratch leaves no trace)
    free = shutil.disk_usage(where).free
    log(f"note: writing an orbax: checkpoint of {_gb(model)} needs {_gb(need)} free disk next to "
        f"the destination (scratch leaf files + the checkpoint); {_gb(free)} free in {where}")
    if free < need:
        raise UserError(f"not enough free disk in {where}: converting to orbax: needs "
                        f"{_gb(need)} ({_gb(model)} checkpoint + {_gb(model)} scratch), "
                        f"{_gb(free)} free; free space or write --to elsewhere")
    return need


def convert(src: Endpoint, dst: Endpoint, dtype: str | None = None, shard_size: str | None = None,
            force: bool = False, log=None, hf_layout: str | None = None) -> dict:
    """Convert ``src`` to ``dst``; returns figures (tensors, bytes, seconds, notices).

    ``hf_layout``: the expert layout of an ``hf:`` destination (``per-expert``, the default, or
    ``fused``; see :class:`TensorSink`)."""
    log = log if log is not None else (lambda msg: print(msg, file=sys.stderr))
    np_dtype = _float_dtype(dtype)
    shard = parse_size(shard_size) if shard_size else None
    if shard is not None and dst.kind != "hf":
        raise UserError("--shard-size applies to hf: destinations only")
    if hf_layout is not None and hf_layout not in LAYOUTS:
        raise UserError(f"--hf-layout {hf_layout!r}: choose one of {', '.join(LAYOUTS)}")
    if hf_layout is not None and dst.kind != "hf":
        # torch: files are torch_ref's, whose loader reads the per-expert names only
        raise UserError(f"--hf-layout applies to hf: destinations only ({dst.kind}: has one "
                        "layout); drop it or write --to hf:DIR")
    if src.path.resolve() == dst.path.resolve():
        raise UserError(f"--from and --to are the same path ({dst.path})")
    if _is_nonempty(dst.path):
        if not force:
            raise UserError(f"{dst}: exists and is not empty; pass --force to replace it")
        _check_replaceable(src, dst)
    t0 = time.perf_counter()
    source = open_source(src)  # validates: raises before anything is written
    cfg = source.cfg
    hf_map.check_supported(cfg)
    for note in source.notices:
        log(note)
    dtypes = _out_dtypes(source, dst.kind, np_dtype)
    src_dtypes = sorted({str(source.leaf_dtype(k)) for k in source.keys()})

    dst.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.path.name}.tmp-", dir=dst.path.parent))
    target = tmp / "out"
    written = 0
    try:
        if dst.kind == "orbax":
            sink = OrbaxSink(target, cfg, scratch=tmp / "leaves")
        else:
            sink = TensorSink(dst.kind, target, cfg, dtypes, shard,
                              layout=hf_layout or LAYOUTS[0])
        if isinstance(sink, OrbaxSink):
            check_scratch(source, dtypes, dst.path.parent, log)
        for key in source.keys():
            buf = (sink.buffer(key, source.shapes[key], dtypes[key])
                   if isinstance(sink, OrbaxSink) else None)
            if isinstance(source, OrbaxSource) and isinstance(sink, TensorSink):
                # one layer's / expert's slice at a time (one Zarr chunk), never the whole leaf
                arr = source.leaf_view(key, dtypes[key])
            else:
                arr = source.read_leaf(key, dtypes[key], out=buf)
            del buf
            written += arr.nbytes
            sink.write_leaf(key, arr)
            del arr
        sink.close()
        source.close()
        carried = carry_metadata(src, target, dst.kind, log)
        if dst.path.exists() or dst.path.is_symlink():
            _remove(dst.path)
        os.replace(target, dst.path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    secs = time.perf_counter() - t0
    return {
        "src": str(src), "dst": str(dst), "arch": cfg.model.hf_arch,
        "leaves": len(source.keys()),
        "tensors": sink.tensors if isinstance(sink, TensorSink) else len(hf_map.entries(cfg)),
        "hf_layout": (hf_layout or LAYOUTS[0]) if dst.kind == "hf" else None,
        "bytes": int(written), "seconds": round(secs, 3),
        "mb_per_s": round(written / 1e6 / max(secs, 1e-9), 1),
        "dtype": sorted({str(d) for d in dtypes.values()}), "src_dtype": src_dtypes,
        "notices": source.notices, "carried": carried,
    }


def load_numpy_tree(ep: Endpoint, dtype=np.float32):
    """(cfg, params, buffers) as nested dicts of numpy arrays, from any endpoint."""
    source = open_source(ep)
    flat = {}
    for key in source.keys():
        d = np.float32 if key.startswith("buffers/") else dtype
        flat[key] = source.read_leaf(key, np.dtype(d))
    tree = hf_map.unflatten(flat)
    return source.cfg, tree.get("params", {}), tree.get("buffers", {})


__all__ = [
    "Endpoint", "OrbaxSink", "OrbaxSource", "TensorSink", "TensorSource", "convert",
    "load_numpy_tree", "open_source", "parse_endpoint",
]
