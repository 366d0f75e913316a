"""Deterministic cost of the memory-lean kernels at the bench shape (B=8, S=256): XLA's
``cost_analysis`` (FLOPs, bytes accessed) and ``memory_analysis`` (temp bytes) of the compiled
fwd+bwd of (a) attention, explicit scores vs ``jax.nn.dot_product_attention`` (8 heads / 4 KV
heads, head_dim 64), (b) cross-entropy over vocab 8192 from d_model 512, whole logits vs
``chunked_cross_entropy`` at several chunk sizes. Figures that do not depend on machine load
(a scan's cost is reported per iteration by XLA: multiplied here by the trip count).

    python bench/kernels_cost.py [--time ROUNDS]

``--time`` adds an interleaved A/B of each pair (the order alternating by round, 5 calls per
round): wall time and process CPU time per call, median and range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from jaxmoe.model.attention import attend
from jaxmoe.train.losses import chunked_cross_entropy, cross_entropy

B, S, H, KV, HD, D, V = 8, 256, 8, 4, 64, 512, 8192


def cost(f, *args, trips=1):
    comp = jax.jit(f).lower(*args).compile()
    ca = comp.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    temp = comp.memory_analysis().temp_size_in_bytes
    return ca["flops"] * trips / 1e9, ca["bytes accessed"] * trips / 1e6, temp / 1e6


def ab(fns: dict, args, rounds: int, calls: int = 5):
    """Interleaved timing: per system, wall and process-CPU ms per call (median, range)."""
    for f in fns.values():
        jax.block_until_ready(f(*args))
    res = {n: ([], []) for n in fns}
    for r in range(rounds):
        for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                out = fns[n](*args)
            jax.block_until_ready(out)
            res[n][0].append((time.perf_counter() - t0) / calls * 1e3)
            res[n][1].append((time.process_time() - c0) / calls * 1e3)
    for n, (wl, cp) in res.items():
        print(f"  {n:14s} wall {statistics.median(wl):7.0f} ms [{min(wl):.0f}-{max(wl):.0f}], "
              f"CPU {statistics.median(cp):7.0f} ms [{min(cp):.0f}-{max(cp):.0f}]")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time", type=int, default=0, metavar="ROUNDS")
    a = p.parse_args()
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (B, S, H, HD))
    k = jax.random.normal(ks[1], (B, S, KV, HD))
    v = jax.random.normal(ks[2], (B, S, KV, HD))
    attn = {}
    for kernel in ("explicit", "dot_product"):
        g = jax.grad(lambda q, k, v, kernel=kernel: jnp.sum(attend(q, k, v, HD**-0.5, kernel) ** 2), argnums=(0, 1, 2))
        attn[kernel] = jax.jit(g)
        print(f"attention {kernel:12s} fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB" % cost(g, q, k, v))
    if a.time:
        ab(attn, (q, k, v), a.time)
    h = jax.random.normal(ks[3], (B, S, D))
    w = jax.random.normal(ks[4], (D, V)) * 0.02
    t = jax.random.randint(ks[5], (B, S), 0, V)
    m = jnp.ones((B, S))

    def whole(h, w):
        return cross_entropy(jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32), t, m)[0]

    print("CE whole logits   fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB"
          % cost(jax.value_and_grad(whole, argnums=(0, 1)), h, w))
    ce = {"whole": jax.jit(jax.value_and_grad(whole, argnums=(0, 1)))}
    for c in (256, 512, 1024):
        f = jax.value_and_grad(lambda h, w, c=c: chunked_cross_entropy(h, w, t, m, chunk_tokens=c)[0], argnums=(0, 1))
        print(f"CE chunked {c:5d}  fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB"
              % cost(f, h, w, trips=B * S // c))
        if c == 1024:
            ce["chunked_1024"] = jax.jit(f)
    if a.time:
        ab(ce, (h, w), a.time)


if __name__ == "__main__":
    main()
