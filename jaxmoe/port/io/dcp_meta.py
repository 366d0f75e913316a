"""A DCP step's ``.metadata`` written without importing torch (the ``dcp:`` sink).

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``; pickling the real
classes needs torch imported (seconds and hundreds of MB: as long as copying a small model at disk
speed; docs/MEASUREMENTS.md, "Conversion"). :func:`metadata_bytes` emits the same pickle from plain
descriptions instead: a pure-Python pickler (``pickle._Pickler``, the stdlib's reference
implementation, which is subclassable per type) writes three stand-ins as the opcodes the real
objects reduce to -- :class:`Global` (a class or function by module and name: ``STACK_GLOBAL``),
:class:`New` (a dataclass: ``NEWOBJ`` + ``BUILD`` of its state) and :class:`Call` (``REDUCE``:
``torch.Size``, the layout and memory-format lookups). The fields are those torch 2.13's DCP pickles (checked by
``tests/test_dcp_write.py``: the bytes unpickle, with torch, to a ``Metadata`` equal to one built
from torch's classes; and torchtitan's ``CheckpointManager`` loads what the sink writes,
``tests/test_dcp.py``).
"""

from __future__ import annotations

import io
import pickle

META = "torch.distributed.checkpoint.metadata"
FILESYSTEM = "torch.distributed.checkpoint.filesystem"
#: what torch 2.13's DCP writes (``filesystem.CURRENT_DCP_VERSION``); readers accept it
DCP_VERSION = "1.0.0"


class Global:
    """A module attribute (class or function), pickled by reference."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class New:
    """An object made by ``cls.__new__`` and given ``state`` (a dataclass instance)."""

    def __init__(self, cls: Global, state=None):
        self.cls, self.state = cls, state


class Call:
    """The result of ``func(*args)``."""

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, args


class _Writer(pickle._Pickler):  # the pure-Python pickler: per-type save functions
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_global(self, obj: Global) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_new(self, obj: New) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[Global] = _save_global
    dispatch[New] = _save_new
    dispatch[Call] = _save_call


_G: dict[tuple[str, str], Global] = {}


def _g(module: str, name: str) -> Global:
    """One Global per name (the pickle refers back to it instead of repeating it)."""
    return _G.setdefault((module, name), Global(module, name))


def _size(dims) -> Call:
    return Call(_g("torch", "Size"), (tuple(int(d) for d in dims),))


def tensor_entry(dtype_name: str, shape) -> New:
    """``TensorStorageMetadata`` of a tensor of torch dtype ``dtype_name`` (``"bfloat16"``) and
    ``shape``, saved as one chunk."""
    props = New(_g(META, "TensorProperties"), (
        _g("torch", dtype_name), Call(_g("torch.serialization", "_get_layout"), ("torch.strided",)), False,
        Call(_g(META, "_MEM_FORMAT_ENCODING"), (0,)), False))
    chunk = New(_g(META, "ChunkStorageMetadata"), {"offsets": _size([0] * len(shape)), "sizes": _size(shape)})
    return New(_g(META, "TensorStorageMetadata"), {"properties": props, "size": _size(shape), "chunks": [chunk]})


def metadata_bytes(tensors: dict, items: dict, planner: dict, file: str) -> bytes:
    """The ``.metadata`` pickle of a one-file step: ``tensors`` ``{fqn: (torch dtype name, shape,
    offset, length)}`` (each one chunk), ``items`` ``{fqn: (offset, length)}`` (byte items),
    ``planner`` ``{fqn: state-dict path tuple}``, all stored in ``file``."""
    sdm, storage = {}, {}
    info = _g(FILESYSTEM, "_StorageInfo")
    index = _g(META, "MetadataIndex")
    for fqn, (dtype_name, shape, at, length) in tensors.items():
        sdm[fqn] = tensor_entry(dtype_name, shape)
        key = New(index, {"fqn": fqn, "index": 0, "offset": _size([0] * len(shape))})
        storage[key] = New(info, {"relative_path": file, "offset": int(at), "length": int(length)})
    for fqn, (at, length) in items.items():
        sdm[fqn] = New(_g(META, "BytesStorageMetadata"))
        storage[New(index, {"fqn": fqn, "index": None})] = New(
            info, {"relative_path": file, "offset": int(at), "length": int(length)})
    md = New(_g(META, "Metadata"), {"state_dict_metadata": sdm, "planner_data": dict(planner),
                                   "storage_data": storage, "storage_meta": None, "version": DCP_VERSION})
    buf = io.BytesIO()
    _Writer(buf, protocol=4).dump(md)
    return buf.getvalue()


__all__ = ["DCP_VERSION", "Call", "Global", "New", "metadata_bytes", "tensor_entry"]
