"""The bytes ``torch.save(tensor, f)`` writes for one tensor, laid out without torch.

A ``dcp:`` checkpoint stores each tensor as what ``torch.save`` writes (DCP's
``FileSystemWriter`` saves every tensor item that way, and ``torch.load`` reads it back). Calling
``torch.save`` per tensor pushed every byte through torch's zip writer and a Python file object
(the ``hf -> dcp`` route's bottleneck: docs/history/MEASUREMENTS-2026-12.md, "Conversion at disk speed"), and a
tensor's bytes could never be copied into place file to file. :class:`TensorZip` lays out the
same zip for a C-contiguous tensor of a given dtype and shape: :attr:`TensorZip.head` (every
record before the storage bytes, and the storage record's own header), then the storage bytes
themselves at :attr:`TensorZip.data_offset` (written by the caller from memory, or copied in by
the kernel), then :meth:`TensorZip.tail` (the storage's data descriptor, the last two records,
the central directory and the zip64 end records), which needs only the storage's CRC-32.

The layout is torch's (its bundled miniz with torch's 64-byte alignment), checked byte for byte
against ``torch.save`` by ``tests/test_dcp_write.py`` up to the random serialization id:

* records, all stored: ``archive/data.pkl`` (the pickle of ``_rebuild_tensor_v2`` and a
  persistent id naming the typed storage), ``.format_version`` ``1``, ``.storage_alignment``
  ``64``, ``byteorder`` ``little``, ``data/0`` (the storage), ``version`` ``3\\n``,
  ``.data/serialization_id`` (40 digits);
* every local header has flags 0x0808 (data descriptor, UTF-8; 0x0800 and no descriptor for an
  empty record), zero CRC and sizes, and an
  ``FB`` extra field of ``Z`` bytes that puts the record's data on a 64-byte boundary of the zip;
* a record of >= 4 GiB, or one whose header starts at or past 4 GiB, gets a zip64 extra field
  (sizes and/or header offset) before the padding, a 24-byte data descriptor instead of 16, and
  0xFFFFFFFF in the central directory's 32-bit fields it overflows; the zip always ends with
  zip64 end-of-central-directory records (torch opens its writer in zip64 mode).

Pure Python (no torch): ``struct`` and ``zlib``.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from jaxmoe.port.io.dcp_io import DTYPES, STORAGES, contiguous_strides

ALIGN = 64
_U32 = 0xFFFFFFFF
_STORAGE_OF = {np.dtype(DTYPES[name]): storage for storage, name in STORAGES.items()}
_FIXED = (("data.pkl", None), (".format_version", b"1"), (".storage_alignment", b"64"),
          ("byteorder", b"little"), ("data/0", None), ("version", b"3\n"),
          (".data/serialization_id", None))
_SERIAL_DIGITS = 40


def storage_name(dtype) -> str:
    """torch's typed-storage class name for a numpy dtype (``FloatStorage``, ``BFloat16Storage``)."""
    dt = np.dtype(dtype)
    if dt not in _STORAGE_OF:
        raise ValueError(f"no torch storage for dtype {dt}")
    return _STORAGE_OF[dt]


def _int(n: int) -> bytes:
    """A non-negative int as pickle protocol 2 writes it."""
    if n < 256:
        return b"K" + bytes([n])
    if n < 65536:
        return b"M" + struct.pack("<H", n)
    if n < 2**31:
        return b"J" + struct.pack("<i", n)
    enc = n.to_bytes((n.bit_length() >> 3) + 1, "little", signed=True)
    return b"\x8a" + bytes([len(enc)]) + enc


class _Pickle:
    """Just the opcodes ``torch.save``'s pickler emits for one plain tensor (protocol 2)."""

    def __init__(self):
        self.out, self.memo = [b"\x80\x02"], 0

    def put(self) -> None:
        i, self.memo = self.memo, self.memo + 1
        self.out.append(b"q" + bytes([i]) if i < 256 else b"r" + struct.pack("<I", i))

    def glob(self, module: str, name: str) -> None:
        self.out.append(f"c{module}\n{name}\n".encode())
        self.put()

    def text(self, s: str) -> None:
        raw = s.encode()
        self.out.append(b"X" + struct.pack("<I", len(raw)) + raw)
        self.put()

    def ints(self, values) -> None:
        """A tuple of ints (memoised like every non-empty tuple; ``()`` is not)."""
        values = [int(v) for v in values]
        if not values:
            self.out.append(b")")
            return
        if len(values) > 3:
            self.out.append(b"(")
        self.out += [_int(v) for v in values]
        self.out.append({1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(values), b"t"))
        self.put()


def tensor_pickle(dtype, shape) -> bytes:
    """``data.pkl`` of ``torch.save`` for a C-contiguous CPU tensor of ``dtype`` and ``shape``
    whose storage is record ``data/0``: ``_rebuild_tensor_v2(storage, 0, size, stride, False,
    OrderedDict())``."""
    shape = tuple(int(n) for n in shape)
    p = _Pickle()
    p.glob("torch._utils", "_rebuild_tensor_v2")
    p.out.append(b"((")  # the call's args; the persistent id's tuple
    p.text("storage")
    p.out.append(f"ctorch\n{storage_name(dtype)}\n".encode())
    p.put()
    p.text("0")
    p.text("cpu")
    p.out += [_int(int(np.prod(shape, dtype=np.int64))), b"t"]
    p.put()
    p.out += [b"Q", _int(0)]
    p.ints(shape)
    p.ints(contiguous_strides(shape))
    p.out.append(b"\x89")  # requires_grad False
    p.glob("collections", "OrderedDict")
    p.out.append(b")R")
    p.put()
    p.out.append(b"t")
    p.put()
    p.out.append(b"R")
    p.put()
    p.out.append(b".")
    return b"".join(p.out)


def _zip64_extra(size: int | None, ofs: int | None, local: bool = False) -> bytes:
    """The zip64 extended-information field: uncompressed and compressed size (a local
    header's compressed size is 0: it is in the data descriptor), local header offset."""
    fields = [v for v in (size, None if size is None else 0 if local else size, ofs) if v is not None]
    return b"" if not fields else struct.pack("<HH", 1, 8 * len(fields)) + b"".join(
        struct.pack("<Q", v) for v in fields)


class _Record:
    def __init__(self, name: str, size: int, ofs: int, content: bytes | None):
        self.name, self.size, self.ofs, self.content = name.encode(), size, ofs, content
        big, far = size >= _U32, ofs >= _U32
        self.zip64 = _zip64_extra(size if big else None, ofs if far else None, local=True)
        start = ofs + 30 + len(self.name) + len(self.zip64)
        pad = (-(start + 4)) % ALIGN
        # an empty record has no data descriptor (flags 0x0800: UTF-8 only), as miniz writes it
        self.flags = 0x0808 if size else 0x0800
        self.header = (struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, self.flags, 0, 0, 0, 0, 0, 0,
                                   len(self.name), len(self.zip64) + 4 + pad)
                       + self.name + self.zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad)
        self.data = ofs + len(self.header)
        self.desc_len = 0 if not size else 24 if self.zip64 else 16
        self.end = self.data + size + self.desc_len
        self.crc = zlib.crc32(content) if content is not None else None

    def descriptor(self) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", 0x08074B50, self.crc, self.size, self.size)
        return struct.pack("<IIII", 0x08074B50, self.crc, self.size, self.size)

    def central(self) -> bytes:
        big, far = self.size >= _U32, self.ofs >= _U32
        extra = _zip64_extra(self.size if big else None, self.ofs if far else None)
        size32 = _U32 if big else self.size
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, self.flags, 0, 0, 0, self.crc, size32,
                           size32, len(self.name), len(extra), 0, 0, 0, 0,
                           _U32 if far else self.ofs) + self.name + extra


class TensorZip:
    """The ``torch.save`` zip of one C-contiguous tensor of ``dtype`` and ``shape``: ``head``
    (bytes ``[0, data_offset)``), the storage bytes (``nbytes`` at ``data_offset``), then
    :meth:`tail` (``tail_len`` bytes); ``length`` in all. Offsets are from the zip's start."""

    def __init__(self, dtype, shape, prefix: str = "archive"):
        dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        pkl = tensor_pickle(dtype, shape)
        self.records, pos = [], 0
        for name, content in _FIXED:
            if name == "data.pkl":
                content = pkl
            size = (self.nbytes if name == "data/0" else _SERIAL_DIGITS if content is None
                    else len(content))
            rec = _Record(f"{prefix}/{name}", size, pos, content)
            self.records.append(rec)
            pos = rec.end
        self._data = self.records[4]
        self.data_offset = self._data.data
        before = b"".join(r.header + r.content + r.descriptor() for r in self.records[:4])
        self.head = before + self._data.header
        self.cd_offset = pos
        self.tail_len = len(self.tail(0, serial=b"0" * _SERIAL_DIGITS))
        self.length = self.data_offset + self.nbytes + self.tail_len

    def tail(self, crc: int, serial: bytes | None = None) -> bytes:
        """Everything after the storage bytes, given their CRC-32 (``serial``: the 40-digit
        serialization id, random by default)."""
        data, version, sid = self._data, self.records[5], self.records[6]
        data.crc = crc & _U32
        if serial is None:
            serial = str(int.from_bytes(os.urandom(17), "little") % 10**_SERIAL_DIGITS).zfill(
                _SERIAL_DIGITS).encode()
        sid.content, sid.crc = serial, zlib.crc32(serial)
        out = [data.descriptor()]
        out += [r.header + r.content + r.descriptor() for r in (version, sid)]
        cd = b"".join(r.central() for r in self.records)
        n, cd_ofs = len(self.records), self.cd_offset
        eocd64_at = cd_ofs + len(cd)
        out += [cd,
                struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cd_ofs),
                struct.pack("<IIQI", 0x07064B50, 0, eocd64_at, 1),
                struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, min(len(cd), _U32), min(cd_ofs, _U32), 0)]
        return b"".join(out)


_CRC_POLY = 0xEDB88320  # CRC-32 (zip, zlib), bit-reflected


def _gf2_mul(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, in the reflected bit order CRC-32 uses (bit 31 is
    x^0)."""
    out, m = 0, 1 << 31
    while a:
        if a & m:
            out ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (what zlib's C
    ``crc32_combine`` computes; Python's ``zlib`` does not expose it): ``crc1`` times
    ``x^(8 len2)`` modulo the polynomial, plus ``crc2``. Lets byte ranges copied in pieces, in
    any order, be checksummed while each is still in the page cache."""
    power, sq = 1 << 31, 1 << 30  # x^0, then x^(2^k) for k = 0, 1, ...: squared each bit
    n = 8 * int(len2)
    while n:
        if n & 1:
            power = _gf2_mul(sq, power)
        sq = _gf2_mul(sq, sq)
        n >>= 1
    return _gf2_mul(power, crc1) ^ crc2


__all__ = ["ALIGN", "TensorZip", "crc32_combine", "storage_name", "tensor_pickle"]
