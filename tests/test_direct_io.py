"""jaxmoe.storage.direct_io: ranges written around the page cache, byte for byte, with fallbacks.

Residency is read with support.resident (mincore); each residency check sits next to a control
(the same bytes written plainly stay cached).
"""

from __future__ import annotations

import errno
import os
import sys
import threading

import numpy as np
import pytest
from support import resident

from jaxmoe.storage import direct_io
from jaxmoe.storage.direct_io import ALIGN, DirectWriter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux O_DIRECT")

KiB, MiB = 2**10, 2**20


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.delenv("JAXMOE_KEEP_PAGE_CACHE", raising=False)


def sized(path, nbytes: int):
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


def direct_works(path) -> bool:
    fd = direct_io._open_direct(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def ranges_table(size: int, rng) -> list[tuple[int, int]]:
    """Cut ``[0, size)`` into ranges of every kind: shorter than a block, inside one block,
    exactly aligned, unaligned at either end, several pieces long; in a random order."""
    cuts = [0, 1, 7, ALIGN - 1, ALIGN, 3 * ALIGN, 3 * ALIGN + 5, 5 * ALIGN - 3, 64 * KiB,
            64 * KiB + 1, 200 * KiB + 17, 1 * MiB, 1 * MiB + 3 * ALIGN, 2 * MiB - 11]
    cuts += sorted(int(x) for x in rng.integers(2 * MiB, size, 12))
    cuts = sorted(set(c for c in cuts if c < size)) + [size]
    out = list(zip(cuts[:-1], cuts[1:]))
    rng.shuffle(out)
    return out


def test_ranges_in_any_order_from_two_threads_are_byte_exact(tmp_path):
    size = 4 * MiB + 123
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    path = sized(tmp_path / "out.bin", size)
    ranges = ranges_table(size, np.random.default_rng(1))
    with DirectWriter(path, depth=2, piece=64 * KiB) as w:  # small pieces: buffers reused
        def worker(part):
            for lo, hi in part:
                w.pwrite(data[lo:hi], lo)
        threads = [threading.Thread(target=worker, args=(ranges[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w.flush()
        direct, nbytes = w.direct, w.direct_bytes
    assert path.read_bytes() == data.tobytes()
    if direct_works(path):
        assert direct and nbytes > size // 2


def test_writes_leave_nothing_cached_and_the_plain_control_stays(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, 24 * MiB, dtype=np.uint8)
    path = sized(tmp_path / "out.bin", 24 * MiB + 100)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    with DirectWriter(path) as w:
        w.pwrite(data, 100)  # unaligned: one partial block at each end goes through the cache
    assert resident(path) <= 2 * ALIGN
    plain = sized(tmp_path / "plain.bin", 24 * MiB + 100)
    with open(plain, "r+b") as f:
        f.seek(100)
        f.write(data.tobytes())
    assert resident(plain) >= 20 * MiB
    with open(path, "rb") as f:
        f.seek(100)
        assert f.read() == data.tobytes()


def test_the_callers_array_is_free_once_pwrite_returns(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 * MiB, dtype=np.uint8)
    want = data.tobytes()
    path = sized(tmp_path / "out.bin", 3 * MiB)
    with DirectWriter(path, piece=256 * KiB) as w:
        w.pwrite(data, 0)
        data[:] = 0  # the writer thread may still be writing: from its own copy
    assert path.read_bytes() == want


@pytest.mark.parametrize("how", ["no O_DIRECT", "opted out"])
def test_fallbacks_write_the_same_bytes_through_the_page_cache(tmp_path, monkeypatch, how):
    if how == "no O_DIRECT":
        monkeypatch.setattr(direct_io, "_open_direct", lambda path: None)
    else:
        monkeypatch.setenv("JAXMOE_KEEP_PAGE_CACHE", "1")
    size = 3 * MiB + 5
    data = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
    path = sized(tmp_path / "out.bin", size)
    with DirectWriter(path, piece=64 * KiB) as w:
        for lo, hi in ranges_table(size, np.random.default_rng(5)):
            w.pwrite(data[lo:hi], lo)
        assert not w.direct and w.direct_bytes == 0
    assert path.read_bytes() == data.tobytes()


def _failing_direct_pwrite(monkeypatch, w: DirectWriter, err: int):
    real = os.pwrite

    def pwrite(fd, buf, offset):
        if fd == w.dfd:
            raise OSError(err, os.strerror(err))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)


def test_a_refused_direct_write_goes_through_the_page_cache(tmp_path, monkeypatch):
    data = np.random.default_rng(6).integers(0, 256, 2 * MiB, dtype=np.uint8)
    path = sized(tmp_path / "out.bin", 2 * MiB)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    w = DirectWriter(path, piece=256 * KiB)
    _failing_direct_pwrite(monkeypatch, w, errno.EINVAL)
    w.pwrite(data, 0)
    w.close()
    assert not w.direct
    assert path.read_bytes() == data.tobytes()


def test_a_failed_write_is_raised_at_close(tmp_path, monkeypatch):
    path = sized(tmp_path / "out.bin", 2 * MiB)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    w = DirectWriter(path, piece=256 * KiB)
    _failing_direct_pwrite(monkeypatch, w, errno.ENOSPC)
    w.pwrite(np.ones(2 * MiB, np.uint8), 0)
    with pytest.raises(OSError) as info:
        w.close()
    assert info.value.errno == errno.ENOSPC


def _mapped(tmp_path, shape, dtype=np.float32, offset=0, seed=7):
    """A file holding an array of ``shape`` at ``offset`` (not block-aligned unless 0), synced
    and dropped from the cache, and a read-only map of it."""
    from jaxmoe.storage import page_cache

    a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    path = tmp_path / f"m{seed}.bin"
    with open(path, "wb") as f:
        f.write(b"\x01" * offset + a.tobytes() + b"\x02" * 333)
        f.flush()
        os.fsync(f.fileno())
    page_cache.drop_path(path)
    return a, path, np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def test_read_view_and_read_copy_equal_the_map_and_leave_nothing_cached(tmp_path):
    a, path, m = _mapped(tmp_path, (16, 64, 48), offset=100)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    views = [m, m[3], m[5:9], np.swapaxes(m[2:4], -1, -2), m[7, 10:20], m[::-1][3], m[15][-1]]
    wants = [a, a[3], a[5:9], np.swapaxes(a[2:4], -1, -2), a[7, 10:20], a[::-1][3], a[15][-1]]
    for v, want in zip(views, wants):
        got = direct_io.read_view(v)
        assert not isinstance(got, np.memmap) and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(direct_io.read_copy(v), want)
    assert resident(path) == 0
    np.asarray(m[5:9]).copy()  # the control: read through the map, the pages stay
    assert resident(path) >= 48 * KiB


def test_read_copy_is_the_callers_and_read_view_is_reused(tmp_path):
    a, path, m = _mapped(tmp_path, (8, 1024), offset=4096)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    kept = direct_io.read_copy(m[1])
    view = direct_io.read_view(m[2])
    direct_io.read_view(m[3])  # the same thread's buffer: view now shows row 3
    np.testing.assert_array_equal(view, a[3])
    direct_io.read_copy(m[4])
    np.testing.assert_array_equal(kept, a[1])


def test_reads_fall_back_to_the_map_where_direct_is_not_possible(tmp_path, monkeypatch):
    a, path, m = _mapped(tmp_path, (4, 256))
    monkeypatch.setenv("JAXMOE_KEEP_PAGE_CACHE", "1")
    assert isinstance(direct_io.read_view(m[1]), np.memmap) and isinstance(direct_io.read_copy(m[1]), np.memmap)
    plain = np.arange(6.0)
    assert direct_io.read_view(plain) is plain  # not a map: as it is


def test_buffers_are_reused_only_once_nothing_refers_to_them():
    pool = direct_io.Buffers(keep=2)
    x = pool.take(10_000)
    assert x.ctypes.data % ALIGN == 0
    y = pool.take(10_000)
    assert not np.shares_memory(x, y)  # x alive
    part = x[100:200]
    del x
    z = pool.take(10_000)
    assert not np.shares_memory(part, z)  # a view of it alive: still taken
    del part, z
    w = pool.take(5_000)  # x's and z's buffers are free again: one of them comes back
    assert len(pool._raw) == 2 and any(np.shares_memory(w, r) for r in pool._raw)


def test_read_ahead_reads_each_block_once_and_the_next_meanwhile(tmp_path, monkeypatch):
    a, path, m = _mapped(tmp_path, (6, 32, 64), offset=64)
    reads = []
    real = direct_io.read_copy
    monkeypatch.setattr(direct_io, "read_copy", lambda v, b=None: reads.append(v.shape) or real(v, b))
    ra = direct_io.ReadAhead()
    try:
        blocks = [(i, m[i:i + 2]) for i in range(0, 6, 2)]
        for k, (start, view) in enumerate(blocks):
            then = blocks[k + 1] if k + 1 < len(blocks) else None
            for _ in range(3):  # asked again: the kept block, no new read
                got = ra.rows(start, view, then)
            np.testing.assert_array_equal(got, a[start:start + 2])
        assert len(reads) == 3
        got = ra.rows("other", m[1:2], None)  # out of order: read now, the read-ahead dropped
        np.testing.assert_array_equal(got, a[1:2])
    finally:
        ra.close()


def test_read_copies_reads_tensors_apart_into_one_buffer_and_nothing_cached(tmp_path):
    """Several maps at unaligned offsets of one file (an HF file's experts, gate / up / down
    interleaved), each read into its own page-aligned slot of one buffer: every copy equals its
    map, the slots do not overlap, nothing is cached; a view that is not a map comes back as is."""
    a, path, m = _mapped(tmp_path, (9, 33, 40), offset=100)
    if not direct_works(path):
        pytest.skip("this file system refuses O_DIRECT")
    pool = direct_io.Buffers(keep=2)
    plain = np.arange(5.0)
    got = direct_io.read_copies([m[0], m[3], m[6], plain, m[8, 1:5]], pool)
    for g, want in zip(got, [a[0], a[3], a[6], plain, a[8, 1:5]]):
        np.testing.assert_array_equal(g, want)
    assert got[3] is plain and not any(isinstance(g, np.memmap) for g in got)
    for i, x in enumerate(got[:3]):
        assert not any(np.shares_memory(x, y) for y in got[i + 1:])
    assert resident(path) == 0
    kept = got[1].copy()
    again = direct_io.read_copies([m[1], m[2]], pool)  # got's buffer is alive: a new one
    np.testing.assert_array_equal(got[1], kept)
    np.testing.assert_array_equal(again[0], a[1])
