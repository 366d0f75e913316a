"""Reads and writes that bypass the page cache (``O_DIRECT``), overlapped with the caller.

Why. A buffered write copies every byte into a page-cache folio. On a VM whose free memory goes
back to the host, those folios are fresh pages, and the copy into them is slower than the disk:
in a ``perf`` profile of ``jaxmoe convert --from orbax: --to dcp:`` it was the largest share of
the route's time (``copy_folio_from_iter_atomic`` under ``pwrite``). :mod:`page_cache`
recycles a few folios by flushing behind the writer, which helps only while the freed folios are
reused before the host takes them back. An ``O_DIRECT`` write moves the bytes from this
process's own buffer to the disk, and that buffer is the same few warm pages for the whole
conversion (docs/MEASUREMENTS.md, "Conversion: direct I/O").

Reads likewise: :func:`read_view` / :func:`read_copy` read what a map view covers in one
``O_DIRECT`` request, and :class:`ReadAhead` reads blocks of rows with the next block read ahead.

How. :class:`DirectWriter` writes ranges of one file. Each range's whole aligned blocks
(:data:`ALIGN`) are copied into one of ``depth`` reused, page-aligned staging buffers of
:data:`PIECE` bytes and written from there with ``O_DIRECT`` on a writer thread, while the
caller copies the next piece (``np.copyto`` and ``os.pwrite`` both release the GIL). The partial
blocks at either end of a range (< 4 KiB each) go through the page cache as usual: two ranges
written one after another may share a block, and only the page cache merges such writes. The two
never overlap: a direct write covers only blocks that lie wholly inside its range. The caller's
array is free again as soon as :meth:`~DirectWriter.pwrite` returns; errors of the thread are
raised at the next call or at :meth:`~DirectWriter.close`, which waits for every write.

Fallbacks. A file system without ``O_DIRECT`` (``tmpfs``: ``EINVAL`` at open), one that refuses a
direct write (``EINVAL``: the rest goes through the page cache), non-Linux, and
``JAXMOE_KEEP_PAGE_CACHE=1`` write through the page cache with :func:`page_cache.pwrite_behind`.
Durability is unchanged: the caller ``fsync``s every file at the end.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import sys
import threading
import traceback

import numpy as np

from jaxmoe.storage import page_cache

ALIGN = 4096  # file offsets, lengths and buffer addresses of direct writes (>= the logical block)
PIECE = 8 * 2**20  # bytes per direct write (2-64 MiB measured alike; less staging memory)


def _open_direct(path) -> int | None:
    """A write-only ``O_DIRECT`` descriptor of ``path``, or None where direct I/O is not to be
    used (opted out, not Linux, the file system refuses it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not page_cache.bounded():
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


class DirectWriter:
    """Write byte ranges of the existing file ``path`` (any order, not overlapping), the whole
    blocks of each with ``O_DIRECT`` from a few reused staging buffers on a writer thread (see
    the module doc). Use as a context manager or call :meth:`close`."""

    def __init__(self, path, depth: int = 2, piece: int = PIECE):
        self.path = str(path)
        self.piece = max(ALIGN, int(piece) // ALIGN * ALIGN)
        self.depth = max(1, int(depth))
        self.fd = os.open(self.path, os.O_WRONLY)  # the partial blocks at the ends of a range
        self.dfd = _open_direct(self.path)
        self._buffers: list[mmap.mmap] = []
        self._free: queue.Queue = queue.Queue()
        self._todo: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # pwrite from several threads: one staging at a time
        self._idle = threading.Condition()
        self._queued = 0  # pieces queued and not yet written
        self.direct_bytes = 0  # bytes written with O_DIRECT (tests)

    @property
    def direct(self) -> bool:
        """Whether whole blocks go around the page cache (False: the fallback)."""
        return self.dfd is not None

    def pwrite(self, data, offset: int) -> None:
        """Write every byte of ``data`` (bytes or a C-contiguous buffer) at ``offset``."""
        view = memoryview(data).cast("B")
        self._raise()
        if self.dfd is None:
            page_cache.pwrite_behind(self.fd, view, offset)
            return
        end = offset + len(view)
        lo, hi = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if hi <= lo:  # no whole block inside: all through the page cache
            page_cache.pwrite_all(self.fd, view, offset)
            return
        page_cache.pwrite_all(self.fd, view[:lo - offset], offset)
        page_cache.pwrite_all(self.fd, view[hi - offset:], hi)
        src = np.frombuffer(view, np.uint8)
        with self._lock:
            for at in range(lo, hi, self.piece):
                n = min(self.piece, hi - at)
                buf = self._buffer()
                np.copyto(np.frombuffer(buf, np.uint8, n), src[at - offset:at - offset + n])
                with self._idle:
                    self._queued += 1
                self._todo.put((buf, at, n))

    def _buffer(self) -> mmap.mmap:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxmoe-direct", daemon=True)
            self._thread.start()
        if len(self._buffers) < self.depth and self._free.empty():
            self._buffers.append(mmap.mmap(-1, self.piece))  # anonymous: page-aligned
            return self._buffers[-1]
        return self._free.get()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            buf, at, n = item
            try:
                if self._error is None:
                    self._write_piece(memoryview(buf)[:n], at)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                traceback.clear_frames(e.__traceback__)  # no view of a buffer kept alive
                self._error = e
            finally:
                self._free.put(buf)
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _write_piece(self, view, at: int) -> None:
        if self.dfd is not None:
            try:
                page_cache.pwrite_all(self.dfd, view, at)
                self.direct_bytes += len(view)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(self.dfd)  # the file system refuses direct writes here: page cache
                self.dfd = None
        page_cache.pwrite_all(self.fd, view, at)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def flush(self) -> None:
        """Wait until every range written so far is on its way to disk (direct writes done)."""
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)
        self._raise()

    def close(self) -> None:
        """Wait for the writes in flight, stop the thread, close the descriptors; the first
        error of a write is raised here."""
        try:
            if self._thread is not None:
                self._todo.put(None)
                self._thread.join()
                self._thread = None
        finally:
            for fd in (self.dfd, self.fd):
                if fd is not None:
                    os.close(fd)
            self.dfd = self.fd = None
            for b in self._buffers:
                b.close()
            self._buffers = []
        self._raise()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_local = threading.local()  # per thread: one reused, page-aligned read buffer


def _read_buffer(nbytes: int) -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = np.frombuffer(mmap.mmap(-1, max(nbytes, PIECE)), np.uint8)
    return buf


def _page_aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """The first page-aligned ``nbytes`` of ``raw`` (``nbytes + ALIGN`` long; numpy's own
    alignment is 64 bytes)."""
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + nbytes]


def _aligned(nbytes: int) -> np.ndarray:
    """A new page-aligned byte array of ``nbytes``."""
    return _page_aligned(np.empty(nbytes + ALIGN, np.uint8), nbytes)


class Buffers:
    """A few page-aligned read buffers, each handed out again once nothing refers to it any
    more (no view of it alive anywhere: a sink's writer thread may still hold one), so a
    source that reads tensor after tensor reuses the same warm pages instead of fresh memory
    per tensor (on a VM, fresh pages cost more than the disk: the module doc)."""

    def __init__(self, keep: int = 3):
        self.keep = int(keep)
        self._raw: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for raw in self._raw:
                # referenced by the list, ``raw`` and getrefcount's argument only: no view alive
                if sys.getrefcount(raw) <= 3 and raw.nbytes >= nbytes + ALIGN:
                    break
            else:
                raw = np.empty(nbytes + ALIGN, np.uint8)
                self._raw = ([raw] + self._raw)[:self.keep]
            return _page_aligned(raw, nbytes)


def _read_direct(arr, take):
    """``arr`` (a view of an ``np.memmap``) as the same view of a buffer (``take(nbytes)``, page
    aligned) read with O_DIRECT, or None where that cannot be done (not a map, opted out, the
    file system refuses)."""
    m = page_cache.file_mapping(arr)
    if m is None or not page_cache.bounded() or not getattr(os, "O_DIRECT", 0):
        return None
    _, _, name, at, nbytes = m
    lo, hi = at // ALIGN * ALIGN, -(-(at + nbytes) // ALIGN) * ALIGN
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    try:
        buf = take(hi - lo)
        done = 0
        while done < hi - lo:
            try:
                n = os.preadv(fd, [memoryview(buf[done:hi - lo])], lo + done)
            except OSError as e:
                if e.errno == errno.EINVAL:  # refused here: read through the map
                    return None
                raise
            if n <= 0:
                break  # the end of the file, inside the last block
            done += n
    finally:
        os.close(fd)
    if done < at + nbytes - lo:
        raise OSError(errno.EIO, f"{name}: short read at {lo + done}")
    bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds  # numpy 1 / 2
    first = arr.__array_interface__["data"][0] - bounds(arr)[0]  # element 0, from the lowest byte
    return np.ndarray(arr.shape, arr.dtype, buffer=buf, offset=at - lo + first, strides=arr.strides)


def read_view(arr):
    """``arr`` (a view of an ``np.memmap`` source, any strides) as the same view of this
    thread's reused buffer, its bytes read from the file with ``O_DIRECT``: one request, no
    page-cache pages, no page faults (a transposed copy out of a map faults the pages in one at
    a time, out of order). Valid until this thread's next call: copy out of it at once.
    Anything else, or where direct reads are not possible, comes back as it is."""
    out = _read_direct(arr, _read_buffer)
    return arr if out is None else out


def read_copy(arr, buffers: Buffers | None = None):
    """:func:`read_view` into an array of its own (the caller may keep it): a new one, or one of
    ``buffers`` that nothing refers to any more."""
    out = _read_direct(arr, buffers.take if buffers is not None else _aligned)
    return arr if out is None else out


def read_copies(arrs, buffers: Buffers | None = None) -> list:
    """:func:`read_copy` of several map views (tensors far apart in one file: an HF file's
    experts, gate / up / down interleaved) into one buffer, a page-aligned slot each, one request
    per view. A view that cannot be read directly comes back as it is."""
    spans = []
    for a in arrs:
        m = page_cache.file_mapping(a)
        at, nbytes = (m[3], m[4]) if m is not None else (0, 0)
        spans.append(-(-(at + nbytes) // ALIGN) * ALIGN - at // ALIGN * ALIGN)
    whole = buffers.take(sum(spans)) if buffers is not None else _aligned(sum(spans))
    out, lo = [], 0
    for a, n in zip(arrs, spans):
        got = _read_direct(a, lambda k, lo=lo: whole[lo:lo + k])
        out.append(a if got is None else got)
        lo += n
    return out


BLOCK = 16 * 2**20  # bytes of rows a ReadAhead reads in one request


class ReadAhead:
    """Blocks of rows of mapped tensors, each read in one ``O_DIRECT`` request into reused
    buffers (:class:`Buffers`), the next block read on a helper thread while this one is used.

    ``rows(key, view, then)``: the block ``key`` (``view``, a map's rows, or a list of maps read
    into one buffer by :func:`read_copies`; read now unless it is the block read ahead), kept
    until another key is asked for; ``then`` = ``(key, view)`` of
    the block wanted next. Small requests at one-in-flight run far below the disk's speed
    (docs/MEASUREMENTS.md, "Conversion"); a block plus one read ahead keeps the disk busy and
    memory at two blocks."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxmoe-read")
        self._buffers = Buffers(keep=4)
        self._cur = None  # (key, block)
        self._next = None  # (key, future)

    def _read(self, view):
        if isinstance(view, list):  # tensors apart in the file: a slot each
            return read_copies(view, self._buffers)
        return read_copy(view, self._buffers)

    def rows(self, key, view, then=None) -> np.ndarray:
        if self._cur is None or self._cur[0] != key:
            self._cur = None
            nxt, self._next = self._next, None
            block = nxt[1].result() if nxt is not None and nxt[0] == key else self._read(view)
            self._cur = (key, block)
            if then is not None:
                self._next = (then[0], self._pool.submit(self._read, then[1]))
        return self._cur[1]

    def close(self) -> None:
        self._cur = self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["ALIGN", "BLOCK", "PIECE", "Buffers", "DirectWriter", "ReadAhead", "read_copies", "read_copy",
           "read_view"]
