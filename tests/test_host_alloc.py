"""jaxmoe.train.host_alloc: the glibc setting is applied once, can be opted out of, and is harmless."""

import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util
    from jaxmoe.train import host_alloc
    first = host_alloc.keep_freed_memory()
    second = host_alloc.keep_freed_memory()
    # With M_MMAP_MAX=0 a 64 MiB block must come from the heap (brk), so the heap's size,
    # as reported by mallinfo2's arena field, grows by nearly that much (free space already at
    # the heap's top is reused first).
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    class MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MI2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2()
    p = libc.malloc(64 << 20)
    during = libc.mallinfo2()
    libc.free(p)
    after = libc.mallinfo2()
    # Freeing more than 2 GiB at once must not trim the heap either (a train step does; a
    # positive int threshold tops out at 2 GiB). The block is never touched: address space only.
    big = libc.malloc(3 << 30)
    libc.free(big)
    big_kept = libc.mallinfo2().arena >= (3 << 30)
    # A thread's first allocation: with M_ARENA_MAX=1 it comes from the main arena; by default
    # glibc gives the thread an arena of its own. malloc_info lists one <heap> per arena.
    import tempfile, threading
    t = threading.Thread(target=lambda: libc.free(libc.malloc(1 << 20)))
    t.start(); t.join()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        arenas = open(f.name).read().count("<heap nr=")
    print(first, second, during.hblks - before.hblks, during.arena - before.arena >= (48 << 20),
          after.arena >= during.arena, arenas, big_kept)
    """
)


def _probe(env_extra):
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc setting")
def test_keep_freed_memory_serves_big_blocks_from_the_heap_and_keeps_them():
    first, second, new_mmaps, heap_grew, kept, arenas, big_kept = _probe({"JAXMOE_SYSTEM_MALLOC": ""})
    assert (first, second) == ("True", "True")  # applied, and idempotent
    assert new_mmaps == "0" and heap_grew == "True" and kept == "True"
    assert big_kept == "True"  # a 3 GiB free did not trim the heap
    assert arenas == "1"  # the thread allocated from the main arena


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc setting")
def test_opt_out_leaves_the_system_allocator_alone():
    first, second, new_mmaps, heap_grew, kept, arenas, big_kept = _probe({"JAXMOE_SYSTEM_MALLOC": "1"})
    assert (first, second) == ("False", "False")
    # glibc's default serves a 64 MiB block with its own mmap, and gives a thread its own arena
    assert new_mmaps == "1" and heap_grew == "False" and int(arenas) >= 2
