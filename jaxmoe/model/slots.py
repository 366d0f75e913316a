"""Token slots: capacity, queue positions, counts and the fp32 combine -- the one definition that
every expert compute path (:mod:`jaxmoe.model.experts`) and every dispatcher
(:mod:`jaxmoe.parallel.expert_dispatch`) uses.

Dropping rule (docs/LAYOUT.md "Dropping"): an expert's slots are filled in (choice rank, token
index) order -- every token's first choice before any second choice, earlier tokens first within
a rank; a (token, expert) pair past the capacity is dropped (contributes zero; the token's other
weights are not renormalised).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# rank_in_group uses a [A, n] one-hot cumsum up to this many elements (fast on XLA:CPU, no sort),
# a stable sort beyond it (O(A) memory: the seed's 8 x 8192 assignments x 384 experts would need
# 100 MB of one-hot per layer).
_ONE_HOT_LIMIT = 1 << 22


def capacity(moe_cfg, n_tokens: int, factor: float | None = None) -> int:
    """Slots per expert for ``n_tokens`` tokens: ``ceil(factor * T * k / E)``, at least 1 and at
    most ``T`` (a token's k experts are distinct, so no expert can receive more than T); ``T``
    when the factor is 0 (the worst case: dropless). ``factor`` defaults to
    ``moe_cfg.capacity_factor`` (the single-device dense path); the all-to-all dispatcher passes
    ``mesh.a2a_capacity_factor``."""
    cf = moe_cfg.capacity_factor if factor is None else factor
    if cf == 0:
        return n_tokens
    return min(n_tokens, max(1, math.ceil(cf * n_tokens * moe_cfg.top_k / moe_cfg.n_experts)))


def rank_in_group(ids: jax.Array, n_ids: int) -> tuple[jax.Array, jax.Array]:
    """For ``ids [A]`` (values in ``0..n_ids``): each entry's rank among the earlier entries with
    the same id (the order a stable sort would give), and the count per id ``[n_ids]``; id
    ``n_ids`` means "none" and counts nowhere."""
    a = ids.shape[0]
    if a * n_ids <= _ONE_HOT_LIMIT:
        onehot = jax.nn.one_hot(ids, n_ids, dtype=jnp.int32)  # id n_ids -> all-zero row
        rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
        return rank, onehot.sum(0)
    counts = jnp.zeros((n_ids,), jnp.int32).at[ids].add(1, mode="drop")
    order = jnp.argsort(ids, stable=True)
    starts = jnp.cumsum(counts) - counts
    sorted_ids = ids[order]
    first = jnp.where(sorted_ids < n_ids, starts[jnp.minimum(sorted_ids, n_ids - 1)], 0)
    rank = jnp.zeros((a,), jnp.int32).at[order].set(jnp.arange(a, dtype=jnp.int32) - first)
    return rank, counts


def slot_positions(topk_idx: jax.Array, n_experts: int) -> jax.Array:
    """Position ``[T, k]`` of each assignment in its expert's queue, in (choice rank, token) order."""
    t, k = topk_idx.shape
    rank_major = topk_idx.T.reshape(-1)  # [k*T]: rank 0 of all tokens, then rank 1, ...
    return rank_in_group(rank_major, n_experts)[0].reshape(k, t).T


def expert_counts(topk_idx: jax.Array, n_experts: int) -> jax.Array:
    """Assignments per expert ``[E]`` int32 (before any dropping)."""
    return jnp.zeros((n_experts,), jnp.int32).at[topk_idx.reshape(-1)].add(1)


def combine(y_assign: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """``y[t] = sum_j w[t, j] * y_assign[t, j]`` accumulated in fp32: ``[T, k, D] x [T, k] ->
    [T, D]`` fp32 (callers cast once to the compute dtype)."""
    return jnp.einsum("tk,tkd->td", topk_weights.astype(jnp.float32), y_assign.astype(jnp.float32))


__all__ = ["capacity", "combine", "expert_counts", "rank_in_group", "slot_positions"]
