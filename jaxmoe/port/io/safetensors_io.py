"""Streaming safetensors I/O: read and write one tensor at a time, single files or sharded dirs.

Why not ``safetensors.numpy.save_file`` / ``safe_open``? ``save_file`` needs every tensor in
memory at once, and the numpy flavour of ``safe_open`` cannot return bfloat16 or float8 (numpy
has no such dtypes). The format is simple enough to handle directly:

    8 bytes   little-endian u64: header length N
    N bytes   JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
                     "__metadata__": {str: str}}   (padded with spaces to a multiple of 8)
    rest      the raw little-endian tensor bytes, offsets relative to the start of this part

Reading uses ``numpy.fromfile`` at an offset (one tensor in memory); bfloat16 / float8 come back as
``ml_dtypes`` arrays (ml_dtypes ships with jax). Writing first plans the whole layout (names,
shapes, dtypes are known up front from the mapping), writes every header, then writes each tensor
at its planned offset whenever the caller has it: the order in which tensors arrive does not
matter, and only the tensor being written is in memory.

A sharded HF checkpoint is a directory with ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``) and the shard files; an
unsharded one has a single ``model.safetensors``.

DeepSeek-V3 FP8 checkpoints store some ``X.weight`` as float8_e4m3fn with a float32
``X.weight_scale_inv`` of one scale per 128x128 block; :func:`dequantize_fp8` undoes that.
"""

from __future__ import annotations

import collections
import json
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.storage import page_cache
from jaxmoe.storage.direct_io import DirectWriter

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tag <-> numpy dtype
_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_TAGS = {v: k for k, v in _DTYPES.items()}

FLOAT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype_tag(dtype) -> str:
    """safetensors tag (e.g. "BF16") of a numpy / ml_dtypes dtype."""
    try:
        return _TAGS[np.dtype(dtype)]
    except KeyError:
        raise UserError(f"dtype {dtype} cannot be stored in safetensors") from None


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '64KiB' / '1000' -> bytes (decimal units as HF uses; *iB are binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"--shard-size {text!r}: expected a size like 5GB, 500MB or 1000000")
    num, unit = float(m.group(1)), m.group(2).upper()
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
             "T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if unit not in scale:
        raise UserError(f"--shard-size {text!r}: unknown unit {unit!r} (use B, KB, MB, GB, GiB…)")
    size = int(num * scale[unit])
    if size <= 0:
        raise UserError(f"--shard-size {text!r} must be positive")
    return size


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


def read_header(file: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one safetensors file's header: ({name: TensorInfo}, metadata)."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    infos = {}
    for name, h in header.items():
        if h["dtype"] not in _DTYPES:
            raise UserError(f"{file}: tensor {name} has unsupported dtype {h['dtype']}")
        begin, end = h["data_offsets"]
        infos[name] = TensorInfo(file, _DTYPES[h["dtype"]], tuple(h["shape"]), 8 + n + begin,
                                 end - begin)
    return infos, meta


class SafetensorsReader:
    """Lazy view of one safetensors file or an HF checkpoint directory (sharded or not).

    Only headers are read up front; :meth:`get` reads a single tensor from disk.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        if path.is_dir():
            if (path / INDEX_FILE).exists():
                try:
                    index = json.loads((path / INDEX_FILE).read_text())
                    files = sorted(set(index["weight_map"].values()))
                except (ValueError, KeyError) as e:
                    raise UserError(f"{path / INDEX_FILE}: not a valid index ({e})") from None
                for fname in files:
                    if not (path / fname).exists():
                        raise UserError(f"{path / INDEX_FILE} names shard {fname}, which is missing")
            elif (path / SINGLE_FILE).exists():
                files = [SINGLE_FILE]
            else:
                files = sorted(p.name for p in path.glob("*.safetensors"))
                if not files:
                    raise UserError(f"{path}: no model.safetensors, index or *.safetensors files")
            for fname in files:
                infos, meta = read_header(path / fname)
                for name in infos:
                    if name in self.infos:
                        raise UserError(f"{path}: tensor {name} appears in two shards")
                self.infos.update(infos)
                self.metadata.update(meta)
        elif path.is_file():
            self.infos, self.metadata = read_header(path)
        else:
            raise UserError(f"{path}: no such file or directory")

    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.infos[name].dtype

    def get(self, name: str) -> np.ndarray:
        """Read one tensor (a fresh, writable array in its stored dtype)."""
        info = self.infos[name]
        count = int(np.prod(info.shape, dtype=np.int64))
        if count * info.dtype.itemsize != info.nbytes:
            raise UserError(f"{info.file}: tensor {name} has {info.nbytes} bytes for shape "
                            f"{list(info.shape)} {dtype_tag(info.dtype)}")
        arr = np.fromfile(info.file, dtype=info.dtype, count=count, offset=info.offset)
        page_cache.drop_path(info.file, info.offset, info.nbytes)
        return arr.reshape(info.shape)

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read one tensor straight into ``out`` (C-contiguous, same shape and dtype): no
        temporary copy, which keeps assembling a stacked leaf at one leaf of memory."""
        info = self.infos[name]
        if (tuple(out.shape) != info.shape or out.dtype != info.dtype
                or not out.flags.c_contiguous or out.nbytes != info.nbytes):
            raise ValueError(f"read_into {name}: target {out.shape} {out.dtype} does not fit")
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.offset)
            done = 0
            while done < info.nbytes:
                n = f.readinto(view[done:done + page_cache.PIECE])
                if not n:
                    raise UserError(f"{info.file}: truncated while reading tensor {name}")
                page_cache.drop(f.fileno(), info.offset + done, n)  # read once: free its pages
                done += n


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    """DeepSeek-V3 block FP8 -> float32: ``weight[i, j] * scale_inv[i // bo, j // bi]``.

    ``weight`` [out, in] (float8_e4m3fn), ``scale_inv`` [ceil(out/bo), ceil(in/bi)]; the last
    block of each dim may be partial. Done in row blocks so the temporary stays ~one tensor.
    """
    bo, bi = block
    out_dim, in_dim = weight.shape
    want = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != want:
        raise UserError(f"FP8 scale shape {list(scale_inv.shape)} does not match weight shape "
                        f"{list(weight.shape)} with {bo}x{bi} blocks (expected {list(want)})")
    scale = scale_inv.astype(np.float32)
    res = np.empty(weight.shape, np.float32)
    for r in range(want[0]):
        rows = slice(r * bo, min((r + 1) * bo, out_dim))
        col_scale = np.repeat(scale[r], bi)[:in_dim]
        res[rows] = weight[rows].astype(np.float32) * col_scale[None, :]
    return res


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


@dataclass
class _Planned:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute
    nbytes: int
    written: bool = False


class SafetensorsWriter:
    """Write a planned set of tensors into one file or a sharded directory, in any order.

    ``plan`` is an ordered list of ``(name, shape, dtype)``; that order is the on-disk order.
    ``target`` is a file path (single file, ``shard_size`` must be None) or a directory (HF
    layout: ``model.safetensors`` or, when ``shard_size`` is given and the tensors do not fit one
    shard, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``). Headers are
    written and files pre-sized on construction; :meth:`write` puts one tensor in place;
    :meth:`close` checks that every planned tensor was written.
    """

    def __init__(self, target: str | Path, plan, metadata: dict | None = None,
                 shard_size: int | None = None, single_file: bool = False, in_flight: int = 0):
        target = Path(target)
        # in_flight > 0: write() hands the bytes to one writer thread and returns while up to
        # that many tensors are still being written (the caller reads the next one meanwhile);
        # the caller must not change an array it passed. Errors surface at write() or close().
        self._in_flight = int(in_flight)
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="jaxmoe-write")
                      if self._in_flight > 0 else None)
        self._pending: collections.deque = collections.deque()
        self._direct: dict[Path, DirectWriter] = {}  # per file: its writes, around the page cache
        self._direct_lock = threading.Lock()
        self.planned: dict[str, _Planned] = {}
        # group tensors into shards (a tensor larger than shard_size gets a shard of its own)
        shards: list[list[tuple]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if shard_size is not None and shards[-1] and size + nbytes > shard_size:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(int(s) for s in shape), np.dtype(dtype), nbytes))
            size += nbytes
        if single_file:
            if len(shards) > 1:
                raise UserError("a single-file safetensors target cannot be sharded")
            files = [target]
        else:
            target.mkdir(parents=True, exist_ok=True)
            n = len(shards)
            files = [target / (SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                     for i in range(n)]
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        meta.setdefault("format", "pt")
        self.total_size = 0
        for file, tensors in zip(files, shards):
            header, off = {}, 0
            for name, shape, dtype, nbytes in tensors:
                header[name] = {"dtype": dtype_tag(dtype), "shape": list(shape),
                                "data_offsets": [off, off + nbytes]}
                off += nbytes
            header["__metadata__"] = meta
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            with open(file, "wb") as f:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                f.truncate(8 + len(blob) + off)
            base = 8 + len(blob)
            for name, shape, dtype, nbytes in tensors:
                start = header[name]["data_offsets"][0]
                self.planned[name] = _Planned(file, dtype, shape, base + start, nbytes)
            self.total_size += off
        if not single_file and len(files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {name: p.file.name for name, p in self.planned.items()}}
            (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self.files = files

    def write(self, name: str, array: np.ndarray) -> None:
        p = self.planned.get(name)
        if p is None:
            raise KeyError(f"tensor {name} is not in the write plan")
        if p.written:
            raise KeyError(f"tensor {name} written twice")
        if tuple(array.shape) != p.shape:
            raise ValueError(f"tensor {name}: shape {list(array.shape)} != planned {list(p.shape)}")
        p.written = True
        if self._pool is None:
            self._put(p, array)
            return
        self._pending.append(self._pool.submit(self._put, p, array))
        while len(self._pending) > self._in_flight:
            self._pending.popleft().result()

    def _put(self, p: _Planned, array) -> None:
        data = np.ascontiguousarray(array, dtype=p.dtype)
        self.direct(p.file).pwrite(data.reshape(-1).view(np.uint8), p.offset)

    def direct(self, file: Path) -> DirectWriter:
        """The writer of ``file``'s bytes (one per file, kept until :meth:`close`)."""
        with self._direct_lock:
            w = self._direct.get(file)
            if w is None:
                w = self._direct[file] = DirectWriter(file)
            return w

    def drain(self) -> None:
        """Wait for the writes in flight; the first failure is raised."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            writers, self._direct = list(self._direct.values()), {}
            errors = []
            for w in writers:
                try:
                    w.close()
                except OSError as e:
                    errors.append(e)
            if errors:
                raise errors[0]
        missing = [n for n, p in self.planned.items() if not p.written]
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors never written, e.g. {missing[0]}")


class PartWriter(SafetensorsWriter):
    """A :class:`SafetensorsWriter` that also writes *parts* of a tensor (a fused
    ``gate_up_proj``'s gate or up half, :attr:`jaxmoe.port.maps.hf_map.Entry.hf_part`) straight to their place in
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
        out = self.direct(p.file)
        for i, run in enumerate(runs):
            out.pwrite(run, p.offset + (i * p.shape[dim] + start) * inner)
        got.append((start, stop))
        p.written = sum(b - a for a, b in got) == p.shape[dim]


# tensors an HF / torch sink's writer thread may still be writing when write_leaf returns: the
# source reads (and transposes) the next while the last are written
WRITES_IN_FLIGHT = 2


def write_tensors(target, tensors: dict, metadata=None, shard_size=None, single_file=False):
    """Convenience for small dicts of arrays (tests): plan in dict order, write, close."""
    w = SafetensorsWriter(target, [(k, v.shape, v.dtype) for k, v in tensors.items()],
                          metadata=metadata, shard_size=shard_size, single_file=single_file)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    return w


__all__ = [
    "FLOAT_DTYPES", "INDEX_FILE", "SINGLE_FILE", "WRITES_IN_FLIGHT", "PartWriter",
    "SafetensorsReader", "SafetensorsWriter",
    "TensorInfo", "dequantize_fp8", "dtype_tag", "parse_size", "read_header",
    "write_tensors",
]
