"""The ``blocked`` expert compute path: dropless, fast on CPU, with a hand-written backward.

Each assignment gets a row in an expert-contiguous layout where every expert's group is padded
to a multiple of ``block_size`` rows (a cumulative count, no sort). For each expert that has
rows, its weights are sliced once, then its group is covered by runs of up to ``RUN_ROWS`` rows,
each one ordinary matmul per projection (gate and up side by side as one ``[D, 2I]`` operand). A
run gathers its input rows straight from ``x`` and scatter-adds its weighted outputs into the
``[T, D]`` result, so no padded copy of the tokens or of the outputs is ever stored; between the
passes only the gate/up pre-activations ``[P, 2I]`` are kept. The backward (``jax.custom_vjp``)
runs the same loops, gathering ``dy``, scatter-adding ``dx``, accumulating weight gradients per
expert in place and getting the combine-weight gradient as ``<dy @ W_down^T, h>`` (no stored
outputs needed); plain autodiff of a loop that dynamically slices the weights would instead build
a full ``[E, D, I]`` zero-padded gradient per run.

Entry points: :func:`blocked_path` (tokens + routing) and :func:`blocked_swiglu_rows` (rows
already grouped by expert, as the dispatchers receive them). :func:`transform_backward` is the
fault-injection seam of the hand-written backward (parity's self-test uses it to prove the
gradient checks catch a wrong weight gradient). Measurements: docs/MEASUREMENTS.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxmoe.model.slots import rank_in_group

# Shape suffixes of local arrays: S source rows (tokens, or rows already grouped by expert),
# k assignments per source row, A = S*k assignments, E experts, D d_model, I expert FFN dim
# (2I: gate and up side by side), P block-padded rows (expert-contiguous), Q rows of one run.


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


# Rows per matmul: an expert's blocks are processed in runs of ``RUN_ROWS // block_size`` blocks
# while they fit, then at most one run each of half, a quarter, ... of that for what is left of
# the group. Small matmuls run well below a large one's GFLOP/s on XLA:CPU, so runs are as long as
# the typical expert group allows (the A/B behind this size:
# docs/history/MEASUREMENTS-2026-12.md, "Moved from code comments: blocked path").
RUN_ROWS = 512


def _for_each_run(n_rows, grp_start_E, grp_blocks_E, block_size, prep, body, carry):
    """Loop over the experts that have rows, then over the runs of each expert's group.

    ``prep(e)`` runs once per expert (slices that expert's weights: once per expert rather than
    once per run); ``body(row0, rows, e, ctx, carry)`` runs per run, ``rows`` static.
    """
    bs = block_size
    g = max(1, min(RUN_ROWS, n_rows) // bs)  # a run never exceeds the padded rows
    g = 1 << (g.bit_length() - 1)  # a power of two: the tail runs g/2, g/4, ..., 1 cover any rest

    def per_expert(e, carry):
        n = grp_blocks_E[e]

        def work(carry):
            ctx = prep(e)
            b0 = grp_start_E[e]
            n_full = n // g
            carry = jax.lax.fori_loop(
                0, n_full, lambda i, c: body((b0 + i * g) * bs, g * bs, e, ctx, c), carry
            )
            done = n_full * g
            length = g // 2
            while length >= 1:
                take = n - done >= length
                carry = jax.lax.cond(
                    take,
                    lambda c, r0=(b0 + done) * bs, rows=length * bs: body(r0, rows, e, ctx, c),
                    lambda c: c,
                    carry,
                )
                done = done + jnp.where(take, length, 0)
                length //= 2
            return carry

        return jax.lax.cond(n > 0, work, lambda c: c, carry)

    return jax.lax.fori_loop(0, grp_blocks_E.shape[0], per_expert, carry)


def _blocked_layout(expert_A, n_experts, block_size):
    """Place assignments into expert-contiguous, block-padded rows (no argsort).

    ``expert_A``: expert of each assignment, ``n_experts`` for "no assignment". An assignment's
    padded row is ``padded_start[e] + rank`` (its rank inside its expert's group). The padded
    rows number ``P = (ceil(A / block_size) + n_experts) * block_size``, a static bound (every
    group wastes < 1 block). Returns ``pos [A]`` (padded row, ``P`` for invalid assignments),
    ``a_of_p [P]`` (assignment of each padded row, -1 for padding) and each expert's first block
    and block count ``[E]``.
    """
    e, bs = n_experts, block_size
    n_rows = (-(-expert_A.shape[0] // bs) + e) * bs
    rank_A, size_E = rank_in_group(expert_A, e)
    padded_E = (size_E + bs - 1) // bs * bs
    pend_E = jnp.cumsum(padded_E)
    pstart_E = pend_E - padded_E
    valid_A = expert_A < e
    pos_A = jnp.where(valid_A, pstart_E[jnp.minimum(expert_A, e - 1)] + rank_A, n_rows).astype(jnp.int32)
    a_of_p_P = jnp.full((n_rows,), -1, jnp.int32).at[pos_A].set(
        jnp.arange(expert_A.shape[0], dtype=jnp.int32), mode="drop"
    )
    return pos_A, a_of_p_P, (pstart_E // bs).astype(jnp.int32), (padded_E // bs).astype(jnp.int32)


class _Run:
    """One run of padded rows ``r0 .. r0+rows`` (all of expert ``e``): which source row each
    padded row reads, whether it holds an assignment, and that assignment's combine weight."""

    def __init__(self, a_of_p_P, comb_w_A, n_src, k, r0, rows):
        a_Q = jax.lax.dynamic_slice_in_dim(a_of_p_P, r0, rows, 0)
        self.valid_Q = a_Q >= 0
        a_safe_Q = jnp.where(self.valid_Q, a_Q, 0)
        self.src_Q = a_safe_Q // k  # for gathers (padding rows read row 0, then are zeroed)
        # for scatter-adds: padding rows get distinct out-of-range rows, which mode="drop" skips;
        # valid rows of one run are distinct source rows in increasing order
        self.dst_Q = jnp.where(self.valid_Q, self.src_Q, n_src + jnp.arange(rows, dtype=a_Q.dtype))
        self.w_Q = jnp.where(self.valid_Q, comb_w_A[a_safe_Q], 0)

    def gather(self, src_SD):
        return jnp.where(self.valid_Q[:, None], src_SD[self.src_Q], 0)

    def scatter_add(self, acc_SD, rows_QD):
        return acc_SD.at[self.dst_Q].add(rows_QD, mode="drop", unique_indices=True, indices_are_sorted=True)


def _expert_weights(wg_EDI, wu_EDI, wd_EID, e, dt):
    """Expert ``e``'s weights in ``dt``: gate and up side by side ``[D, 2I]`` (one matmul for
    both) and down ``[I, D]``. The ``prep`` of both passes' loops."""
    at = functools.partial(jax.lax.dynamic_index_in_dim, index=e, axis=0, keepdims=False)
    return jnp.concatenate([at(wg_EDI), at(wu_EDI)], axis=1).astype(dt), at(wd_EID).astype(dt)


def _block_loop_fwd(block_size, x_SD, comb_w_Sk, a_of_p_P, grp_start_E, grp_blocks_E, wg_EDI, wu_EDI, wd_EID,
                    save_residuals):
    """Forward over the used runs; returns ``out [S, D]`` fp32 (and ``gu [P, 2I]`` fp32)."""
    dt = x_SD.dtype
    f32 = jnp.float32
    n_src, k = comb_w_Sk.shape
    n_rows, d = a_of_p_P.shape[0], x_SD.shape[1]
    i_dim = wg_EDI.shape[-1]
    comb_w_A = comb_w_Sk.reshape(-1)

    prep = functools.partial(_expert_weights, wg_EDI, wu_EDI, wd_EID, dt=dt)

    def body(r0, rows, e, ctx, carry):
        wgu_D2I, wd_ID = ctx
        run = _Run(a_of_p_P, comb_w_A, n_src, k, r0, rows)
        gu_Q2I = jnp.dot(run.gather(x_SD), wgu_D2I, preferred_element_type=f32)
        h_QI = (jax.nn.silu(gu_Q2I[:, :i_dim]) * gu_Q2I[:, i_dim:]).astype(dt)
        y_QD = jnp.dot(h_QI, wd_ID, preferred_element_type=f32)
        out = [run.scatter_add(carry[0], run.w_Q[:, None] * y_QD.astype(dt).astype(f32))]
        if save_residuals:
            out.append(jax.lax.dynamic_update_slice_in_dim(carry[1], gu_Q2I, r0, 0))
        return tuple(out)

    init = [_varying_zeros((n_src, d), f32, x_SD, comb_w_Sk, wg_EDI, wu_EDI, wd_EID, a_of_p_P)]
    if save_residuals:
        init.append(_varying_zeros((n_rows, 2 * i_dim), f32, x_SD, wg_EDI, wu_EDI, a_of_p_P))
    return _for_each_run(n_rows, grp_start_E, grp_blocks_E, block_size, prep, body, tuple(init))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_ffn(block_size, x_SD, comb_w_Sk, wg_EDI, wu_EDI, wd_EID, out_idx_Sk, a_of_p_P, grp_start_E,
                 grp_blocks_E):
    """``out[s] = sum_j comb_w[s, j] * SwiGLU_{e(s, j)}(x[s])`` over block-padded rows, fp32.

    ``out_idx [S, k]`` is the padded row of source row ``s``'s ``j``-th assignment (``P`` if it
    has none) and ``a_of_p [P]`` its inverse (``s * k + j`` per padded row, -1 for padding);
    ``comb_w [S, k]`` fp32 is 0 for assignments that do not exist. Each run gathers its input
    rows straight from ``x`` and scatter-adds its weighted outputs into ``out`` (the rows of one
    run are distinct tokens, so the scatter has unique, sorted indices and XLA:CPU runs it as
    fast as a row copy); the backward does the same with ``dy`` and ``dx``. Only the gate/up
    pre-activations ``[P, 2I]`` are kept between the passes: no padded copy of ``x``, of the
    outputs, of ``dy`` or of ``dx`` is ever stored.
    """
    return _block_loop_fwd(block_size, x_SD, comb_w_Sk, a_of_p_P, grp_start_E, grp_blocks_E, wg_EDI, wu_EDI,
                           wd_EID, False)[0]


def _blocked_ffn_fwd(block_size, x_SD, comb_w_Sk, wg_EDI, wu_EDI, wd_EID, out_idx_Sk, a_of_p_P, grp_start_E,
                     grp_blocks_E):
    out_SD, gu_P2I = _block_loop_fwd(block_size, x_SD, comb_w_Sk, a_of_p_P, grp_start_E, grp_blocks_E, wg_EDI,
                                     wu_EDI, wd_EID, True)
    return out_SD, (x_SD, comb_w_Sk, wg_EDI, wu_EDI, wd_EID, out_idx_Sk, a_of_p_P, grp_start_E, grp_blocks_E,
                    gu_P2I)


def _blocked_ffn_bwd(block_size, res, dout_SD):
    x_SD, comb_w_Sk, wg_EDI, wu_EDI, wd_EID, out_idx_Sk, a_of_p_P, grp_start_E, grp_blocks_E, gu_P2I = res
    n_src, k = comb_w_Sk.shape
    dt = x_SD.dtype
    f32 = jnp.float32
    n_rows = a_of_p_P.shape[0]
    i_dim = wg_EDI.shape[-1]
    dout_SD = dout_SD.astype(f32)
    comb_w_A = comb_w_Sk.reshape(-1)

    prep = functools.partial(_expert_weights, wg_EDI, wu_EDI, wd_EID, dt=dt)

    def body(r0, rows, e, ctx, carry):
        wgu_D2I, wd_ID = ctx
        dx_SD, d_w_P, dwg_EDI, dwu_EDI, dwd_EID = carry
        run = _Run(a_of_p_P, comb_w_A, n_src, k, r0, rows)
        x_QD = run.gather(x_SD)
        dy_QD = run.gather(dout_SD)  # unscaled: dy @ wd^T also gives the combine-weight gradient
        gu_Q2I = jax.lax.dynamic_slice_in_dim(gu_P2I, r0, rows, 0)
        g_QI, u_QI = gu_Q2I[:, :i_dim], gu_Q2I[:, i_dim:]
        sg_QI = jax.nn.sigmoid(g_QI)
        silu_QI = g_QI * sg_QI
        h_QI = (silu_QI * u_QI).astype(dt)
        dh0_QI = jnp.dot(dy_QD.astype(dt), wd_ID.T, preferred_element_type=f32)
        # d out / d comb_w[s, j] = <dy[s], y_row> = <dy[s] @ wd^T, h>
        d_w_P = jax.lax.dynamic_update_slice_in_dim(
            d_w_P, jnp.sum(dh0_QI * h_QI.astype(f32), axis=1), r0, 0
        )
        dh_QI = run.w_Q[:, None] * dh0_QI
        dgu_Q2I = jnp.concatenate([dh_QI * u_QI * sg_QI * (1 + g_QI * (1 - sg_QI)), dh_QI * silu_QI],
                                  axis=1).astype(dt)
        dx_SD = run.scatter_add(dx_SD, jnp.dot(dgu_Q2I, wgu_D2I.T, preferred_element_type=f32))
        dwgu_D2I = jnp.dot(x_QD.T, dgu_Q2I, preferred_element_type=f32)

        def acc(w_grad, upd):
            cur = jax.lax.dynamic_index_in_dim(w_grad, e, 0, False)
            return jax.lax.dynamic_update_index_in_dim(w_grad, cur + upd, e, 0)

        dys_QD = (run.w_Q[:, None] * dy_QD).astype(dt)
        dwd_EID = acc(dwd_EID, jnp.dot(h_QI.T, dys_QD, preferred_element_type=f32))
        dwg_EDI = acc(dwg_EDI, dwgu_D2I[:, :i_dim])
        dwu_EDI = acc(dwu_EDI, dwgu_D2I[:, i_dim:])
        return dx_SD, d_w_P, dwg_EDI, dwu_EDI, dwd_EID

    init = (
        _varying_zeros(x_SD.shape, f32, x_SD, wg_EDI, wu_EDI, wd_EID, dout_SD, a_of_p_P),
        _varying_zeros((n_rows,), f32, x_SD, wg_EDI, wu_EDI, wd_EID, dout_SD, a_of_p_P),
        _varying_zeros(wg_EDI.shape, f32, wg_EDI, x_SD, dout_SD, a_of_p_P),
        _varying_zeros(wu_EDI.shape, f32, wu_EDI, x_SD, dout_SD, a_of_p_P),
        _varying_zeros(wd_EID.shape, f32, wd_EID, x_SD, dout_SD, a_of_p_P),
    )
    dx_SD, d_w_P, dwg_EDI, dwu_EDI, dwd_EID = _for_each_run(n_rows, grp_start_E, grp_blocks_E, block_size, prep,
                                                            body, init)
    ok_Sk = out_idx_Sk < n_rows
    d_comb_Sk = jnp.where(ok_Sk, d_w_P[jnp.minimum(out_idx_Sk, n_rows - 1)], 0)
    grads = {"x": dx_SD.astype(x_SD.dtype), "combine_weights": d_comb_Sk.astype(comb_w_Sk.dtype),
             "gate_proj": dwg_EDI.astype(wg_EDI.dtype), "up_proj": dwu_EDI.astype(wu_EDI.dtype),
             "down_proj": dwd_EID.astype(wd_EID.dtype)}
    transform = _BACKWARD_TRANSFORM.get()
    if transform is not None:
        grads = transform(grads)
    return (grads["x"], grads["combine_weights"], grads["gate_proj"], grads["up_proj"], grads["down_proj"],
            None, None, None, None)


_blocked_ffn.defvjp(_blocked_ffn_fwd, _blocked_ffn_bwd)

_BACKWARD_TRANSFORM: contextvars.ContextVar[Callable[[dict], dict] | None] = contextvars.ContextVar(
    "blocked_backward_transform", default=None)


@contextlib.contextmanager
def transform_backward(fn: Callable[[dict], dict]):
    """While active, the blocked path's backward passes its cotangents, a dict with keys ``x``,
    ``combine_weights``, ``gate_proj``, ``up_proj``, ``down_proj``, through ``fn`` before
    returning them. The rule runs when jax *traces* the gradient, so ``fn`` applies to what is
    traced inside the ``with`` (a function traced before keeps its cached gradient). The seam
    for fault injection (parity/fault_hooks.py); the forward is untouched."""
    token = _BACKWARD_TRANSFORM.set(fn)
    try:
        yield
    finally:
        _BACKWARD_TRANSFORM.reset(token)


def blocked_swiglu_rows(x_sorted, group_sizes, weights, block_size):
    """Rows already grouped by expert through the same block-padded core (one assignment per row;
    rows past ``sum(group_sizes)`` have none and give 0)."""
    n = x_sorted.shape[0]
    e = weights["gate_proj"].shape[0]
    ends_E = jnp.cumsum(group_sizes.astype(jnp.int32))
    i_S = jnp.arange(n)
    expert_S = jnp.where(i_S < ends_E[-1], jnp.searchsorted(ends_E, i_S, side="right"), e)
    pos_S, a_of_p_P, grp_start_E, grp_blocks_E = _blocked_layout(expert_S, e, block_size)
    y_SD = _blocked_ffn(
        block_size, x_sorted, (expert_S < e).astype(jnp.float32)[:, None], weights["gate_proj"],
        weights["up_proj"], weights["down_proj"], pos_S[:, None], a_of_p_P, grp_start_E, grp_blocks_E,
    )
    return y_SD.astype(x_sorted.dtype)


def blocked_path(x, topk_idx, topk_weights, weights, moe_cfg):
    """blocked: assignments placed straight into expert-contiguous block-padded rows (no sort)."""
    t, k = topk_idx.shape
    bs = moe_cfg.block_size
    pos_A, a_of_p_P, grp_start_E, grp_blocks_E = _blocked_layout(topk_idx.reshape(-1), moe_cfg.n_experts, bs)
    y_TD = _blocked_ffn(
        bs, x, topk_weights.astype(jnp.float32), weights["gate_proj"], weights["up_proj"],
        weights["down_proj"], pos_A.reshape(t, k), a_of_p_P, grp_start_E, grp_blocks_E,
    )
    return y_TD.astype(x.dtype)


__all__ = ["RUN_ROWS", "blocked_path", "blocked_swiglu_rows", "transform_backward"]
