"""Benchmark the expert compute paths against a plain matmul of the same FLOPs.

    python bench/experts.py [--json] [--tokens 2048] [--rounds 5] [--repeats 2] [--block-size B]

Shapes are the ``small`` preset's expert layer (D=512, I=256, E=32, k=4) with T tokens and random
(softmax top-k) routing. For each path (dense, ragged, blocked) it times forward and
forward+backward (gradients w.r.t. x and all expert weights) and reports *useful* GFLOP/s:

    forward FLOPs  = 2 * T * k * 3 * D * I     (gate, up, down projections of every assignment)
    fwd+bwd FLOPs  = 3 * forward FLOPs

``matmul_gflops`` is a plain ``[T*k, D] @ [D, 3I]`` matmul (the same forward FLOPs) writing into a
donated output buffer (no allocation inside the timing, so the reference is the matmul alone);
``ratio_to_matmul`` = path GFLOP/s (fwd+bwd) / matmul GFLOP/s, ``fwd_ratio_to_matmul`` likewise for
the forward alone. The dense path runs with capacity_factor 1.0 (its dropless worst case,
capacity = T, is O(T^2 * E) memory); its one-hot einsums are overhead not counted as useful FLOPs.

Side by side: in each of ``--rounds`` rounds every path is timed between two timings of the
matmul (every timing, path or matmul, the best of ``--repeats`` calls after one untimed call);
the mean of those two is that round's reference, and each ratio is the median over rounds of
that round's ratio, with its range. On a shared machine whose speed drifts by 1.5x
within minutes this keeps the reference and the path under the same conditions; GFLOP/s figures
are the best round's. ``--block-size`` defaults to the config default (``MoEConfig.block_size``).
Freed host memory is kept in the process (``jaxmoe/host_alloc.py``) unless ``--system-malloc``:
otherwise glibc's mmap/munmap churn makes every figure depend on which path ran before it.
Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.host_alloc import keep_freed_memory
from jaxmoe.model.experts import PATHS, expert_ffn


def _best(fn, args, repeats: int) -> float:
    # One untimed call first: the call right after another path's (a 6 s ragged backward, say)
    # measured up to 1.5x slower on the development VM, whatever the allocator settings.
    jax.block_until_ready(fn(*args))
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
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--repeats", type=int, default=2, help="calls per round (best one counts)")
    ap.add_argument("--paths", default="dense,ragged,blocked")
    ap.add_argument("--block-size", type=int, default=MoEConfig().block_size)
    ap.add_argument("--system-malloc", action="store_true",
                    help="leave glibc's malloc as it is (default: keep freed memory; "
                         "see jaxmoe/host_alloc.py)")
    args = ap.parse_args(argv)
    host_alloc = "system" if args.system_malloc or not keep_freed_memory() else "kept"
    paths = args.paths.split(",")
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: unknown path {p!r}; choose from {', '.join(PATHS)}")
    if args.rounds < 1 or args.repeats < 1 or args.tokens < 1 or args.block_size < 1:
        ap.error("--rounds, --repeats, --tokens and --block-size must be >= 1")

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
    # The reference writes into a donated buffer: it never allocates, so it runs at the speed of
    # the matmul itself. Without that its 25 MB output lands on fresh pages whenever the allocator
    # has just returned memory to the OS, which on this VM costs it up to a third of its time.
    mm = jax.jit(lambda a, b, out: a @ b, donate_argnums=2)
    mm_state = [jnp.zeros((t * k, 3 * i_dim), jnp.float32)]

    def matmul(a, b):
        mm_state[0] = mm(a, b, mm_state[0])
        return mm_state[0]

    timed = {"matmul": (matmul, (a, b))}
    for path in paths:
        cfg = MoEConfig(n_experts=e, top_k=k, expert_ffn_dim=i_dim, compute_path=path,
                        block_size=args.block_size,
                        capacity_factor=1.0 if path == "dense" else 0.0)

        # routing enters as jit arguments (as in the model), not as constants XLA would fold
        def loss(x, w, idx, gw, cfg=cfg):
            y, _ = expert_ffn(x, idx, gw, w, cfg)
            return jnp.sum(y * y)

        run_args = (x, weights, topk_idx, topk_w)
        timed[f"{path}/fwd"] = (
            jax.jit(lambda x, w, idx, gw, cfg=cfg: expert_ffn(x, idx, gw, w, cfg)[0]), run_args
        )
        timed[f"{path}/fwd_bwd"] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), run_args)
    for fn, fn_args in timed.values():  # compile + warm up
        jax.block_until_ready(fn(*fn_args))
    secs = {name: [] for name in timed}
    ref = {path: [] for path in paths}  # the matmul timed right beside each path, per round
    for _ in range(args.rounds):
        for path in paths:
            before = _best(*timed["matmul"], args.repeats)
            for name in (f"{path}/fwd", f"{path}/fwd_bwd"):
                secs[name].append(_best(*timed[name], args.repeats))
            after = _best(*timed["matmul"], args.repeats)
            ref[path].append((before + after) / 2)  # the reference at the path's time
            secs["matmul"] += [before, after]

    mm = secs["matmul"]
    out = {
        "shapes": {"tokens": t, "d_model": d, "expert_ffn_dim": i_dim, "n_experts": e, "top_k": k,
                   "block_size": args.block_size},
        "rounds": args.rounds,
        "host_alloc": host_alloc,
        "matmul_gflops": fwd_flops / min(mm) / 1e9,
        "paths": {},
    }
    for path in paths:
        fb, fw = secs[f"{path}/fwd_bwd"], secs[f"{path}/fwd"]
        r_fb = [3 * m / s for m, s in zip(ref[path], fb)]  # (3 F / s) / (F / m)
        r_fw = [m / s for m, s in zip(ref[path], fw)]
        out["paths"][path] = {
            "gflops": 3 * fwd_flops / min(fb) / 1e9,
            "ratio_to_matmul": statistics.median(r_fb),
            "ratio_to_matmul_range": [min(r_fb), max(r_fb)],
            "fwd_gflops": fwd_flops / min(fw) / 1e9,
            "fwd_ratio_to_matmul": statistics.median(r_fw),
            "fwd_ms": min(fw) * 1e3,
            "fwd_bwd_ms": min(fb) * 1e3,
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"backend={jax.default_backend()} T={t} D={d} I={i_dim} E={e} k={k} "
              f"block_size={args.block_size} rounds={args.rounds} host_alloc={host_alloc}")
        print(f"plain matmul: {out['matmul_gflops']:8.1f} GFLOP/s (best timing)")
        for path, r in out["paths"].items():
            lo, hi = r["ratio_to_matmul_range"]
            print(
                f"{path:8s} fwd+bwd {r['gflops']:8.1f} GFLOP/s  ratio_to_matmul {r['ratio_to_matmul']:.3f}"
                f" [{lo:.3f}-{hi:.3f}]   fwd {r['fwd_gflops']:8.1f} GFLOP/s  ratio {r['fwd_ratio_to_matmul']:.3f}"
            )
    return out


if __name__ == "__main__":
    main()
