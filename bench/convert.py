"""Checkpoint conversion throughput, as a fraction of the disk's, and peak memory.

    python bench/convert.py [--gb 2] [--experts 64] [--disk-gb 2] [--keep DIR] [--only ROUTE ...]
                            [--page-cache both|bounded|kept] [--pause 5]

1. Measures the disk under the bench's temporary directory in the same run: a ``--disk-gb`` file
   written sequentially with ``O_DIRECT`` (64 MiB blocks from a page-aligned buffer, then one
   ``fsync``) and read back with ``O_DIRECT``. Direct I/O bypasses the page cache, so neither number
   is the cache's speed, whatever the file size and free memory (``dd oflag=direct`` /
   ``iflag=direct`` measure the same; Python keeps the bench dependency-free and in one process).
   "disk" below is the smaller of the two: a conversion reads and writes the same bytes. Then
   the file is copied block by block into a second file, each 64 MiB read then written with
   ``O_DIRECT`` (``dd iflag=direct oflag=direct``): "copy", the rate at which this disk moves
   bytes from one file to another when nothing but the disk stands in the way.
2. Builds a Qwen3-MoE-layout config whose fp32 weights total about ``--gb`` GB (the layer count
   is scaled to hit the size) and writes a random HF checkpoint for it (sharded at 1GB).
3. Runs each conversion route in a fresh subprocess (``jaxmoe convert``); the route's time counts
   from after the imports every conversion needs (jaxmoe, jax, Orbax, and jaxmoe's model module, whose
   declarations give every leaf's shape: ~0.5 s once per process, not per byte; no route here imports
   torch: ``dcp:`` is read and written without it) until its output is on disk: the child's conversion, then an
   ``fsync`` of every file it wrote (a conversion that already synced makes that free; one that
   did not pays its writeback there, so every route is timed to durable bytes). Before each
   route the source's files are ``fsync``'d and dropped from the page cache
   (``posix_fadvise(DONTNEED)``, which needs no root), so the source is read from disk. The
   child reports its own peak RSS (``VmHWM``: ``getrusage``'s ``ru_maxrss`` survives ``exec``).
   Routes: hf -> torch, torch -> hf (1GB shards), hf -> orbax, orbax -> hf, hf -> dcp,
   dcp -> hf, dcp -> orbax, orbax -> dcp, and with transformers
   ``hf -> orbax --verify --verify-layers 1`` (not a throughput route: it also runs two models).
   Each route runs after ``--pause`` seconds of rest and, with ``--page-cache both`` (the
   default), twice side by side (the order alternating per route): with jaxmoe's bounded page
   cache (:mod:`jaxmoe.storage.page_cache`) and with ``JAXMOE_KEEP_PAGE_CACHE=1`` (the kernel's
   default, rows marked ``[kept]``). Before the routes it times touching 1 GiB of fresh memory
   after a 5 s pause and again at once: on a VM that hands free pages back to the host the first
   is far slower, and every byte that goes through the page cache without being recycled pays
   it.
4. Prints each route's MB/s (model bytes / seconds) and its ratios to the disk and to the copy
   probe ("x copy" over 1: faster than the plain copy, reads overlapping writes), peak RSS next to
   the largest leaf (a stacked expert weight ``[Lm, E, D, I]``) and the largest per-layer tensor
   (one layer's slice, ``[E, D, I]``), and checks the HF copies are bit-identical to the
   original. Outputs no later route reads are removed as soon as they are checked; the
   temporary directory is removed at the end (unless ``--keep``).

Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, sys, time
argv = json.loads(sys.argv[1])
import jaxmoe.checkpoint.checkpointer, jaxmoe.cli, jaxmoe.model.transformer  # noqa: E401,F401 (every route)
import jaxmoe.port.commands.convert  # noqa: F401
t0 = time.perf_counter()
rc = 0
if argv:
    from jaxmoe.cli import main
    rc = main(argv)
secs = time.perf_counter() - t0
# VmHWM, not getrusage: ru_maxrss survives exec on Linux, so a child would report the parent's
# peak (this bench parent holds big arrays while writing the synthetic checkpoint).
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("BENCH " + json.dumps({"rc": rc, "seconds": secs, "peak_rss": rss}))
"""

BLOCK = 64 * 2**20


def disk_bandwidth(where: Path, nbytes: int) -> tuple[float, float, float]:
    """(read, write, copy) bytes/s of sequential ``O_DIRECT`` I/O on a ``nbytes`` file in
    ``where``; copy: the file read block by block and each block written to a second file (what
    ``dd iflag=direct oflag=direct`` does; a route between files must read and write every byte)."""
    import mmap

    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).integers(0, 255, BLOCK, dtype=np.uint8).tobytes())
    n = max(1, nbytes // BLOCK)
    path = where / "disk-probe.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        write = n * BLOCK / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        got = 0
        while True:
            k = os.readv(fd, [buf])
            got += k
            if k < BLOCK:
                break
        read = got / (time.perf_counter() - t0)
        os.lseek(fd, 0, os.SEEK_SET)
        out = os.open(where / "disk-probe-copy.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) == BLOCK:
                os.write(out, buf)
            os.fsync(out)
            copy = got / (time.perf_counter() - t0)
        finally:
            os.close(out)
            (where / "disk-probe-copy.bin").unlink()
    finally:
        os.close(fd)
        path.unlink()
    return read, write, copy


def fresh_memory_rate(nbytes: int = 2**30, pause: float = 5.0) -> tuple[float, float]:
    """(after a pause, at once again) bytes/s of touching ``nbytes`` of newly allocated memory.

    On a VM whose free memory goes back to the host (free-page reporting, ballooning), a page
    the kernel hands out after a pause must be provided again by the host: the first figure. The
    second allocates right after freeing the same amount, so the kernel reuses warm pages.
    Every byte a conversion moves through the page cache takes such a page unless the cache is
    recycled (jaxmoe.storage.page_cache)."""
    time.sleep(pause)
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        a = np.ones(nbytes, np.uint8)
        rates.append(nbytes / (time.perf_counter() - t0))
        del a
    return rates[0], rates[1]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [f for f in path.rglob("*") if f.is_file() and not f.is_symlink()]


def drop_cache(path: Path) -> None:
    """Write ``path``'s files back and drop them from the page cache (no root needed)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> float:
    """fsync every file under ``path`` and the folders holding them; the seconds it took."""
    t0 = time.perf_counter()
    todo = _files(path) + ([path, *(d for d in path.rglob("*") if d.is_dir())] if path.is_dir()
                           else [path.parent])
    for f in todo:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def bench_config(gb: float, experts: int = 64):
    from jaxmoe.config import config_from_dict, load_config
    from jaxmoe.config.counting import count_params

    base = load_config("tiny")
    d = {
        "model": {"name": "bench-convert", "vocab_size": 32000, "d_model": 1024, "n_layers": 1,
                  "n_heads": 16, "n_kv_heads": 4, "head_dim": 64, "max_seq_len": 4096},
        "moe": {"n_experts": experts, "top_k": 4, "expert_ffn_dim": 512},
    }
    one = count_params(config_from_dict(d, base))["total_params"]
    d["model"]["n_layers"] = 2
    per_layer = count_params(config_from_dict(d, base))["total_params"] - one
    fixed = one - per_layer
    d["model"]["n_layers"] = max(1, round((gb * 1e9 / 4 - fixed) / per_layer))
    return config_from_dict(d, base)


def write_synthetic_hf(cfg, out: Path) -> int:
    """Random fp32 HF checkpoint of ``cfg`` (1GB shards), one tensor in memory at a time."""
    from jaxmoe.config.hf import to_hf_config
    from jaxmoe.port.io.safetensors_io import SafetensorsWriter
    from jaxmoe.port.maps import hf_map

    table = hf_map.entries(cfg)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
    w = SafetensorsWriter(out, [(e.hf_name, e.hf_shape, np.float32) for e in table],
                          shard_size=1_000_000_000)
    rng = np.random.default_rng(0)
    for e in table:
        w.write(e.hf_name, rng.standard_normal(e.hf_shape, dtype=np.float32) * 0.02)
    w.close()
    return w.total_size


def run_child(argv: list[str], keep_cache: bool = False) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAXMOE_KEEP_PAGE_CACHE", None)
    if keep_cache:
        env["JAXMOE_KEEP_PAGE_CACHE"] = "1"
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True,
                       text=True, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("BENCH ")]
    if p.returncode or not line or json.loads(line[-1][6:])["rc"]:
        raise SystemExit(f"child {argv} failed:\n{p.stdout}\n{p.stderr}")
    return json.loads(line[-1][6:])


def same_hf(a: Path, b: Path) -> bool:
    from jaxmoe.port.io.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if sorted(ra.names()) != sorted(rb.names()):
        return False
    return all(np.array_equal(ra.get(n), rb.get(n)) for n in ra.names())


def _routes(work: Path, has_torch: bool) -> list:
    """The routes timed: (name, source path, argv, output, kept for a later route)."""
    import importlib.util

    titan = ["--titan", f"{work}/model.toml"]
    steps = [("hf -> torch", "hf", ["--from", f"hf:{work}/hf", "--to", f"torch:{work}/m.safetensors"],
              "m.safetensors"),
             ("torch -> hf (1GB shards)", "m.safetensors",
              ["--from", f"torch:{work}/m.safetensors", "--to", f"hf:{work}/hf2",
               "--shard-size", "1GB"], "hf2"),
             ("hf -> orbax", "hf", ["--from", f"hf:{work}/hf", "--to", f"orbax:{work}/run"], "run"),
             ("orbax -> hf", "run", ["--from", f"orbax:{work}/run", "--to", f"hf:{work}/hf3"],
              "hf3")]
    # dcp: routes need no torch (jaxmoe.port.io.torch_save, jaxmoe.port.io.dcp_meta)
    steps += [("hf -> dcp", "hf", ["--from", f"hf:{work}/hf", "--to", f"dcp:{work}/dcp"], "dcp"),
              ("dcp -> hf", "dcp", ["--from", f"dcp:{work}/dcp", *titan, "--to",
                                    f"hf:{work}/hf4"], "hf4"),
              ("dcp -> orbax", "dcp", ["--from", f"dcp:{work}/dcp", *titan, "--to",
                                       f"orbax:{work}/run4"], "run4"),
              ("orbax -> dcp", "run", ["--from", f"orbax:{work}/run", "--to",
                                       f"dcp:{work}/dcp2"], "dcp2")]
    if has_torch and importlib.util.find_spec("transformers"):
        steps.append(("hf -> orbax --verify-layers 1", "hf",
                      ["--from", f"hf:{work}/hf", "--to", f"orbax:{work}/run2", "--verify",
                       "--verify-layers", "1"], "run2"))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="approximate checkpoint size (fp32)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    ap.add_argument("--disk-gb", type=float, default=2.0, help="size of the direct-I/O disk probe")
    ap.add_argument("--keep", help="work in this directory and keep it")
    ap.add_argument("--only", nargs="*", help="run only routes whose name starts with one of these")
    ap.add_argument("--page-cache", choices=("bounded", "kept", "both"), default="both",
                    help="run each route with jaxmoe's bounded page cache (the default), with "
                    "JAXMOE_KEEP_PAGE_CACHE=1 ('kept': the kernel's default), or both, side by "
                    "side (the order alternating per route)")
    ap.add_argument("--pause", type=float, default=5.0,
                    help="seconds of rest before each route (every route starts from the same "
                    "machine state: on a VM, free pages handed back to the host)")
    args = ap.parse_args()

    from jaxmoe.config.counting import count_params
    from jaxmoe.port.maps import hf_map

    cfg = bench_config(args.gb, args.experts)
    shapes = hf_map.leaf_shapes(cfg)
    big_key = max(shapes, key=lambda k: int(np.prod(shapes[k])))
    big = int(np.prod(shapes[big_key])) * 4
    stacked = [k for k in shapes if "/" in k.split("/", 1)[1]]  # layer stacks: [L, ...]
    layer_key = max(stacked, key=lambda k: int(np.prod(shapes[k][1:])))
    per_layer = int(np.prod(shapes[layer_key][1:])) * 4
    total = count_params(cfg)["total_params"] * 4
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="jaxmoe-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rd, wr, cp = disk_bandwidth(work, int(args.disk_gb * 1e9))
        disk = min(rd, wr)
        print(f"disk ({work}, O_DIRECT, {args.disk_gb:g} GB, 64 MiB blocks): read "
              f"{rd / 1e6:.0f} MB/s, write {wr / 1e6:.0f} MB/s; 'disk' = {disk / 1e6:.0f} MB/s; "
              f"copy (read a block, write it to another file) {cp / 1e6:.0f} MB/s = "
              f"{cp / disk:.2f} x disk ('x copy')")
        paused, warm = fresh_memory_rate()
        print(f"fresh memory (1 GiB touched): {paused / 1e6:.0f} MB/s after a 5 s pause, "
              f"{warm / 1e6:.0f} MB/s right after freeing the same amount")
        t0 = time.perf_counter()
        size = write_synthetic_hf(cfg, work / "hf")
        print(f"config: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
              f"{cfg.moe.n_experts} experts x {cfg.moe.expert_ffn_dim}; "
              f"{total / 1e9:.2f} GB fp32 ({size / 1e9:.2f} GB written in "
              f"{time.perf_counter() - t0:.1f}s)")
        print(f"largest leaf: {big_key} {list(shapes[big_key])} = {big / 1e6:.0f} MB; "
              f"largest HF tensor: "
              f"{max(int(np.prod(e.hf_shape)) for e in hf_map.entries(cfg)) * 4 / 1e6:.1f} MB; "
              f"largest per-layer tensor: {layer_key}[i] {list(shapes[layer_key][1:])} = "
              f"{per_layer / 1e6:.0f} MB")
        base = run_child([])
        print(f"baseline child RSS (python + jaxmoe, jax, Orbax, model imports): "
              f"{base['peak_rss'] / 1e6:.0f} MB (--verify also imports "
              "transformers and torch)")
        import importlib.util

        has_torch = importlib.util.find_spec("torch") is not None
        from jaxmoe.config import config_to_toml

        (work / "model.toml").write_text(config_to_toml(cfg))
        steps = _routes(work, has_torch)
        if args.only:
            steps = [s for s in steps if any(s[0].startswith(o) for o in args.only)]
        print(f"{'route':30s} {'seconds':>8s} {'(fsync)':>8s} {'MB/s':>6s} {'x disk':>7s} {'x copy':>7s} "
              f"{'peak RSS MB':>12s} {'RSS/leaf':>9s} {'(RSS-base)/per-layer':>21s}")
        modes = {"bounded": [False], "kept": [True], "both": [True, False]}[args.page_cache]
        for i, (name, src, argv, out) in enumerate(steps):
            if not (work / src).exists():
                print(f"{name:30s} (skipped: {src} was not made)")
                continue
            for j, keep_cache in enumerate(modes if i % 2 == 0 else modes[::-1]):
                if j:  # the other mode's output: checked, then removed for this run
                    path = work / out
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                drop_cache(work / src)
                time.sleep(args.pause)
                r = run_child(["convert", *argv], keep_cache)
                sync = fsync_tree(work / out)
                secs = r["seconds"] + sync
                mbs = size / 1e6 / secs
                label = name + (" [kept]" if keep_cache and len(modes) > 1 else "")
                print(f"{label:30s} {secs:8.2f} {sync:8.2f} {mbs:6.0f} {mbs * 1e6 / disk:7.2f} "
                      f"{mbs * 1e6 / cp:7.2f} "
                      f"{r['peak_rss'] / 1e6:12.0f} {r['peak_rss'] / big:9.2f} "
                      f"{(r['peak_rss'] - base['peak_rss']) / per_layer:21.2f}", flush=True)
                if out.startswith("hf") and out != "hf":
                    print(f"  hf -> ... -> {out} bit-exact: {same_hf(work / 'hf', work / out)}")
            later = {s[1] for s in steps[i + 1:]}
            if out not in later and not args.keep:
                path = work / out
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
