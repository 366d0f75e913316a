"""A conversion's page-cache footprint, kept to a few pieces: written bytes are flushed and
dropped behind the writer, read bytes are dropped once used.

Why. A conversion streams the whole model through the page cache twice (the source read in,
the destination written out): 3.8 TB for the seed's 1.9 TB checkpoint. Left to the kernel, every
byte takes a *fresh* page: the written pages stay dirty until writeback, then clean until
evicted, so the cache grows by the bytes moved and evicts everything else on the node (on a
shared machine: other jobs' files). On a VM whose free memory goes back to the host (free-page
reporting / ballooning, as on this project's CI and dev machines) a fresh page is far dearer
than the disk: touching fresh memory, and so a buffered write + ``fsync`` after a pause, ran
an order of magnitude below ``O_DIRECT`` writes. Writing in 64 MiB pieces, each flushed and
dropped behind the writer, recycles the same few pages and runs near the disk's speed
(docs/MEASUREMENTS.md, "Conversion").

How. :class:`WriteBehind` starts each written piece's writeback at once
(``sync_file_range(WRITE)``) and, one piece later, waits for it and drops it
(``POSIX_FADV_DONTNEED`` drops clean pages only, hence the wait): the disk writes piece ``i``
while the caller produces piece ``i + 1``. Reads drop the range they consumed (:func:`drop`).
TensorStore's own files (Orbax) are dropped by directory (:func:`drop_tree`).

``JAXMOE_KEEP_PAGE_CACHE=1`` turns all of this off (writes then only start their writeback, the
behaviour before; for A/B runs in ``bench/convert.py``). Not Linux: nothing happens, the final
``fsync`` still makes the files durable.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import os
import threading
from pathlib import Path

PIECE = 64 * 2**20  # bytes written / copied between two flushes

_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not glibc / not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def has_sync_file_range() -> bool:
    """Whether writeback is started and waited for per range (else ``fdatasync`` of the file)."""
    return _sync_file_range is not None


def bounded() -> bool:
    """Whether pages are flushed and dropped (not opted out with ``JAXMOE_KEEP_PAGE_CACHE``)."""
    return os.environ.get("JAXMOE_KEEP_PAGE_CACHE", "") in ("", "0")


FOLIO = 2 * 2**20  # the page cache holds a file in folios of up to this size


def drop(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Drop the clean cached pages of ``[offset, offset + nbytes)`` of ``fd`` (0: to the end);
    dirty pages stay (their writeback is started). A hint: errors are ignored.

    The kernel drops only folios that lie wholly inside the range, so a folio straddling two
    ranges dropped one after the other would stay (measured: a 4 MiB range at a 4 KiB offset
    dropped 2 MiB). So the range is moved to :data:`FOLIO` boundaries: its start down (the
    folio it starts in was begun by the range before, in a sequential pass), its end down too
    (the folio it ends in is finished by the next range), except at the end of the file."""
    if not bounded():
        return
    if nbytes:
        end = offset + nbytes
        try:
            at_eof = end >= os.fstat(fd).st_size
        except OSError:
            at_eof = False
        end = end if at_eof else end // FOLIO * FOLIO
        offset = offset // FOLIO * FOLIO
        if end <= offset:
            return
        nbytes = end - offset
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def drop_path(path, offset: int = 0, nbytes: int = 0) -> None:
    """:func:`drop` for a file by name (a file that cannot be opened is skipped)."""
    if not bounded():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        drop(fd, offset, nbytes)
    finally:
        os.close(fd)


def start(fd: int, offset: int, nbytes: int) -> None:
    """Start writing back ``[offset, offset + nbytes)`` of ``fd`` now, without waiting."""
    if _sync_file_range is not None and bounded():
        if _sync_file_range(fd, offset, nbytes, _SYNC_WRITE) == 0:
            return
    try:  # DONTNEED on dirty pages queues their writeback (and drops what is already clean)
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def settle(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Write ``[offset, offset + nbytes)`` of ``fd`` (0: to the end) to disk, wait for it, and
    drop its pages. Data only: the file's size and metadata wait for the final ``fsync``."""
    if not bounded():
        return
    if _sync_file_range is None or _sync_file_range(
            fd, offset, nbytes, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) != 0:
        try:
            os.fdatasync(fd)
        except OSError:
            return
    drop(fd, offset, nbytes)


class WriteBehind:
    """Flush-and-drop behind one writer of one file: call :meth:`wrote` after each piece written
    (any order of ranges), :meth:`close` after the last. At most ``depth + 1`` pieces are in the
    cache."""

    def __init__(self, fd: int, depth: int = 1):
        self.fd = fd
        self.depth = depth  # pieces left in writeback before the oldest is waited for (3: no
        # faster in orbax -> hf, docs/history/MEASUREMENTS-2026-12.md, "Conversion: the page cache")
        self._pending: list[tuple[int, int]] = []

    def wrote(self, offset: int, nbytes: int) -> None:
        start(self.fd, offset, nbytes)
        self._pending.append((offset, nbytes))
        while len(self._pending) > self.depth:
            settle(self.fd, *self._pending.pop(0))

    def close(self) -> None:
        while self._pending:
            settle(self.fd, *self._pending.pop(0))


class FileBehind:
    """Flush-and-drop behind any number of writers of one file (threads; ranges in any order):
    like :class:`WriteBehind`, but a range is waited for only once more than ``window`` bytes
    are in writeback after it, so ranges far smaller than a piece (one expert's 2 MiB copied
    by :func:`jaxmoe.storage.file_copy.copy_bytes`) do not each wait for the disk."""

    def __init__(self, path, window: int = 2 * PIECE):
        self.fd = os.open(path, os.O_WRONLY)
        self.window = int(window)
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._bytes = 0

    def wrote(self, offset: int, nbytes: int) -> None:
        start(self.fd, offset, nbytes)
        with self._lock:
            self._pending.append((offset, nbytes))
            self._bytes += nbytes
            while self._bytes > self.window:
                at, n = self._pending.popleft()
                self._bytes -= n
                settle(self.fd, at, n)
                # ranges from two threads settle out of offset order, and a range's last
                # folio is dropped only with the next range (drop's folio rounding): drop
                # everything before this range's end again, which catches such a folio
                drop(self.fd, 0, at + n)

    def close(self) -> None:
        """Write back and drop everything of the file (waits for the writeback)."""
        with self._lock:
            self._pending.clear()
            self._bytes = 0
            settle(self.fd)
        os.close(self.fd)


def pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` (bytes or a buffer) is written at ``offset``."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:done + 2**30], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at {offset + done}")
        done += n


def pwrite_behind(fd: int, data, offset: int, piece: int = PIECE) -> None:
    """``os.pwrite`` every byte of ``data`` (bytes or a buffer) at ``offset``, in ``piece``-byte
    pieces, each flushed and dropped behind the next (:class:`WriteBehind`)."""
    view = memoryview(data).cast("B")
    wb = WriteBehind(fd)
    done = 0
    while done < len(view):
        end = min(done + piece, len(view))
        pwrite_all(fd, view[done:end], offset + done)
        wb.wrote(offset + done, end - done)
        done = end
    wb.close()


def drop_tree(root) -> None:
    """Flush and drop the cached pages of every file under ``root`` (files another writer,
    e.g. TensorStore, wrote: their writeback is waited for, then their pages dropped)."""
    if not bounded():
        return
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                settle(fd)
            finally:
                os.close(fd)


def file_mapping(arr):
    """``(mmap or None, position in it, file, file offset, nbytes)`` of the bytes under ``arr``
    when it is (a view of) an ``np.memmap`` of a file, else None."""
    import mmap

    import numpy as np

    if not isinstance(arr, np.ndarray) or arr.size == 0:
        return None
    node, name, base = arr, None, None
    while node is not None:  # through views, and as_strided's wrapper (not an ndarray)
        if isinstance(node, np.ndarray):
            name = name or getattr(node, "filename", None)
            if isinstance(node.base, mmap.mmap):
                base = node
                break
        node = getattr(node, "base", None)
    if base is None:
        return None
    if name is None or not isinstance(getattr(base, "offset", None), int):
        return None
    bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds  # numpy 1 / 2
    lo, hi = bounds(arr)
    into = lo - bounds(base)[0]  # from the memmap's first byte
    # np.memmap maps from its offset rounded down to ALLOCATIONGRANULARITY
    pos = int(base.offset) % mmap.ALLOCATIONGRANULARITY + into
    # a copy-on-write map ("c") may hold changes only in this process: never unmapped here
    mm = base.base if getattr(base, "mode", None) != "c" else None
    return mm, pos, str(name), int(base.offset) + into, hi - lo


def file_range(arr) -> tuple[str, int, int] | None:
    """(file, offset, nbytes) of the bytes under ``arr`` when it is (a view of) an ``np.memmap``
    read from a file, else None."""
    m = file_mapping(arr)
    return None if m is None else m[2:]


def drop_view(arr) -> None:
    """Drop the file pages under ``arr`` (a view of an ``np.memmap`` source, once its values are
    used: copied into a chunk, written elsewhere); anything else: nothing to do.

    The pages are first unmapped from this process (``MADV_DONTNEED`` on the map: the kernel
    does not drop a cached page that a process maps, so a hint alone left every page read
    through a map in the cache), then dropped from the cache (:func:`drop_path`)."""
    import mmap

    if not bounded():
        return
    m = file_mapping(arr)
    if m is None:
        return
    mm, pos, name, at, nbytes = m
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        start = pos // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, pos + nbytes - start)
        except (OSError, ValueError):  # a closed map: nothing of it is mapped any more
            pass
    drop_path(name, at, nbytes)


class TreeDropper:
    """Call :meth:`moved` with the bytes moved through files under ``root`` by another writer or
    reader (TensorStore); every ``every`` bytes the tree's pages are flushed and dropped."""

    def __init__(self, root, every: int = PIECE):
        self.root, self.every, self._since = Path(root), int(every), 0

    def moved(self, nbytes: int) -> None:
        self._since += int(nbytes)
        if self._since >= self.every:
            self._since = 0
            drop_tree(self.root)


__all__ = ["FOLIO", "PIECE", "FileBehind", "file_mapping", "TreeDropper", "WriteBehind", "bounded", "drop", "drop_path",
           "drop_tree", "drop_view", "file_range", "has_sync_file_range", "pwrite_all", "pwrite_behind", "settle",
           "start"]
