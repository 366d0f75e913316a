"""``jaxmoe convert``'s engine: :func:`convert` joins a source to a sink; :func:`load_numpy_tree`.

Both ends are checkpoint formats (:mod:`jaxmoe.port.formats`: ``hf:DIR``, ``orbax:RUN_DIR``,
``torch:FILE.safetensors``); this module knows none of them by name, only the protocol.

How a conversion runs (:func:`convert`):

1. Open the source: read its config and every tensor header, and check them against the mapping
   table built from that config (missing / extra / mis-shaped tensors, i.e. also a config.json that
   contradicts the weights). Any problem -> one-line :class:`UserError`, nothing written.
2. Write into a hidden temporary sibling of DST, one jaxmoe leaf at a time: a leaf (e.g. all
   experts of all MoE layers, ``[Lm, E, D, I]``) is assembled from, or split into, its tensors.
   Peak memory is about the largest leaf plus one tensor, not the model. A sink that assembles
   whole leaves on disk hands out its own buffer for the source to fill (``Sink.buffer``: the
   ``orbax:`` sink, which also checks free disk first); a sink that takes leaves slice by slice
   (``Sink.takes_views``) gets the source's lazy view (an ``orbax:`` source then reads one
   layer's / expert's slice at a time, one Zarr chunk in memory).
   Where source and sink store a leaf's tensors as the same plain bytes (``raw_tensors`` of
   both: under the same names, ``hf:`` <-> ``torch:``, ``hf:`` -> ``hf:`` resharded, same dtype
   and expert layout; or by place in the leaf, ``hf:`` <-> ``dcp:``, see :func:`raw_copies`),
   the bytes are copied file to file inside the kernel
   (:func:`~jaxmoe.storage.file_copy.copy_bytes`, two copies in flight) and never enter this
   process: a conversion between safetensors files then runs at about the disk's speed.
3. Carry the non-weight files (tokenizer*, generation_config.json, token ids; see
   :mod:`jaxmoe.port.io.hf_meta`) from where the source keeps them to where the sink does.
4. ``fsync`` every file written (once per file, not per tensor) and the folders, rename the
   temporary into place (replacing DST only with ``--force``) and ``fsync`` its parent: DST is
   then complete on disk, also after a crash. On any failure the temporary is removed, so DST is
   either the complete result or untouched.

Running checkpoints (``jaxmoe logits``, ``--verify``) is :mod:`jaxmoe.port.commands.logits`; the commands
are :mod:`jaxmoe.port.commands.cli`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.port.formats import bind_options, open_source, report_fields
from jaxmoe.port.formats.base import Endpoint
from jaxmoe.port.io.hf_meta import meta_files
from jaxmoe.port.io.safetensors_io import FLOAT_DTYPES
from jaxmoe.port.maps import hf_map
from jaxmoe.storage import page_cache
from jaxmoe.storage.file_copy import COPY_BLOCK, copy_bytes, fsync_path

#: raw tensor copies in flight at once (kernel copies: no bytes in this process's memory)
COPY_THREADS = 2


def _float_dtype(name: str | None):
    if name is None:
        return None
    if name not in FLOAT_DTYPES:
        raise UserError(f"--dtype {name!r}: choose float32 or bfloat16")
    return FLOAT_DTYPES[name]


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
    if not dst.format.is_output(d):
        raise UserError(f"{dst}: is not {dst.format.output_what} from an earlier conversion; "
                        "--force replaces only those (remove it yourself if you mean it)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (or ``root`` itself), then the folders holding them."""
    dirs = [root] if root.is_dir() else [root.parent]
    files = [root] if root.is_file() else []
    if root.is_dir():
        for d, sub, names in os.walk(root):
            dirs += [Path(d) / n for n in sub]
            files += [Path(d) / n for n in names if not (Path(d) / n).is_symlink()]
    for f in files + dirs:
        fsync_path(f)


def _raw_pairs(source, sink, key: str) -> list | None:
    """(source range, sink range) pairs when leaf ``key`` can be copied as bytes (see
    :func:`raw_copies`); None when it cannot (then nothing of the sink was touched)."""
    if source.raw_names is None or sink.raw_names is None:
        return None
    src = source.raw_tensors(key)
    if src is None:
        return None
    dst = sink.raw_tensors(key)
    if dst is None:
        return None
    return raw_copies(src, dst, same_names=source.raw_names == sink.raw_names)


def raw_copies(src: dict, dst: dict, same_names: bool = False) -> list | None:
    """The byte copies that turn the source tensors ``src`` into the sink tensors ``dst`` (both
    ``{name: RawTensor}`` of one leaf), as ``(RawTensor, RawTensor)`` ranges of equal size;
    None unless every byte of every tensor on both sides is covered exactly once.

    ``same_names``: both sides use one naming (``hf:`` <-> ``torch:``), so tensors pair by
    name, each with the same dtype and shape. Otherwise they pair by their place in the leaf:
    a tensor ``leaf[i]`` (``RawTensor.index``) holds tensor ``leaf[i + j]`` of the other side at
    row ``j`` of its leading dims when both have the same dtype and orientation (``transpose``)
    and the smaller one's shape is the larger one's trailing dims -- e.g. HF expert ``e`` of
    layer ``l`` ([F, D]) at byte ``e * F * D * itemsize`` of torchtitan's layer-``l`` ``[E, F,
    D]`` tensor, or (the other way) the converse."""
    def same(a, b):
        return (np.dtype(a.dtype), tuple(a.shape), a.nbytes) == (np.dtype(b.dtype), tuple(b.shape), b.nbytes)

    if same_names:
        if src.keys() != dst.keys() or not all(same(src[n], dst[n]) for n in dst):
            return None
        return [(src[n], dst[n]) for n in dst]
    tensors = list(src.values()) + list(dst.values())
    if any(t.index is None for t in tensors):
        return None
    pairs, got_src, got_dst = [], dict.fromkeys(src, 0), dict.fromkeys(dst, 0)
    for sn, s in src.items():
        for dn, d in dst.items():
            k = min(len(s.index), len(d.index))
            if tuple(s.index[:k]) != tuple(d.index[:k]):
                continue
            if np.dtype(s.dtype) != np.dtype(d.dtype) or s.transpose != d.transpose:
                return None
            small, big = (s, d) if len(s.index) >= len(d.index) else (d, s)
            rows = tuple(small.index[len(big.index):])
            lead = tuple(big.shape[:len(rows)])
            if tuple(big.shape[len(rows):]) != tuple(small.shape) or any(
                    r < 0 or r >= n for r, n in zip(rows, lead)):
                return None
            at = big.offset + (int(np.ravel_multi_index(rows, lead)) if rows else 0) * small.nbytes
            part = dataclasses.replace(big, offset=at, nbytes=small.nbytes, shape=tuple(small.shape),
                                       index=tuple(small.index))
            pairs.append((s, part) if small is s else (part, d))
            got_src[sn] += small.nbytes
            got_dst[dn] += small.nbytes
    if any(got_src[n] != src[n].nbytes for n in src) or any(got_dst[n] != dst[n].nbytes for n in dst):
        return None
    return pairs


def _copy_raw(pool: ThreadPoolExecutor, pairs, checksum: bool = False,
              behind: dict | None = None) -> tuple[int, list | None]:
    """Copy the byte ranges of ``pairs`` (in ``pool``); the first failure is raised. Returns
    the bytes copied and, with ``checksum``, ``(sink range, CRC-32 of its bytes)`` per pair.
    ``behind``: per destination file, its :class:`~jaxmoe.storage.page_cache.FileBehind` (made
    here as needed; the caller closes them once every copy is done)."""
    behind = {} if behind is None else behind
    for _, b in pairs:
        if b.file not in behind:
            behind[b.file] = page_cache.FileBehind(b.file)
    futures = [pool.submit(copy_bytes, a.file, a.offset, b.file, b.offset, a.nbytes, checksum,
                           behind[b.file]) for a, b in pairs]
    crcs = [f.result() for f in futures]
    return (sum(a.nbytes for a, _ in pairs),
            [(b, c) for (_, b), c in zip(pairs, crcs)] if checksum else None)


def _copy_leaves(pool: ThreadPoolExecutor, sink, gathered: list, behind: dict) -> int:
    """Copy the byte ranges of ``gathered`` (``(leaf, pairs)``, see :func:`_raw_pairs`) in
    the order of the destination's bytes, then tell the sink each leaf is written
    (:meth:`~jaxmoe.port.formats.base.Sink.raw_written`, in the leaves' order). Returns the
    bytes copied. In place order, ``hf -> torch`` reads and writes its files in one pass
    instead of one strided pass per expert leaf (an HF file interleaves gate / up / down per
    expert); the A/B that measured it: docs/history/MEASUREMENTS-2026-12.md,
    "Conversion: byte copies in destination order"."""
    tagged = sorted(((str(b.file), b.offset, i), (a, b)) for i, (_, pairs) in enumerate(gathered)
                    for a, b in pairs)
    jobs = [p for _, p in tagged]
    n, crcs = _copy_raw(pool, jobs if sink.wants_crc else _joined(jobs), sink.wants_crc, behind)
    per_leaf: list[list] = [[] for _ in gathered]
    for (_, _, i), crc in zip((t for t, _ in tagged), crcs or [None] * len(tagged)):
        per_leaf[i].append(crc)
    for (key, _), crc in zip(gathered, per_leaf):
        sink.raw_written(key, crc if sink.wants_crc else None)
    return n


def _joined(pairs: list, most: int = COPY_BLOCK) -> list:
    """``pairs`` with neighbours that follow each other in both files joined into one copy of
    up to ``most`` bytes (fewer, longer requests; each of the two copy threads still has work;
    measured in docs/MEASUREMENTS.md, "Conversion at disk speed")."""
    out: list = []
    for a, b in pairs:
        if out:
            pa, pb = out[-1]
            if (a.file == pa.file and b.file == pb.file and a.offset == pa.offset + pa.nbytes
                    and b.offset == pb.offset + pb.nbytes and pa.nbytes + a.nbytes <= most):
                out[-1] = (dataclasses.replace(pa, nbytes=pa.nbytes + a.nbytes),
                           dataclasses.replace(pb, nbytes=pb.nbytes + b.nbytes))
                continue
        out.append((a, b))
    return out


def _close_all(behind: dict) -> None:
    """Settle and close every destination's :class:`~jaxmoe.storage.page_cache.FileBehind`."""
    while behind:
        behind.popitem()[1].close()


def _out_dtypes(source, default, dtype) -> dict:
    """Per-leaf output dtype: buffers, the router weight and the expert bias stay fp32
    (:func:`hf_map.fp32_leaves`); else --dtype, else the destination format's ``default``
    (orbax: fp32, jaxmoe master params), else the source dtype."""
    out = {}
    fp32 = hf_map.fp32_leaves(source.cfg)
    for key in source.keys():
        if key in fp32:
            out[key] = np.dtype(np.float32)
        elif dtype is not None:
            out[key] = np.dtype(dtype)
        elif default is not None:
            out[key] = np.dtype(default)
        else:
            out[key] = source.leaf_dtype(key)
    return out


def convert(src: Endpoint, dst: Endpoint, dtype: str | None = None, force: bool = False,
            log=None, **options) -> dict:
    """Convert ``src`` to ``dst``; returns figures (tensors, bytes, seconds, notices).

    ``options``: format options by name (``shard_size``, ``hf_layout`` of an ``hf:``
    destination; see the formats' ``options``), attached to the endpoint whose format takes them
    (:func:`jaxmoe.port.formats.bind_options`)."""
    log = log if log is not None else (lambda msg: print(msg, file=sys.stderr))
    np_dtype = _float_dtype(dtype)
    src, dst = bind_options(options, source=src, sink=dst)
    dst.format.check_sink(dst)
    if src.path.resolve() == dst.path.resolve():
        raise UserError(f"--from and --to are the same path ({dst.path})")
    if _is_nonempty(dst.path):
        if not force:
            raise UserError(f"{dst}: exists and is not empty; pass --force to replace it")
        _check_replaceable(src, dst)
    t0 = time.perf_counter()
    source = open_source(src)  # validates: raises before anything is written
    cfg = source.cfg
    if dst.format.hf_arch_only:
        hf_map.check_supported(cfg)
    for note in source.notices:
        log(note)
    dtypes = _out_dtypes(source, dst.format.default_dtype, np_dtype)
    src_dtypes = sorted({str(source.leaf_dtype(k)) for k in source.keys()})

    dst.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.path.name}.tmp-", dir=dst.path.parent))
    target = tmp / "out"
    written, copied = 0, 0
    pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="jaxmoe-copy")
    behind: dict = {}  # destination file -> its FileBehind, shared by every copy into it
    try:
        sink = dst.format.open_sink(dst, target, cfg, dtypes, log)
        sink.use_source(source)
        gathered: list = []  # (leaf, its copies) of consecutive byte-copied leaves
        for key in source.keys():
            pairs = _raw_pairs(source, sink, key)
            if pairs is not None:
                gathered.append((key, pairs))
                if sink.raw_any_order:
                    continue
            n = _copy_leaves(pool, sink, gathered, behind)
            written, copied, gathered = written + n, copied + n, []
            if pairs is not None:
                continue
            buf = sink.buffer(key, source.shapes[key], dtypes[key])
            if buf is None and sink.takes_views:
                # one layer's / expert's slice at a time where the source can, never the whole leaf
                arr = source.leaf_view(key, dtypes[key])
            else:
                arr = source.read_leaf(key, dtypes[key], out=buf)
            del buf
            written += arr.nbytes
            sink.write_leaf(key, arr)
            del arr
        n = _copy_leaves(pool, sink, gathered, behind)
        written, copied = written + n, copied + n
        _close_all(behind)
        sink.finish()
        source.close()
        carried = sink.carry(meta_files(source.meta_dir, log), log)
        _fsync_tree(target)
        if dst.path.exists() or dst.path.is_symlink():
            _remove(dst.path)
        os.replace(target, dst.path)
        fsync_path(dst.path.parent)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _close_all(behind)
        shutil.rmtree(tmp, ignore_errors=True)
    secs = time.perf_counter() - t0
    return {
        "src": str(src), "dst": str(dst), "arch": cfg.model.hf_arch,
        "leaves": len(source.keys()),
        "tensors": sink.tensors,
        **report_fields(dst),
        "bytes": int(written), "bytes_copied": int(copied), "seconds": round(secs, 3),
        "mb_per_s": round(written / 1e6 / max(secs, 1e-9), 1),
        "dtype": sorted({str(d) for d in dtypes.values()}), "src_dtype": src_dtypes,
        "notices": source.notices, "carried": carried,
    }


def load_numpy_tree(ep: Endpoint, dtype=np.float32):
    """(cfg, params, buffers) as nested dicts of numpy arrays, from any endpoint."""
    with open_source(ep) as source:
        flat = {}
        for key in source.keys():
            d = np.float32 if key.startswith("buffers/") else dtype
            flat[key] = source.read_leaf(key, np.dtype(d))
    tree = hf_map.unflatten(flat)
    return source.cfg, tree.get("params", {}), tree.get("buffers", {})


__all__ = ["convert", "load_numpy_tree", "raw_copies"]
