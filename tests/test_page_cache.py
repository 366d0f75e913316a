"""jaxmoe.storage.page_cache: what a conversion writes or reads does not stay in the page cache.

Residency is read with ``mincore`` on a read-only map of the file (mapping faults nothing in).
Each test also shows the check can fail: the same bytes written or read without the module stay
cached.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from support import resident

from jaxmoe.port.io.safetensors_io import SafetensorsReader, SafetensorsWriter
from jaxmoe.storage import page_cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache")

MiB = 2**20
PAGE = mmap.PAGESIZE


def cached_file(path: Path, nbytes: int, seed: int = 0) -> bytes:
    """A file of random bytes written the plain way and synced: its pages stay in the cache,
    clean (as a source's are: a hint drops clean pages only)."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.delenv("JAXMOE_KEEP_PAGE_CACHE", raising=False)


def test_sync_file_range_is_found():
    """Linux with glibc: writeback per range (a lost symbol would fall back to ``fdatasync`` of
    the whole file, silently and slower)."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert page_cache.has_sync_file_range()


def test_plain_writes_stay_cached(tmp_path):
    """The control for every test here: written bytes stay cached unless dropped."""
    cached_file(tmp_path / "a.bin", 24 * MiB)
    assert resident(tmp_path / "a.bin") >= 20 * MiB


def test_pwrite_behind_keeps_at_most_two_pieces(tmp_path, monkeypatch):
    data = np.random.default_rng(1).integers(0, 256, 48 * MiB, dtype=np.uint8)
    path = tmp_path / "out.bin"
    seen = []
    settle = page_cache.settle

    def spy(fd, offset=0, nbytes=0):
        settle(fd, offset, nbytes)
        seen.append(resident(path))

    monkeypatch.setattr(page_cache, "settle", spy)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        page_cache.pwrite_behind(fd, data, 0, piece=4 * MiB)
    finally:
        os.close(fd)
    assert path.read_bytes() == data.tobytes()
    assert len(seen) == 12  # one settle per 4 MiB piece
    assert max(seen) <= 8 * MiB, [s // MiB for s in seen]
    page_cache.drop_path(path)  # read_bytes above cached it again


def test_keep_page_cache_opts_out(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMOE_KEEP_PAGE_CACHE", "1")
    assert not page_cache.bounded()
    cached_file(tmp_path / "a.bin", 8 * MiB)
    page_cache.drop_path(tmp_path / "a.bin")
    assert resident(tmp_path / "a.bin") >= 6 * MiB


def test_copy_bytes_drops_source_and_destination(tmp_path, monkeypatch):
    from jaxmoe.storage import file_copy

    monkeypatch.setattr(file_copy, "COPY_BLOCK", 4 * MiB)
    data = cached_file(tmp_path / "src.bin", 40 * MiB)
    dst = tmp_path / "dst.bin"
    with open(dst, "wb") as f:
        f.truncate(40 * MiB + 4096)
    file_copy.copy_bytes(tmp_path / "src.bin", 0, dst, 4096, 40 * MiB)
    assert resident(tmp_path / "src.bin") <= 2 * MiB
    assert resident(dst) <= 2 * MiB
    with open(dst, "rb") as f:
        f.seek(4096)
        assert f.read() == data


def test_safetensors_write_and_read_leave_nothing_cached(tmp_path):
    arr = np.random.default_rng(2).standard_normal((8, 1024, 1024), dtype=np.float32)  # 32 MiB
    w = SafetensorsWriter(tmp_path / "m.safetensors", [("w", arr.shape, arr.dtype)],
                          single_file=True)
    w.write("w", arr)
    w.close()
    assert resident(tmp_path / "m.safetensors") <= 2 * MiB
    r = SafetensorsReader(tmp_path / "m.safetensors")
    out = np.empty_like(arr)
    r.read_into("w", out)
    np.testing.assert_array_equal(out, arr)
    assert resident(tmp_path / "m.safetensors") <= 2 * MiB
    np.testing.assert_array_equal(r.get("w"), arr)
    assert resident(tmp_path / "m.safetensors") <= 2 * MiB


def test_drop_view_drops_exactly_the_view(tmp_path):
    cached_file(tmp_path / "m.bin", 16 * MiB + 4096)
    m = np.memmap(tmp_path / "m.bin", np.float32, "r", offset=4096, shape=(4, 1024, 1024))
    part = np.asarray(m[1], np.float32)  # a view: asarray of the same dtype copies nothing
    assert page_cache.file_range(part) == (str(tmp_path / "m.bin"), 4096 + 4 * MiB, 4 * MiB)
    assert int(np.asarray(m).view(np.uint8).sum(dtype=np.uint64)) > 0  # every page read: mapped here
    page_cache.drop_view(part)  # [4 MiB + 4 KiB, 8 MiB + 4 KiB), moved to 2 MiB folios;
    # a page mapped in a process is not dropped from the cache: the view's are unmapped first
    left = resident(tmp_path / "m.bin")
    assert 10 * MiB <= left <= 12 * MiB + 4096, left / MiB
    assert page_cache.file_range(np.array(m[1])) is None  # a copy: no file under it
    # as_strided (how a dcp: tensor inside torch.save's zip is mapped) wraps its base
    strided = np.lib.stride_tricks.as_strided(m[2], shape=(1024, 1024), strides=(4096, 4))
    assert page_cache.file_range(strided) == (str(tmp_path / "m.bin"), 4096 + 8 * MiB, 4 * MiB)
    page_cache.drop_view(np.ones(3))  # not a map: nothing to do


def test_kvstore_root():
    from jaxmoe.checkpoint.stream import kvstore_root

    assert kvstore_root({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": "file:///x/y",
                                                       "path": "a.b"}}) == "/x/y"
    assert kvstore_root({"kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": "/z"}}}) == "/z"
    assert kvstore_root({"kvstore": {"driver": "file", "path": "/w/a"}}) == "/w/a"
    assert kvstore_root({"kvstore": {"driver": "gcs", "bucket": "b"}}) is None


def test_streaming_save_leaves_checkpoint_and_source_uncached(tmp_path):
    """A streaming save (``convert --to orbax:``) of a 32 MiB memmap leaf: neither the Orbax
    files written nor the source file read stay in the cache."""
    from jaxmoe.checkpoint import checkpointer as checkpoint

    src = tmp_path / "leaf.bin"
    cached_file(src, 32 * MiB)
    leaf = np.memmap(src, np.float32, "r", shape=(8, 1024, 1024))
    ck = checkpoint.Checkpointer(tmp_path / "run", keep=0, async_save=False, stream_numpy=True)
    try:
        ck.save(0, {"params": {"w": leaf}, "buffers": {}}, {})
    finally:
        ck.close()
    files = [f for f in (tmp_path / "run").rglob("*") if f.is_file()]
    written = sum(f.stat().st_size for f in files)
    assert written >= 32 * MiB
    assert sum(resident(f) for f in files) <= 4 * MiB
    assert resident(src) <= 4 * MiB
    from jaxmoe.checkpoint.orbax_read import open_array

    back = open_array(tmp_path / "run" / "0" / "state", "params/w").read().result()
    np.testing.assert_array_equal(back, leaf)


def test_writer_in_flight_writes_the_same_file_and_raises_late_errors(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.standard_normal((64, 96)).astype(np.float32) for i in range(6)}
    plan = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    for name, in_flight in (("sync", 0), ("async", 2)):
        w = SafetensorsWriter(tmp_path / f"{name}.safetensors", plan, single_file=True, in_flight=in_flight)
        for k, v in tensors.items():
            w.write(k, v)
        w.close()
    assert (tmp_path / "sync.safetensors").read_bytes() == (tmp_path / "async.safetensors").read_bytes()
    # a failure in the writer thread is raised by the caller's next write or close
    w = SafetensorsWriter(tmp_path / "bad.safetensors", [("a", (2,), np.float32)], single_file=True,
                          in_flight=2)
    w.write("a", np.array(["x", "y"]))  # cast in the writer thread: fails there
    with pytest.raises(ValueError):
        w.close()


def test_leaf_slices_read_ahead(tmp_path):
    """Reading in order: each block read once, the next one already asked for; any order:
    the right values (a read-ahead that does not match is dropped)."""
    import tensorstore as ts

    from jaxmoe.checkpoint.orbax_read import LeafSlices

    vals = np.random.default_rng(4).standard_normal((3, 4, 5, 6)).astype(np.float32)
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
                     "metadata": {"shape": list(vals.shape), "chunks": [1, 2, 5, 6], "dtype": "<f4"}},
                    create=True).result()
    store.write(vals).result()
    view = LeafSlices(ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "a")}}).result(),
                      root=tmp_path / "a")
    for layer in range(3):
        for e in range(4):
            np.testing.assert_array_equal(view[(layer, e)], vals[layer, e])
            nxt = (layer, 2) if e < 2 else (layer + 1, 0) if layer < 2 else None
            assert (view._next[0] if view._next is not None else None) == nxt
    assert view.reads == 6 and view._next is None  # 3 x 2 blocks, nothing after the last
    for idx in [(2, 1), (0, 3), (1, 0), (0, 0), (2, 3)]:
        np.testing.assert_array_equal(view[idx], vals[idx])


def test_file_behind_shared_by_two_threads(tmp_path):
    """Copies into one file from two threads, each range far smaller than a piece: the bytes
    are right, at most the window (plus the ranges in flight) stays cached, none after close."""
    import threading

    data = np.random.default_rng(9).integers(0, 256, 48 * MiB, dtype=np.uint8)
    path = tmp_path / "out.bin"
    with open(path, "wb") as f:
        f.truncate(len(data))
    behind = page_cache.FileBehind(path, window=8 * MiB)
    seen = []

    def worker(parity):
        fd = os.open(path, os.O_WRONLY)
        try:
            for at in range(parity * MiB, len(data), 2 * MiB):
                os.pwrite(fd, data[at:at + MiB], at)
                behind.wrote(at, MiB)
                seen.append(resident(path))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    behind.close()
    assert max(seen) <= 16 * MiB, [s // MiB for s in seen]
    assert resident(path) <= 2 * MiB
    assert path.read_bytes() == data.tobytes()
