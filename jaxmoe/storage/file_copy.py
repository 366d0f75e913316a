"""Copying byte ranges between files: inside the kernel where it can (``copy_file_range``), each
piece flushed and dropped behind (:mod:`jaxmoe.storage.page_cache`), optionally with the CRC-32 of
what was written (the ``dcp:`` sink's zip entries), and a range's CRC-32 read from a file.

Used by :func:`jaxmoe.port.commands.convert.convert` for tensors whose bytes are the same on both sides
(``hf:`` <-> ``torch:`` <-> ``dcp:`` in the same dtype and orientation).
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

from jaxmoe.errors import UserError
from jaxmoe.storage import page_cache

COPY_BLOCK = page_cache.PIECE


_local = threading.local()  # per thread: one reused read buffer for crc32_of


def crc32_of(fd: int, offset: int, nbytes: int, crc: int = 0, block: int = 8 * 2**20) -> int:
    """CRC-32 (continuing ``crc``) of ``nbytes`` of ``fd`` at ``offset``, read through this
    thread's reused buffer (``preadv``: no allocation per piece, so RSS stays flat); the pages
    are dropped as they are read (:func:`jaxmoe.storage.page_cache.drop`: clean ones go, dirty
    ones just written start their writeback)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < block:
        buf = _local.buf = memoryview(bytearray(block))
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [buf[:min(block, nbytes - done)]], offset + done)
        if n <= 0:
            raise OSError(f"short read at {offset + done}")
        crc = zlib.crc32(buf[:n], crc)
        page_cache.drop(fd, offset + done, n)
        done += n
    return crc


def copy_bytes(src: Path, src_offset: int, dst: Path, dst_offset: int, nbytes: int,
               checksum: bool = False, behind: page_cache.FileBehind | None = None) -> int | None:
    """Copy ``nbytes`` from ``src`` at ``src_offset`` to the existing (pre-sized) ``dst`` at
    ``dst_offset``, inside the kernel (``copy_file_range``: no copy through this process's
    memory), or through one buffer where the file system cannot; :data:`COPY_BLOCK` at a time,
    each piece flushed and dropped behind the next and its source pages dropped
    (:mod:`jaxmoe.storage.page_cache`). With ``checksum``, returns the CRC-32 of the bytes as
    written, each piece read back before it leaves the page cache (else None). ``behind``: the
    destination's :class:`~jaxmoe.storage.page_cache.FileBehind`, shared by the copies into it
    (the caller closes it), instead of waiting for this copy's last piece here."""
    crc = 0
    fin = os.open(src, os.O_RDONLY)
    try:
        fout = os.open(dst, os.O_RDWR if checksum else os.O_WRONLY)
        try:
            wb = behind if behind is not None else page_cache.WriteBehind(fout)
            done, kernel = 0, True
            while done < nbytes:
                want = min(nbytes - done, COPY_BLOCK)
                n = 0
                if kernel:
                    try:
                        n = os.copy_file_range(fin, fout, want, src_offset + done, dst_offset + done)
                    except OSError:  # EXDEV, ENOSYS, EINVAL (e.g. across file systems)
                        n = 0
                    kernel = n > 0
                if n <= 0:  # fallback (or a short source: caught here)
                    chunk = os.pread(fin, want, src_offset + done)
                    if not chunk:
                        raise UserError(f"{src}: truncated ({nbytes} bytes wanted at {src_offset})")
                    page_cache.pwrite_all(fout, chunk, dst_offset + done)
                    n = len(chunk)
                page_cache.drop(fin, src_offset + done, n)
                if checksum:
                    crc = crc32_of(fout, dst_offset + done, n, crc)
                wb.wrote(dst_offset + done, n)
                done += n
            if behind is None:
                wb.close()
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    return crc if checksum else None


def fsync_path(path: Path) -> None:
    """fsync one file or folder (a folder: its entries, e.g. a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["COPY_BLOCK", "copy_bytes", "crc32_of", "fsync_path"]
