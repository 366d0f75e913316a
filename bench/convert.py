"""Checkpoint conversion throughput and peak memory on a multi-GB synthetic checkpoint.

    python bench/convert.py [--gb 2] [--experts 64] [--keep DIR]

1. Builds a Qwen3-MoE-layout config whose fp32 weights total about ``--gb`` GB (the layer count
   is scaled to hit the size) and writes a random HF checkpoint for it (sharded at 1GB, one tensor
   in memory at a time) into a temporary directory.
2. Runs each conversion in a fresh subprocess (``jaxmoe convert``) and reads that process's own
   peak RSS at its exit:
   hf -> torch, torch -> hf (sharded), hf -> orbax and orbax -> hf when the Orbax checkpoint module
   is present. An empty child (imports only) gives the baseline RSS. (The child reads ``VmHWM``
   from /proc/self/status: ``getrusage``'s ``ru_maxrss`` survives ``exec`` on Linux and would
   report the parent's peak.)
   With torch installed, hf -> dcp (a torchtitan DCP step) and dcp -> hf (the model named by
   ``--titan`` with the config's .toml); with transformers too, ``hf -> orbax --verify
   --verify-layers 1``.
3. Prints MB/s and peak RSS next to the model size, the largest leaf (a stacked expert weight
   ``[Lm, E, D, I]``) and the largest *per-layer* tensor (one layer's slice of a stacked leaf,
   ``[E, D, I]``): peak RSS above the baseline is reported in units of that per-layer tensor,
   which is what bounded memory means here (orbax leaves are read one Zarr chunk at a time).
   Checks the final HF copies are bit-identical to the original. The temporary directory is
   removed at the end (unless ``--keep``).

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
t0 = time.perf_counter()
rc = 0
if argv == ["--imports"]:  # the baseline: what a conversion imports, nothing run
    import jaxmoe.checkpoint, jaxmoe.cli, jaxmoe.port.convert  # noqa: E401,F401
elif argv:
    from jaxmoe.cli import main
    rc = main(argv)
secs = time.perf_counter() - t0
# VmHWM, not getrusage: ru_maxrss survives exec on Linux, so a child would report the parent's
# peak (this bench parent holds big arrays while writing the synthetic checkpoint).
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("BENCH " + json.dumps({"rc": rc, "seconds": secs, "peak_rss": rss}))
"""


def bench_config(gb: float, experts: int = 64):
    from jaxmoe.config import config_from_dict, load_config
    from jaxmoe.counting import count_params

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
    from jaxmoe.hfconfig import to_hf_config
    from jaxmoe.port import hf_map
    from jaxmoe.port.safetensors_io import SafetensorsWriter

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


def run_child(argv: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True,
                       text=True, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("BENCH ")]
    if p.returncode or not line or json.loads(line[-1][6:])["rc"]:
        raise SystemExit(f"child {argv} failed:\n{p.stdout}\n{p.stderr}")
    return json.loads(line[-1][6:])


def same_hf(a: Path, b: Path) -> bool:
    from jaxmoe.port.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if sorted(ra.names()) != sorted(rb.names()):
        return False
    return all(np.array_equal(ra.get(n), rb.get(n)) for n in ra.names())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="approximate checkpoint size (fp32)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    ap.add_argument("--keep", help="work in this directory and keep it")
    args = ap.parse_args()

    from jaxmoe.counting import count_params
    from jaxmoe.port import hf_map

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
        base = run_child(["--imports"])
        print(f"baseline child RSS (python + jaxmoe, jax, Orbax imports): "
              f"{base['peak_rss'] / 1e6:.0f} MB (--verify also imports torch + transformers)")
        steps = [("hf -> torch", ["--from", f"hf:{work}/hf", "--to", f"torch:{work}/m.safetensors"]),
                 ("torch -> hf (1GB shards)", ["--from", f"torch:{work}/m.safetensors", "--to",
                                               f"hf:{work}/hf2", "--shard-size", "1GB"])]
        try:
            import jaxmoe.checkpoint  # noqa: F401

            steps += [("hf -> orbax", ["--from", f"hf:{work}/hf", "--to", f"orbax:{work}/run"]),
                      ("orbax -> hf", ["--from", f"orbax:{work}/run", "--to", f"hf:{work}/hf3"])]
        except ImportError:
            print("(jaxmoe.checkpoint not present: orbax steps skipped)")
        import importlib.util

        if importlib.util.find_spec("torch"):
            from jaxmoe.config import config_to_toml

            (work / "model.toml").write_text(config_to_toml(cfg))
            steps += [("hf -> dcp", ["--from", f"hf:{work}/hf", "--to", f"dcp:{work}/dcp"]),
                      ("dcp -> hf", ["--from", f"dcp:{work}/dcp", "--titan", f"{work}/model.toml",
                                     "--to", f"hf:{work}/hf4"])]
        if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
            steps.append(("hf -> orbax --verify-layers 1",
                          ["--from", f"hf:{work}/hf", "--to", f"orbax:{work}/run2", "--verify",
                           "--verify-layers", "1"]))
        print(f"{'step':32s} {'seconds':>8s} {'MB/s':>8s} {'peak RSS MB':>12s} "
              f"{'RSS / largest leaf':>19s} {'(RSS-base) / per-layer':>23s}")
        for name, argv in steps:
            r = run_child(["convert", *argv])
            print(f"{name:32s} {r['seconds']:8.2f} {size / 1e6 / r['seconds']:8.0f} "
                  f"{r['peak_rss'] / 1e6:12.0f} {r['peak_rss'] / big:19.2f} "
                  f"{(r['peak_rss'] - base['peak_rss']) / per_layer:23.2f}")
        print("hf -> torch -> hf bit-exact:", same_hf(work / "hf", work / "hf2"))
        if (work / "hf3").exists():
            print("hf -> orbax -> hf bit-exact:", same_hf(work / "hf", work / "hf3"))
        if (work / "hf4").exists():
            print("hf -> dcp -> hf bit-exact:", same_hf(work / "hf", work / "hf4"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
