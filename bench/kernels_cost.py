"""Deterministic cost of the memory-lean kernels at the bench shape (B=8, S=256): XLA's
``cost_analysis`` (FLOPs, bytes accessed) and ``memory_analysis`` (temp bytes) of the compiled
fwd+bwd of (a) attention, explicit scores vs ``jax.nn.dot_product_attention`` (8 heads / 4 KV
heads, head_dim 64), (b) cross-entropy over vocab 8192 from d_model 512, whole logits vs
``chunked_cross_entropy`` at several chunk sizes. Figures that do not depend on machine load
(a scan's cost is reported per iteration by XLA: multiplied here by the trip count).

    python bench/kernels_cost.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmoe.losses import chunked_cross_entropy, cross_entropy  # noqa: E402
from jaxmoe.model.attention import attend  # noqa: E402

B, S, H, KV, HD, D, V = 8, 256, 8, 4, 64, 512, 8192


def cost(f, *args, trips=1):
    comp = jax.jit(f).lower(*args).compile()
    ca = comp.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    temp = comp.memory_analysis().temp_size_in_bytes
    return ca["flops"] * trips / 1e9, ca["bytes accessed"] * trips / 1e6, temp / 1e6


def main():
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (B, S, H, HD))
    k = jax.random.normal(ks[1], (B, S, KV, HD))
    v = jax.random.normal(ks[2], (B, S, KV, HD))
    for kernel in ("explicit", "dot_product"):
        g = jax.grad(lambda q, k, v, kernel=kernel: jnp.sum(attend(q, k, v, HD**-0.5, kernel) ** 2), argnums=(0, 1, 2))
        print(f"attention {kernel:12s} fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB" % cost(g, q, k, v))
    h = jax.random.normal(ks[3], (B, S, D))
    w = jax.random.normal(ks[4], (D, V)) * 0.02
    t = jax.random.randint(ks[5], (B, S), 0, V)
    m = jnp.ones((B, S))

    def whole(h, w):
        return cross_entropy(jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32), t, m)[0]

    print("CE whole logits   fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB"
          % cost(jax.value_and_grad(whole, argnums=(0, 1)), h, w))
    for c in (256, 512, 1024):
        f = jax.value_and_grad(lambda h, w, c=c: chunked_cross_entropy(h, w, t, m, chunk_tokens=c)[0], argnums=(0, 1))
        print(f"CE chunked {c:5d}  fwd+bwd: %.2f GFLOP, %.0f MB accessed, temp %.1f MB" % cost(f, h, w, trips=B * S // c))


if __name__ == "__main__":
    main()
