"""Fine- against coarse-grained expert layers at equal FLOPs, side by side (issue 16 item 2).

    python bench/expert_shapes.py [--json] [--tokens 2048] [--rounds 9] [--repeats 2]

The expert layers of ``bench/train_step.py``'s two shapes (``bench/experts.py`` SHAPES: coarse =
8 experts top-2 width 1024, fine = 64 experts top-8 width 256, D=512) have the same FLOPs per token,
so their time ratio is their speed ratio at equal FLOPs. In each round both shapes are timed
(forward + backward w.r.t. x and the expert weights, best of ``--repeats`` calls after one untimed
call), for the ``blocked`` path and for ``ideal_batched`` (the same FLOPs on rows already grouped
by expert, batched einsums, no routing: ``bench/experts.py``). ``fine_over_coarse`` = coarse
time / fine time per round, median and range. The ideal's ratio is what the smaller matmuls alone
allow; the blocked path's is what the train step's MoE layers get. Figures are reported, never
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
from experts import SHAPES, best_of, expert_inputs, ideal_batched_ffn

from jaxmoe.config.schema import MoEConfig
from jaxmoe.model.experts import expert_ffn
from jaxmoe.train.host_alloc import keep_freed_memory


def _functions(shape: str, t: int, block_size: int) -> dict:
    d, i_dim, e, k = SHAPES[shape]
    x, w, topk_idx, topk_w = expert_inputs(shape, t)
    cfg = MoEConfig(n_experts=e, top_k=k, expert_ffn_dim=i_dim, compute_path="blocked",
                    block_size=block_size, capacity_factor=0.0)
    blocked = jax.jit(jax.value_and_grad(
        lambda x, w, idx, gw: jnp.sum(expert_ffn(x, idx, gw, w, cfg)[0] ** 2), argnums=(0, 1)))
    ideal = ideal_batched_ffn(e)
    ideal_fb = jax.jit(jax.value_and_grad(lambda x, *ws: jnp.sum(ideal(x, *ws) ** 2), argnums=(0, 1, 2, 3)))
    xg = jax.random.normal(jax.random.key(1), (t * k, d), jnp.float32)
    return {"blocked": (blocked, (x, w, topk_idx, topk_w)),
            "ideal_batched": (ideal_fb, (xg, w["gate_proj"], w["up_proj"], w["down_proj"]))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64, help="as bench/train_step.py (64)")
    args = ap.parse_args(argv)
    if min(args.tokens, args.rounds, args.repeats, args.block_size) < 1:
        ap.error("--tokens, --rounds, --repeats and --block-size must be >= 1")
    if args.tokens % 8:
        ap.error(f"--tokens {args.tokens}: must be a multiple of 8 (fine's ideal groups need tokens*8/64 rows)")
    keep_freed_memory()
    d, i_c, e_c, k_c = SHAPES["coarse"]
    _, i_f, e_f, k_f = SHAPES["fine"]
    assert k_c * i_c == k_f * i_f, "the two shapes must have equal FLOPs per token"
    fns = {shape: _functions(shape, args.tokens, args.block_size) for shape in ("coarse", "fine")}
    for by_kind in fns.values():
        for fn, a in by_kind.values():
            jax.block_until_ready(fn(*a))
    secs = {(s, kind): [] for s in fns for kind in fns[s]}
    for r in range(args.rounds):
        order = ("coarse", "fine") if r % 2 == 0 else ("fine", "coarse")
        for kind in ("blocked", "ideal_batched"):
            for s in order:
                secs[(s, kind)].append(best_of(*fns[s][kind], args.repeats))
    flops = 3 * 2.0 * args.tokens * k_c * 3 * d * i_c  # fwd+bwd, either shape
    out = {"tokens": args.tokens, "rounds": args.rounds, "block_size": args.block_size, "kinds": {}}
    for kind in ("blocked", "ideal_batched"):
        ratio = [c / f for c, f in zip(secs[("coarse", kind)], secs[("fine", kind)])]
        out["kinds"][kind] = {
            "coarse_gflops": flops / min(secs[("coarse", kind)]) / 1e9,
            "fine_gflops": flops / min(secs[("fine", kind)]) / 1e9,
            "fine_over_coarse": statistics.median(ratio),
            "fine_over_coarse_range": [min(ratio), max(ratio)],
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"T={args.tokens} D={d}; coarse E={e_c} k={k_c} I={i_c}; fine E={e_f} k={k_f} I={i_f}; "
              f"block {args.block_size}; {args.rounds} rounds")
        for kind, r in out["kinds"].items():
            lo, hi = r["fine_over_coarse_range"]
            print(f"{kind:14s} coarse {r['coarse_gflops']:7.1f} GFLOP/s  fine {r['fine_gflops']:7.1f} GFLOP/s  "
                  f"fine/coarse {r['fine_over_coarse']:.3f} [{lo:.3f}-{hi:.3f}]")
    return out


if __name__ == "__main__":
    main()
