"""Reading torch.distributed.checkpoint (DCP) step directories without running code from them.

A DCP step directory (``step-N/``) holds ``.metadata`` -- a pickle of DCP's ``Metadata``: every
entry's global shape and dtype, the chunks (offsets, sizes) it was saved in, and where each chunk
lies (``_StorageInfo``: file, byte offset, length) -- and one ``__R_0.distcp`` file per writing
rank. :class:`DcpDir` reads the metadata and assembles any tensor from its chunks (a tensor several
ranks saved -- FSDP / expert-parallel shards -- lies in several files), one tensor at a time.

No code from the checkpoint runs. torch's own reader unpickles ``.metadata`` with plain
``pickle.load`` (any callable a file names is called); here :class:`SafeUnpickler` resolves only
an allow-list of DCP's metadata classes, torch's ``Size`` / dtypes and a few helpers -- each to a
stand-in of this module (plain records, tuples, names): torch is never imported, and anything else
is one line naming the refused class. Each tensor chunk is stored as the bytes ``torch.save``
writes: an uncompressed zip whose ``data.pkl`` (read with the same allow-list:
``torch._utils._rebuild_tensor_v2`` and the typed storages, again stand-ins) gives the storage
dtype, offset, shape and strides, and whose ``data/N`` entry holds the raw storage bytes, read
straight from the file (``np.memmap``). Chunks written without ``torch.save`` (DCP's raw
``numel * itemsize`` bytes) are read as they are. Byte items (the optimizer's param groups,
``lr_scheduler.last_epoch``, ...) are read only on request (:meth:`DcpDir.read_object`, for
``train --resume-from``), with the same allow-list: plain values only.

Pure Python + numpy (no torch): the ``dcp:`` format (:mod:`jaxmoe.port.formats.dcp`) reads with it.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmoe.errors import UserError


def shape_text(shape) -> str:
    """``[2, 3]``: a shape as messages print it."""
    return "[" + ", ".join(str(int(x)) for x in shape) + "]"

# torch dtype name -> numpy dtype (what a DCP entry or a typed storage may hold)
DTYPES = {
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int64": np.dtype(np.int64), "int32": np.dtype(np.int32), "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64), "complex128": np.dtype(np.complex128),
}
# torch's legacy typed storages (``torch.FloatStorage``, ...) as ``data.pkl`` names them
STORAGES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
}
# top-level state-dict entries of a torchtitan full checkpoint that are not model weights
TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def contiguous_strides(shape) -> tuple[int, ...]:
    """torch's strides (in elements) of a C-contiguous tensor of ``shape`` (a 0- or 1-size dim
    counts as 1)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


# --------------------------------------------------------------------------------------------
# A pickle reader that runs no code: allow-listed names resolve to stand-ins of this module
# --------------------------------------------------------------------------------------------


class Record:
    """A stand-in for an allow-listed DCP metadata class: its pickled fields as attributes."""

    kind = "Record"
    #: the field names of a class whose ``__getstate__`` pickles a plain tuple
    fields: tuple[str, ...] = ()

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if self.fields and isinstance(state, tuple) and len(state) == len(self.fields):
            state = dict(zip(self.fields, state, strict=True))
        elif isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slotted class
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.kind}: unexpected state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self):
        return f"{self.kind}({self.__dict__})"


def _record(name: str, fields: tuple[str, ...] = ()) -> type[Record]:
    return type(name, (Record,), {"kind": name, "fields": fields})


class DType(str):
    """A torch dtype, by name (``"float32"``)."""


class Storage(str):
    """A typed storage class (``torch.FloatStorage``), by its dtype name."""


class TensorRef:
    """What ``torch._utils._rebuild_tensor_v2`` would have built: where the tensor lies in its
    storage. ``storage`` is the persistent id ``('storage', Storage, key, location, numel)``."""

    def __init__(self, storage, offset, size, stride, *rest):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def _value(*args):
    """An enum's pickled value (``_MEM_FORMAT_ENCODING(2)`` -> 2), a layout's name, a path."""
    return args[0] if args else None


def _path(*parts):
    """A pickled ``pathlib`` path (its parts), as text."""
    return "/".join(str(p) for p in parts)


ALLOWED: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", n): _record(n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta")},
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): _record(
        "TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _value,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    ("torch.serialization", "_get_layout"): _value,
    ("torch", "Size"): tuple,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("collections", "OrderedDict"): dict,
    ("torch._utils", "_rebuild_tensor_v2"): TensorRef,
    **{("torch", n): DType(n) for n in DTYPES},
    **{("torch", n): Storage(d) for n, d in STORAGES.items()},
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only :data:`ALLOWED` names (to this module's stand-ins); any other is refused
    with one line naming it. Persistent ids (a tensor's storage) are returned as they are."""

    def __init__(self, file, what: str):
        super().__init__(file)
        self.what = what

    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UserError(f"{self.what}: refusing to unpickle {module}.{name} (not one of the "
                            "DCP metadata classes jaxmoe reads; a checkpoint must not run code)") from None

    def persistent_load(self, pid):
        return pid


def safe_loads(data: bytes, what: str):
    """``data`` unpickled by :class:`SafeUnpickler` (a one-line UserError when it is not a pickle
    of allowed names)."""
    try:
        return SafeUnpickler(io.BytesIO(data), what).load()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (truncated or malformed pickle: one line)
        raise UserError(f"{what}: not a readable DCP pickle ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------
# The step directory: metadata, chunks, tensors
# --------------------------------------------------------------------------------------------


class Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a seekable file of their own."""

    def __init__(self, fh, start: int, length: int):
        self.fh, self.start, self.length, self.pos = fh, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class Chunk:
    """One saved chunk of a tensor: global ``offsets``/``sizes`` and its bytes' place."""

    def __init__(self, offsets, sizes, file: Path, offset: int, length: int):
        self.offsets, self.sizes = tuple(offsets), tuple(sizes)
        self.file, self.offset, self.length = file, offset, length


class DcpDir:
    """A DCP step directory's metadata (read safely), and its tensors read chunk by chunk."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        meta = path / ".metadata"
        if not path.is_dir():
            raise UserError(f"{what}: not a directory")
        if not meta.is_file():
            steps = sorted(p.name for p in path.glob("step-*") if (p / ".metadata").is_file())
            hint = f"; it holds {', '.join(steps)}: name one, e.g. dcp:{path / steps[-1]}" if steps else ""
            raise UserError(f"{what}: no .metadata (not a DCP checkpoint step directory){hint}")
        md = safe_loads(meta.read_bytes(), f"{what}: .metadata")
        sdm = getattr(md, "state_dict_metadata", None)
        storage = getattr(md, "storage_data", None)
        if getattr(md, "kind", None) != "Metadata" or not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise UserError(f"{what}: .metadata is not DCP Metadata")
        self.tensors: dict[str, Record] = {}  # fqn -> TensorStorageMetadata
        self.byte_items: list[str] = []
        for fqn, m in sdm.items():
            if getattr(m, "kind", None) == "TensorStorageMetadata":
                self.tensors[fqn] = m
            elif getattr(m, "kind", None) == "BytesStorageMetadata":
                self.byte_items.append(fqn)
            else:
                raise UserError(f"{what}: .metadata entry {fqn} is neither a tensor nor bytes")
        self.places: dict[tuple[str, tuple], Record] = {}
        for idx, info in storage.items():  # fields at their dataclass default are not pickled
            offset = getattr(idx, "offset", None)
            self.places[(idx.fqn, tuple(offset) if offset is not None else None)] = info
        self._sizes: dict[Path, int] = {}

    def files(self) -> list[Path]:
        names = sorted({info.relative_path for info in self.places.values()})
        return [self.path / n for n in names]

    def check_files(self) -> None:
        """Every shard file the metadata names exists and holds the byte ranges it says."""
        ends: dict[str, int] = {}
        for info in self.places.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            f = self.path / name
            if not f.is_file():
                raise UserError(f"{self.what}: shard file {name} is missing (.metadata names it)")
            size = f.stat().st_size
            if size < end:
                raise UserError(f"{self.what}: shard file {name} is truncated ({size} bytes, the "
                                f".metadata needs {end})")

    def dtype(self, fqn: str) -> np.dtype:
        name = str(self.tensors[fqn].properties.dtype)
        if name not in DTYPES:
            raise UserError(f"{self.what}: tensor {fqn} has dtype {name}, which jaxmoe does not read")
        return DTYPES[name]

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(int(x) for x in self.tensors[fqn].size)

    def chunks(self, fqn: str) -> list[Chunk]:
        out = []
        for c in self.tensors[fqn].chunks:
            info = self.places.get((fqn, tuple(c.offsets)))
            if info is None:
                raise UserError(f"{self.what}: .metadata has no storage for a chunk of {fqn} "
                                f"at {shape_text(c.offsets)}")
            if getattr(info, "transform_descriptors", None):
                raise UserError(f"{self.what}: tensor {fqn} is stored with transforms "
                                f"{list(info.transform_descriptors)}, which jaxmoe does not read")
            out.append(Chunk(c.offsets, c.sizes, self.path / info.relative_path, info.offset, info.length))
        return out

    def read(self, fqn: str, out: np.ndarray | None = None) -> np.ndarray:
        """The whole tensor ``fqn`` (its dtype, global shape), assembled from its chunks."""
        shape, dtype = self.shape(fqn), self.dtype(fqn)
        if out is None:
            out = np.empty(shape, dtype)
        covered = 0
        for ch in self.chunks(fqn):
            if len(ch.offsets) != len(shape) or any(
                    o < 0 or o + s > n for o, s, n in zip(ch.offsets, ch.sizes, shape, strict=True)):
                raise UserError(f"{self.what}: a chunk of {fqn} ({shape_text(ch.sizes)} at "
                                f"{shape_text(ch.offsets)}) lies outside its shape {shape_text(shape)}")
            box = tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes, strict=True))
            dst = out[box + (...,)]  # a view, also of a 0-d tensor
            dst[...] = self._chunk(fqn, ch, dtype)
            covered += int(np.prod(ch.sizes, dtype=np.int64))
        if covered != int(np.prod(shape, dtype=np.int64)):
            raise UserError(f"{self.what}: the chunks of {fqn} cover {covered} of its "
                            f"{int(np.prod(shape, dtype=np.int64))} elements")
        return out

    def view(self, fqn: str) -> np.ndarray:
        """The tensor ``fqn``: a read-only map of its bytes when one chunk holds all of it (no
        copy), else :meth:`read`."""
        shape, dtype = self.shape(fqn), self.dtype(fqn)
        chunks = self.chunks(fqn)
        if len(chunks) == 1 and chunks[0].sizes == shape and not any(chunks[0].offsets):
            return self._chunk(fqn, chunks[0], dtype)
        return self.read(fqn)

    def read_object(self, fqn: str):
        """A byte item (``lr_scheduler.last_epoch``, an optimizer param-group field, ...): the
        ``torch.save`` bytes' ``data.pkl`` read by :class:`SafeUnpickler`, so only plain values
        (numbers, strings, tuples, lists, dicts, None) come back; anything naming a class outside
        the allow-list is refused. A scalar tensor entry (``train_state.step`` saved as a tensor)
        is returned as its Python number."""
        if fqn in self.tensors:
            a = self.read(fqn)
            if a.size != 1:
                raise UserError(f"{self.what}: {fqn} is a tensor of shape {shape_text(a.shape)}, not a value")
            return a.reshape(()).item()
        if fqn not in self.byte_items:
            raise UserError(f"{self.what}: no entry {fqn}")
        info = self.places.get((fqn, None))
        if info is None:
            raise UserError(f"{self.what}: .metadata has no storage for the item {fqn}")
        what = f"{self.what}: item {fqn}"
        try:
            with open(self.path / info.relative_path, "rb") as fh:
                z = zipfile.ZipFile(Window(fh, info.offset, info.length))
                pkl = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
                if pkl is None:
                    raise UserError(f"{what}: its torch.save bytes hold no data.pkl")
                value = safe_loads(z.read(pkl), f"{what} (data.pkl)")
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise UserError(f"{what}: unreadable torch.save bytes ({e})") from None
        if isinstance(value, (TensorRef, Record)):
            raise UserError(f"{what}: holds a {type(value).__name__}, not a plain value")
        return value

    def _chunk(self, fqn: str, ch: Chunk, dtype: np.dtype) -> np.ndarray:
        """The chunk's values as a read-only map of the file (no copy)."""
        n = int(np.prod(ch.sizes, dtype=np.int64))
        with open(ch.file, "rb") as fh:
            fh.seek(ch.offset)
            magic = fh.read(4)
            if magic != b"PK\x03\x04":  # raw bytes (DCP's buffer-protocol serialization)
                if ch.length != n * dtype.itemsize:
                    raise UserError(f"{self.what}: a chunk of {fqn} is {ch.length} bytes, neither "
                                    f"torch.save's zip nor {n} raw {dtype} values")
                return np.memmap(ch.file, dtype=dtype, mode="r", offset=ch.offset, shape=ch.sizes)
            return self._zip_chunk(fqn, ch, fh, dtype, n)

    def place(self, fqn: str) -> tuple[Path, int, int] | None:
        """(file, byte offset, byte count) of tensor ``fqn``'s values when they lie in one file as
        plain C-order bytes (one chunk holding the whole tensor, saved raw or as ``torch.save``'s
        stored zip with contiguous strides): what a byte-for-byte copy can take; else None."""
        shape, dtype = self.shape(fqn), self.dtype(fqn)
        chunks = self.chunks(fqn)
        if len(chunks) != 1 or chunks[0].sizes != shape or any(chunks[0].offsets):
            return None
        ch, n = chunks[0], int(np.prod(shape, dtype=np.int64))
        with open(ch.file, "rb") as fh:
            fh.seek(ch.offset)
            if fh.read(4) != b"PK\x03\x04":
                return (ch.file, ch.offset, ch.length) if ch.length == n * dtype.itemsize else None
            ref, start = self._zip_storage(fqn, ch, fh, dtype)
        if ref.offset != 0 or (n > 1 and tuple(ref.stride) != contiguous_strides(shape)):
            return None
        return ch.file, ch.offset + start, n * dtype.itemsize

    def _zip_storage(self, fqn, ch: Chunk, fh, dtype) -> tuple[TensorRef, int]:
        """The ``torch.save`` zip of one chunk: its tensor reference (checked against the
        metadata) and where its storage bytes start, from the chunk's start."""
        what = f"{self.what}: tensor {fqn}"
        try:
            z = zipfile.ZipFile(Window(fh, ch.offset, ch.length))
            infos = {i.filename: i for i in z.infolist()}
            pkl = next((i for name, i in infos.items() if name.endswith("/data.pkl")), None)
            if pkl is None:
                raise UserError(f"{what}: its torch.save bytes hold no data.pkl")
            ref = safe_loads(z.read(pkl), f"{what} (data.pkl)")
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise UserError(f"{what}: unreadable torch.save bytes ({e})") from None
        if not isinstance(ref, TensorRef) or not (isinstance(ref.storage, tuple) and len(ref.storage) == 5):
            raise UserError(f"{what}: its torch.save bytes hold no plain tensor")
        _, storage, key, _, numel = ref.storage
        if not isinstance(storage, Storage) or DTYPES[str(storage)] != dtype:
            raise UserError(f"{what}: stored as {storage}, the .metadata says {dtype}")
        if ref.size != ch.sizes:
            raise UserError(f"{what}: a chunk of shape {shape_text(ref.size)} where the .metadata "
                            f"says {shape_text(ch.sizes)}")
        prefix = pkl.filename[: -len("data.pkl")]
        info = infos.get(f"{prefix}data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED or info.file_size != numel * dtype.itemsize:
            raise UserError(f"{what}: its storage data/{key} is missing, compressed or of the wrong size")
        # the storage's bytes start after the entry's local header (30 bytes + name + extra)
        fh.seek(ch.offset + info.header_offset)
        head = fh.read(30)
        if head[:4] != b"PK\x03\x04":
            raise UserError(f"{what}: bad zip entry header for data/{key}")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > ch.length:
            raise UserError(f"{what}: its storage lies beyond the chunk's bytes")
        return ref, start

    def _zip_chunk(self, fqn, ch: Chunk, fh, dtype, n) -> np.ndarray:
        what = f"{self.what}: tensor {fqn}"
        ref, start = self._zip_storage(fqn, ch, fh, dtype)
        numel = ref.storage[4]
        flat = np.memmap(ch.file, dtype=dtype, mode="r", offset=ch.offset + start, shape=(int(numel),))
        last = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=True)) if n else 0
        if ref.offset < 0 or any(st < 0 for st in ref.stride) or last >= max(numel, 1):
            raise UserError(f"{what}: its view lies outside its storage")
        return np.lib.stride_tricks.as_strided(
            flat[ref.offset:], shape=ref.size, strides=tuple(st * dtype.itemsize for st in ref.stride),
            writeable=False)


__all__ = ["ALLOWED", "DTYPES", "contiguous_strides", "TRAINING_STATE", "Chunk", "DcpDir", "Record", "SafeUnpickler",
           "safe_loads", "shape_text"]
