"""Expert compute paths: run every (token, expert) assignment through that expert's SwiGLU.

``expert_ffn(x, topk_idx, topk_weights, weights, moe_cfg, path=...)`` is the single-device entry
point (the MoE block calls it; expert-parallel dispatchers in ``jaxmoe/dispatch.py`` replace it
with the same signature). Three interchangeable paths, equal in output and gradients:

``dense``
    One-hot dispatch/combine einsums with a per-expert capacity ``C`` (docs/LAYOUT.md "Dropping"):
    ``x -> [E, C, D]`` slots, batched SwiGLU, weighted combine. ``capacity_factor == 0`` means
    ``C = T`` (dropless). Costs ``O(T * E * C * D)`` for the one-hot einsums: for tests and small
    shapes, and the only path that drops.

``ragged``
    Sort assignments by expert, then ``jax.lax.ragged_dot`` per projection (dropless). Good on
    GPU/TPU; slow on XLA:CPU (DESIGN measured ~0.03 of a plain matmul).

``blocked``
    Sort by expert, pad each expert's group to a multiple of ``block_size`` rows so that every
    block of rows belongs to one expert, and loop over the used blocks doing ordinary
    ``[block, D] @ [D, I]`` matmuls against that expert's weights (dropless). A hand-written
    backward (``jax.custom_vjp``) runs the same loop, accumulating weight gradients per expert
    in place; plain autodiff of a loop that dynamically slices the weights would instead build
    a full ``[E, D, I]`` zero-padded gradient per block.

The combine (weighted sum over a token's k experts) is always accumulated in fp32 and cast once to
``x.dtype``. An expert that receives no tokens gets exactly zero weight gradient on every path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig

PATHS = ("dense", "ragged", "blocked")


def capacity(moe_cfg: MoEConfig, n_tokens: int) -> int:
    """Slots per expert: ``ceil(capacity_factor * T * k / E)`` (>= 1); ``T`` when the factor is 0."""
    c = moe_cfg
    if c.capacity_factor == 0:
        return n_tokens
    return max(1, math.ceil(c.capacity_factor * n_tokens * c.top_k / c.n_experts))


def slot_positions(topk_idx: jax.Array, n_experts: int) -> jax.Array:
    """Position ``[T, k]`` of each assignment in its expert's queue, in (choice rank, token) order:
    every token's first choice before any second choice; within a rank, earlier tokens first."""
    t, k = topk_idx.shape
    rank_major = topk_idx.T.reshape(-1)  # [k*T]: rank 0 of all tokens, then rank 1, ...
    onehot = jax.nn.one_hot(rank_major, n_experts, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    return pos.reshape(k, t).T


def expert_counts(topk_idx: jax.Array, n_experts: int) -> jax.Array:
    """Assignments per expert ``[E]`` int32 (before any dropping)."""
    return jnp.zeros((n_experts,), jnp.int32).at[topk_idx.reshape(-1)].add(1)


def _combine(y_assign: jax.Array, topk_weights: jax.Array, dtype) -> jax.Array:
    """``y[t] = sum_j w[t, j] * y_assign[t, j]`` accumulated in fp32, cast once to ``dtype``."""
    y = jnp.einsum(
        "tk,tkd->td", topk_weights.astype(jnp.float32), y_assign.astype(jnp.float32)
    )
    return y.astype(dtype)


# ---------------------------------------------------------------------------------------------
# dense: capacity einsums
# ---------------------------------------------------------------------------------------------


def _batched_swiglu(xe: jax.Array, weights: dict) -> jax.Array:
    """SwiGLU on ``[E, C, D]`` slots with stacked weights; returns ``[E, C, D]`` in ``xe.dtype``."""
    dt = xe.dtype
    f32 = jnp.float32
    g = jnp.einsum("ecd,edi->eci", xe, weights["gate_proj"].astype(dt), preferred_element_type=f32)
    u = jnp.einsum("ecd,edi->eci", xe, weights["up_proj"].astype(dt), preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(dt)
    y = jnp.einsum("eci,eid->ecd", h, weights["down_proj"].astype(dt), preferred_element_type=f32)
    return y.astype(dt)


def _dense_path(x, topk_idx, topk_weights, weights, moe_cfg):
    t = x.shape[0]
    e = moe_cfg.n_experts
    cap = capacity(moe_cfg, t)
    pos = slot_positions(topk_idx, e)
    keep = pos < cap
    oh_e = jax.nn.one_hot(topk_idx, e, dtype=jnp.float32)  # [T, k, E]
    oh_c = jax.nn.one_hot(jnp.where(keep, pos, cap), cap, dtype=jnp.float32)  # dropped -> all 0
    dispatch = jnp.einsum("tke,tkc->tec", oh_e, oh_c)
    combine = jnp.einsum("tk,tke,tkc->tec", topk_weights.astype(jnp.float32), oh_e, oh_c)
    xe = jnp.einsum("tec,td->ecd", dispatch.astype(x.dtype), x)
    ye = _batched_swiglu(xe, weights)
    y = jnp.einsum("tec,ecd->td", combine, ye.astype(jnp.float32))
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return y.astype(x.dtype), dropped


# ---------------------------------------------------------------------------------------------
# grouped SwiGLU over expert-sorted rows: ragged_dot or blocked
# ---------------------------------------------------------------------------------------------


def _ragged_swiglu(x_sorted, group_sizes, weights):
    dt = x_sorted.dtype
    f32 = jnp.float32
    gs = group_sizes.astype(jnp.int32)

    def rdot(a, w):
        return jax.lax.ragged_dot(a, w.astype(dt), gs, preferred_element_type=f32)

    h = (jax.nn.silu(rdot(x_sorted, weights["gate_proj"])) * rdot(x_sorted, weights["up_proj"]))
    y = rdot(h.astype(dt), weights["down_proj"])
    valid = jnp.arange(x_sorted.shape[0]) < jnp.sum(gs)
    return jnp.where(valid[:, None], y, 0).astype(dt)


def _varying_zeros(shape, dtype, *like):
    """Zeros of ``shape``/``dtype`` whose shard_map varying axes are the union of ``like``'s.

    Loop carries must type-match the body's outputs under ``shard_map(check_vma=True)``; building
    them with ``jnp.zeros_like`` from the inputs (rather than ``jnp.zeros``) keeps them varying
    over the same mesh axes the body's results vary over. Outside shard_map this is plain zeros.
    """
    z = jnp.zeros_like(like[0], shape=shape, dtype=dtype)
    for a in like[1:]:
        z = z + jnp.zeros_like(a, shape=(), dtype=dtype)
    return z


# Rows per matmul. XLA:CPU runs a [64, 512] @ [512, 512] matmul at ~0.75 of a large matmul's
# GFLOP/s but [256, 512] @ ... at ~1x, so consecutive blocks of one expert are processed in runs
# of several blocks (one matmul per run): greedily runs of ``_RUN_ROWS // block_size`` blocks,
# then halving run lengths down to single blocks for what is left of each expert's group.
# Measured on the 2-core CPU bench (bench/experts.py, block 64): 256 beat 128 and 512.
_RUN_ROWS = 256


def _run_schedule(block_expert, n_used, run_blocks):
    """Split the used blocks into runs of same-expert blocks; one entry per run length.

    Returns ``[(length, starts, count), ...]`` for lengths ``run_blocks, run_blocks // 2, ..., 1``:
    ``starts`` the first block of each run of that length (first ``count`` entries valid).
    """
    nb = block_expert.shape[0]
    b = jnp.arange(nb, dtype=jnp.int32)
    used = b < n_used
    is_first = jnp.concatenate([jnp.ones((1,), bool), block_expert[1:] != block_expert[:-1]])
    first = jax.lax.cummax(jnp.where(is_first, b, 0), axis=0)
    cnt = jnp.zeros_like(block_expert, shape=(nb,)).at[block_expert].add(used.astype(block_expert.dtype))
    off = b - first  # block's index inside its expert's group
    rem = cnt[block_expert]  # blocks of the group not yet covered by longer runs
    done = jnp.zeros_like(rem)
    out = []
    length = run_blocks
    while length >= 1:
        full = rem // length * length
        o = off - done
        is_start = used & (o >= 0) & (o < full) & (o % length == 0)
        (starts,) = jnp.nonzero(is_start, size=max(1, nb // length), fill_value=0)
        out.append((length, starts.astype(jnp.int32), jnp.sum(is_start, dtype=jnp.int32)))
        done = done + full
        rem = rem - full
        length //= 2
    return out


def _run_loops(xb, block_expert, n_used, body_fn, init):
    """Call ``body_fn(row0, rows, e, carry)`` for every run (static ``rows``) of the used blocks."""
    nb, bs = xb.shape[:2]
    g = max(1, min(_RUN_ROWS // bs, nb))
    carry = init
    for length, starts, count in _run_schedule(block_expert, n_used, g):

        def body(i, c, starts=starts, rows=length * bs):
            blk = starts[i]
            return body_fn(blk * bs, rows, block_expert[blk], c)

        carry = jax.lax.fori_loop(0, count, body, carry)
    return carry


def _block_loop_fwd(xb, block_expert, n_used, wg, wu, wd, save_residuals):
    """SwiGLU of the first ``n_used`` blocks of ``xb [NB, B, D]``; returns ``yb`` (and g, u).

    Gate and up stay two matmuls: concatenating the weights into one ``[E, D, 2I]`` operand
    costs a full weight copy per call, which measured slower than the fused matmul saves.
    """
    nb, b, d = xb.shape
    dt = xb.dtype
    f32 = jnp.float32
    i_dim = wg.shape[-1]
    xf = xb.reshape(nb * b, d)

    def body(r0, rows, e, carry):
        xs = jax.lax.dynamic_slice_in_dim(xf, r0, rows, 0)
        g = jnp.dot(xs, jax.lax.dynamic_index_in_dim(wg, e, 0, False).astype(dt), preferred_element_type=f32)
        u = jnp.dot(xs, jax.lax.dynamic_index_in_dim(wu, e, 0, False).astype(dt), preferred_element_type=f32)
        h = (jax.nn.silu(g) * u).astype(dt)
        y = jnp.dot(h, jax.lax.dynamic_index_in_dim(wd, e, 0, False).astype(dt), preferred_element_type=f32)
        out = list(carry)
        out[0] = jax.lax.dynamic_update_slice_in_dim(carry[0], y.astype(dt), r0, 0)
        if save_residuals:
            out[1] = jax.lax.dynamic_update_slice_in_dim(carry[1], g, r0, 0)
            out[2] = jax.lax.dynamic_update_slice_in_dim(carry[2], u, r0, 0)
        return tuple(out)

    init = [_varying_zeros((nb * b, d), dt, xb, wg, wu, wd, block_expert)]
    if save_residuals:
        init += [_varying_zeros((nb * b, i_dim), f32, xb, wg, block_expert),
                 _varying_zeros((nb * b, i_dim), f32, xb, wu, block_expert)]
    out = _run_loops(xb, block_expert, n_used, body, tuple(init))
    return (out[0].reshape(nb, b, d),) + tuple(out[1:])


@jax.custom_vjp
def _blocked_swiglu(xb, block_expert, n_used, wg, wu, wd):
    """SwiGLU of each block ``xb[b] [B, D]`` with expert ``block_expert[b]``'s weights.

    Blocks ``>= n_used`` are not computed and give zeros. Weights stay in their stored dtype
    (fp32 master) and are cast per run to ``xb.dtype``, so weight gradients come back fp32.
    """
    return _block_loop_fwd(xb, block_expert, n_used, wg, wu, wd, False)[0]


def _blocked_swiglu_fwd(xb, block_expert, n_used, wg, wu, wd):
    yb, g, u = _block_loop_fwd(xb, block_expert, n_used, wg, wu, wd, True)
    return yb, (xb, block_expert, n_used, wg, wu, wd, g, u)


def _blocked_swiglu_bwd(res, dyb):
    xb, block_expert, n_used, wg, wu, wd, g_all, u_all = res
    nb, b, d = xb.shape
    dt = xb.dtype
    f32 = jnp.float32
    xf = xb.reshape(nb * b, d)
    dyf = dyb.reshape(nb * b, d)

    def body(r0, rows, e, carry):
        dx_all, dwg, dwu, dwd = carry
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, r0, rows, 0)  # noqa: E731
        xs, g, u, dy = sl(xf), sl(g_all), sl(u_all), sl(dyf).astype(dt)
        wg_e = jax.lax.dynamic_index_in_dim(wg, e, 0, False).astype(dt)
        wu_e = jax.lax.dynamic_index_in_dim(wu, e, 0, False).astype(dt)
        wd_e = jax.lax.dynamic_index_in_dim(wd, e, 0, False).astype(dt)
        sg = jax.nn.sigmoid(g)
        silu = g * sg
        h = (silu * u).astype(dt)
        dh = jnp.dot(dy, wd_e.T, preferred_element_type=f32)
        du = (dh * silu).astype(dt)
        dg = (dh * u * sg * (1 + g * (1 - sg))).astype(dt)
        dx = jnp.dot(dg, wg_e.T, preferred_element_type=f32) + jnp.dot(
            du, wu_e.T, preferred_element_type=f32
        )

        def acc(w_grad, upd):
            cur = jax.lax.dynamic_index_in_dim(w_grad, e, 0, False)
            return jax.lax.dynamic_update_index_in_dim(w_grad, cur + upd, e, 0)

        dwd = acc(dwd, jnp.dot(h.T, dy, preferred_element_type=f32))
        dwg = acc(dwg, jnp.dot(xs.T, dg, preferred_element_type=f32))
        dwu = acc(dwu, jnp.dot(xs.T, du, preferred_element_type=f32))
        dx_all = jax.lax.dynamic_update_slice_in_dim(dx_all, dx.astype(dt), r0, 0)
        return dx_all, dwg, dwu, dwd

    init = (
        _varying_zeros((nb * b, d), dt, xb, wg, wu, wd, dyb, block_expert),
        _varying_zeros(wg.shape, f32, wg, xb, dyb, block_expert),
        _varying_zeros(wu.shape, f32, wu, xb, dyb, block_expert),
        _varying_zeros(wd.shape, f32, wd, xb, dyb, block_expert),
    )
    dx, dwg, dwu, dwd = _run_loops(xb, block_expert, n_used, body, init)
    return (dx.reshape(nb, b, d), None, None, dwg.astype(wg.dtype), dwu.astype(wu.dtype),
            dwd.astype(wd.dtype))


_blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def _blocked_swiglu_rows(x_sorted, group_sizes, weights, block_size):
    """Pad each expert's group to a multiple of ``block_size``, run the block loop, unpad."""
    n, d = x_sorted.shape
    e = weights["gate_proj"].shape[0]
    bs = block_size
    nb = -(-n // bs) + e  # static upper bound on blocks: every group wastes < 1 block
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    padded = (gs + bs - 1) // bs * bs
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    n_used = pends[-1] // bs

    # padded position p -> (expert, source row); rows of padding read nothing (zeros)
    p = jnp.arange(nb * bs)
    p_exp = jnp.minimum(jnp.searchsorted(pends, p, side="right"), e - 1)
    r = p - pstarts[p_exp]
    p_valid = (r < gs[p_exp]) & (p < pends[-1])
    src = jnp.where(p_valid, starts[p_exp] + r, 0)
    xp = jnp.where(p_valid[:, None], x_sorted[src], 0).astype(x_sorted.dtype)
    block_expert = p_exp.reshape(nb, bs)[:, 0]

    yb = _blocked_swiglu(
        xp.reshape(nb, bs, d), block_expert, n_used,
        weights["gate_proj"], weights["up_proj"], weights["down_proj"],
    )

    # sorted row i -> its padded position; rows past sum(group_sizes) give 0
    i = jnp.arange(n)
    i_exp = jnp.minimum(jnp.searchsorted(ends, i, side="right"), e - 1)
    i_valid = i < ends[-1]
    dest = jnp.where(i_valid, pstarts[i_exp] + i - starts[i_exp], 0)
    return jnp.where(i_valid[:, None], yb.reshape(nb * bs, d)[dest], 0).astype(x_sorted.dtype)


def grouped_swiglu(x_sorted, group_sizes, weights, *, path, block_size):
    """SwiGLU of rows already sorted by expert.

    ``x_sorted [N, D]``: group ``e`` is ``group_sizes[e]`` contiguous rows, groups in expert order;
    rows past ``sum(group_sizes)`` are padding and produce 0. ``weights``: ``gate_proj``/``up_proj``
    ``[E, D, I]``, ``down_proj [E, I, D]``. ``path``: "ragged" or "blocked". Returns
    ``[N, D]`` in ``x_sorted.dtype``.
    """
    if path == "ragged":
        return _ragged_swiglu(x_sorted, group_sizes, weights)
    if path == "blocked":
        return _blocked_swiglu_rows(x_sorted, group_sizes, weights, block_size)
    raise ValueError(f"grouped_swiglu: path must be 'ragged' or 'blocked', got {path!r}")


@jax.custom_vjp
def take_rows(src, idx, valid, inv_idx, inv_valid):
    """``out[r] = src[idx[r]] if valid[r] else 0`` with a gather (not scatter-add) backward.

    ``inv_idx [R_src, m]`` / ``inv_valid`` list, for each source row, the output rows that read it,
    so the gradient ``d_src[s] = sum_m d_out[inv_idx[s, m]]`` is again a gather. XLA:CPU runs the
    scatter-add that plain autodiff of a gather produces far slower than a gather; the token
    permutations of the blocked path are exactly invertible, so we supply the inverse.
    """
    return jnp.where(valid[:, None], src[idx], 0).astype(src.dtype)


def _take_rows_fwd(src, idx, valid, inv_idx, inv_valid):
    return take_rows(src, idx, valid, inv_idx, inv_valid), (idx, valid, inv_idx, inv_valid)


def _take_rows_bwd(res, d_out):
    idx, valid, inv_idx, inv_valid = res
    g = jnp.where(inv_valid[..., None], d_out[inv_idx].astype(jnp.float32), 0).sum(1)
    return g.astype(d_out.dtype), None, None, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _sorted_path(x, topk_idx, topk_weights, weights, moe_cfg, path):
    """ragged: stable sort of the T*k assignments by expert, grouped SwiGLU, unsort, combine."""
    t, k = topk_idx.shape
    flat_e = topk_idx.reshape(-1)  # assignment a = t * k + j
    order = jnp.argsort(flat_e, stable=True)
    inverse = jnp.argsort(order)
    x_sorted = x[order // k]
    group_sizes = expert_counts(topk_idx, moe_cfg.n_experts)
    y_sorted = grouped_swiglu(
        x_sorted, group_sizes, weights, path=path, block_size=moe_cfg.block_size
    )
    y_assign = y_sorted[inverse].reshape(t, k, -1)
    return _combine(y_assign, topk_weights, x.dtype)


def _blocked_path(x, topk_idx, topk_weights, weights, moe_cfg):
    """blocked: place each assignment straight into its expert's block-padded rows (no argsort).

    An assignment's rank inside its expert's group is a cumulative count over the one-hot of
    expert ids in token-major order (the order a stable sort would give); its padded row is
    ``padded_start[e] + rank``. Moving rows in and out uses :func:`take_rows` (gather both ways).
    """
    t, d = x.shape
    k = topk_idx.shape[1]
    e = moe_cfg.n_experts
    bs = moe_cfg.block_size
    n = t * k
    nb = -(-n // bs) + e  # static upper bound on blocks: every group wastes < 1 block
    flat_e = topk_idx.reshape(-1)
    onehot = jax.nn.one_hot(flat_e, e, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # [n]
    gs = onehot.sum(0)
    padded = (gs + bs - 1) // bs * bs
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    n_used = pends[-1] // bs
    pos = pstarts[flat_e] + rank  # [n] padded row of each assignment
    a_of_p = jnp.full((nb * bs,), -1, jnp.int32).at[pos].set(jnp.arange(n, dtype=jnp.int32))
    p_valid = a_of_p >= 0
    a_safe = jnp.where(p_valid, a_of_p, 0)
    block_expert = jnp.minimum(
        jnp.searchsorted(pends, jnp.arange(nb) * bs, side="right"), e - 1
    ).astype(jnp.int32)

    xp = take_rows(x, a_safe // k, p_valid, pos.reshape(t, k), jnp.ones((t, k), bool))
    yb = _blocked_swiglu(
        xp.reshape(nb, bs, d), block_expert, n_used,
        weights["gate_proj"], weights["up_proj"], weights["down_proj"],
    )
    y_assign = take_rows(
        yb.reshape(nb * bs, d), pos, jnp.ones((n,), bool), a_safe[:, None], p_valid[:, None]
    )
    return _combine(y_assign.reshape(t, k, d), topk_weights, x.dtype)


def expert_ffn(x, topk_idx, topk_weights, weights, moe_cfg: MoEConfig, *, path=None):
    """Routed-expert FFN for tokens ``x [T, D]`` (compute dtype).

    ``topk_idx [T, k]`` int, ``topk_weights [T, k]`` fp32, ``weights`` stacked per expert
    (``gate_proj``/``up_proj [E, D, I]``, ``down_proj [E, I, D]``). ``path`` defaults to
    ``moe_cfg.compute_path``. Returns ``y [T, D]`` in ``x.dtype`` and
    ``stats = {"counts": [E] int32 (before dropping), "dropped": int32 scalar}``.
    """
    path = path or moe_cfg.compute_path
    counts = expert_counts(topk_idx, moe_cfg.n_experts)
    if path == "dense":
        y, dropped = _dense_path(x, topk_idx, topk_weights, weights, moe_cfg)
    elif path == "ragged":
        y = _sorted_path(x, topk_idx, topk_weights, weights, moe_cfg, path)
        dropped = jnp.zeros((), jnp.int32)
    elif path == "blocked":
        y = _blocked_path(x, topk_idx, topk_weights, weights, moe_cfg)
        dropped = jnp.zeros((), jnp.int32)
    else:
        raise ValueError(f"unknown moe.compute_path {path!r}; use one of {', '.join(PATHS)}")
    return y, {"counts": counts, "dropped": dropped}
