"""Benchmark the expert compute paths against a plain matmul of the same FLOPs.

    python bench/experts.py [--json] [--tokens 2048] [--repeats 5]

Shapes are the ``small`` preset's expert layer (D=512, I=256, E=32, k=4) with T tokens and random
(softmax top-k) routing. For each path (dense, ragged, blocked) it times forward and
forward+backward (gradients w.r.t. x and all expert weights) and reports *useful* GFLOP/s:

    forward FLOPs  = 2 * T * k * 3 * D * I     (gate, up, down projections of every assignment)
    fwd+bwd FLOPs  = 3 * forward FLOPs

``matmul_gflops`` is a plain ``[T*k, D] @ [D, 3I]`` matmul (the same forward FLOPs);
``ratio_to_matmul`` = path GFLOP/s (fwd+bwd) / matmul GFLOP/s, ``fwd_ratio_to_matmul`` likewise for
the forward alone. The dense path runs with capacity_factor 1.0 (its dropless worst case,
capacity = T, is O(T^2 * E) memory); its one-hot einsums are overhead not counted as useful FLOPs.
Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.model.experts import expert_ffn


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", default="dense,ragged,blocked")
    ap.add_argument("--block-size", type=int, default=64)
    args = ap.parse_args(argv)

    d, i_dim, e, k, t = 512, 256, 32, 4, args.tokens
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32)
    weights = {
        "gate_proj": jax.random.normal(keys[1], (e, d, i_dim)) * 0.02,
        "up_proj": jax.random.normal(keys[2], (e, d, i_dim)) * 0.02,
        "down_proj": jax.random.normal(keys[3], (e, i_dim, d)) * 0.02,
    }
    probs = jax.nn.softmax(jax.random.normal(keys[4], (t, e)), axis=-1)
    topk_w, topk_idx = jax.lax.top_k(probs, k)
    fwd_flops = 2.0 * t * k * 3 * d * i_dim

    a = jax.random.normal(keys[0], (t * k, d))
    b = jax.random.normal(keys[1], (d, 3 * i_dim))
    mm = jax.jit(lambda a, b: a @ b)
    matmul_gflops = fwd_flops / _time(mm, a, b, repeats=args.repeats) / 1e9

    out = {
        "shapes": {"tokens": t, "d_model": d, "expert_ffn_dim": i_dim, "n_experts": e, "top_k": k,
                   "block_size": args.block_size},
        "matmul_gflops": matmul_gflops,
        "paths": {},
    }
    for path in args.paths.split(","):
        cfg = MoEConfig(n_experts=e, top_k=k, expert_ffn_dim=i_dim, compute_path=path,
                        block_size=args.block_size,
                        capacity_factor=1.0 if path == "dense" else 0.0)

        # routing enters as jit arguments (as in the model), not as constants XLA would fold
        def loss(x, w, idx, gw, cfg=cfg):
            y, _ = expert_ffn(x, idx, gw, w, cfg)
            return jnp.sum(y * y)

        fwd = jax.jit(lambda x, w, idx, gw, cfg=cfg: expert_ffn(x, idx, gw, w, cfg)[0])
        fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        t_fwd = _time(fwd, x, weights, topk_idx, topk_w, repeats=args.repeats)
        t_fb = _time(fb, x, weights, topk_idx, topk_w, repeats=args.repeats)
        g_fb = 3 * fwd_flops / t_fb / 1e9
        g_fwd = fwd_flops / t_fwd / 1e9
        out["paths"][path] = {
            "gflops": g_fb,
            "ratio_to_matmul": g_fb / matmul_gflops,
            "fwd_gflops": g_fwd,
            "fwd_ratio_to_matmul": g_fwd / matmul_gflops,
            "fwd_ms": t_fwd * 1e3,
            "fwd_bwd_ms": t_fb * 1e3,
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"backend={jax.default_backend()} T={t} D={d} I={i_dim} E={e} k={k}")
        print(f"plain matmul: {matmul_gflops:8.1f} GFLOP/s")
        for path, r in out["paths"].items():
            print(
                f"{path:8s} fwd+bwd {r['gflops']:8.1f} GFLOP/s  ratio_to_matmul {r['ratio_to_matmul']:.3f}"
                f"   fwd {r['fwd_gflops']:8.1f} GFLOP/s  ratio {r['fwd_ratio_to_matmul']:.3f}"
            )
    return out


if __name__ == "__main__":
    main()
