"""Expert-parallel dispatchers: the routed-expert FFN run inside ``jax.shard_map`` over the mesh.

The model calls ``dispatch(x, topk_idx, topk_weights, weights, moe_cfg, path=...)`` with the
signature of :func:`jaxmoe.model.experts.expert_ffn`, on *global* (jit-level) arrays, once per
MoE layer inside the layer scan. :func:`make_dispatch` returns such a callable. Inside it, one
``jax.shard_map`` sees per device:

* tokens ``x [T_l, D]``, ``topk_idx``/``topk_weights [T_l, k]``: the device's slice of the batch
  (tokens are split over ``replica x fsdp x expert``, replicated over ``tensor``);
* expert weights ``[E_l, D, I_t]`` / ``[E_l, I_t, D]``: its ``E_l = E / X`` experts, where X is
  the product of the expert-parallel axes (``mesh.expert_axes``: ``expert``, or ``fsdp x expert``
  to keep experts whole; device ``j`` of that product, major to minor, owns experts
  ``j*E_l ... (j+1)*E_l - 1``), gathered over ``fsdp`` at entry when fsdp is not expert-parallel
  (FSDP; autodiff reduce-scatters their gradients back), and split along ``I`` over ``tensor``
  (partial outputs are ``psum``-ed over ``tensor`` at the end). Every collective below runs over
  the expert-parallel axes (one name or the tuple ``("fsdp", "expert")``).

Dispatchers (``mesh.dispatcher``):

``all_to_all``
    Fixed capacity. Each device fills a ``[E, C, D]`` buffer (slot = expert, position in that
    expert's queue), one ``all_to_all`` over ``expert`` sends expert ``e``'s slots to its owner,
    the owner computes, a second ``all_to_all`` returns the results, the source combines.
    ``mesh.a2a_capacity_factor == 0``: ``C = T_l`` (the worst case, dropless). ``> 0``:
    ``C = ceil(cf * T_l * k / E)`` per *source device* (per chunk), filled by the LAYOUT.md
    priority rule (choice rank, then token index) among that device's tokens; the rest drop
    (contribute zero, other weights not renormalised; counted in ``dropped``, reported as
    ``dropped_frac``). The receive side then holds ``E * C`` rows per device: at most
    ``cf * T_l * k + E - 1`` (exactly ``cf * T_l * k`` when E divides it), i.e. ``cf`` times the
    balanced load, whatever the routing. Works on every backend.
``ragged_all_to_all``
    Dropless and sized to the real traffic: assignments are sorted by destination and sent with
    ``jax.lax.ragged_all_to_all`` (offsets exchanged with small all_to_alls). XLA:CPU does not
    implement the op, so it is picked automatically only off CPU and rejected on CPU. Its index
    arithmetic is tested on CPU by running the same code with an all_gather-based emulation of
    the collective (``ragged_all_to_all_emulated``, a test-only kind).
``allgather``
    All-gather tokens (and routing) over ``expert``, each device computes its own experts for
    every gathered token, and a ``psum_scatter`` (reduce-scatter) sums the partial outputs back
    to the token owners. Dropless. Moves ``expert x`` more activations but needs no index exchange.

``mesh.dispatch_chunks = n``: the device's tokens are cut into ``n`` chunks dispatched one after
another in an unrolled loop, so the scheduler can overlap one chunk's collectives with another's
compute (with ``xla_flags_profile = "gpu_overlap"`` on GPU). Dropless results are identical to the
unchunked ones; with a capacity factor the capacity applies per chunk.

Local compute on the received rows uses ``jaxmoe.model.experts.grouped_swiglu`` (rows sorted by
local expert) with ``moe.compute_path``'s grouped form (``ragged`` -> ``ragged_dot``, ``blocked``;
``dense`` has none and is refused when the mesh is built), so the work is proportional to the rows
actually received, not to the capacity buffer. Capacity, queue positions and the combine are the
ones of :mod:`jaxmoe.model.slots`.

Under a mesh, dropping is decided only by ``mesh.a2a_capacity_factor``; ``moe.capacity_factor``
belongs to the single-device ``dense`` path.

Gradients: ``all_to_all``, ``ragged_all_to_all``, ``all_gather`` and ``psum_scatter`` all have
transpose rules in JAX (all_to_all -> all_to_all with split/concat swapped; all_gather <->
psum_scatter), and ``shard_map`` sums the cotangent of an input that is replicated over an axis
(the expert weights over the batch axes) over that axis. ``check_vma`` is off (see
``CHECK_VMA``); the tests compare every parameter gradient with the single-device run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmoe.errors import UserError
from jaxmoe.model.experts import grouped_swiglu
from jaxmoe.model.slots import capacity, combine, slot_positions
from jaxmoe.parallel.sharding import expert_axes_of, logical_to_mesh_axes, mesh_axes

# Shape suffixes of local arrays (per device, per chunk): T tokens, D d_model, k top-k choices,
# A = T*k assignments, E experts, L = E_l local experts, X expert-parallel devices, C capacity
# slots per expert, R rows of a send/receive buffer, G = X*T gathered tokens, I expert FFN dim
# (this device's tensor shard), N rows of an operand.

# KINDS / TEST_KINDS: see DISPATCHERS (the table of implementations) at the end of the chunks

# Workaround (jax >= 0.7 shard_map typing): check_vma=True types every value by the manual mesh
# axes it varies over. The blocked expert path's loop carries are now built with that type
# (blocked._varying_zeros), but its custom VJP (blocked._blocked_ffn) still returns cotangents
# typed like the values they were computed from, not like the primal inputs: dx for tokens that
# are invariant over `tensor` comes back varying over `tensor` (measured: "Custom VJP bwd rule
# must produce an output with the same type as the args tuple", tests/test_dispatch.py, jax
# 0.10.2). Making that rule psum each cotangent over the axes its primal is invariant over would
# also move the reductions this module's callers do by hand, so the body runs with
# check_vma=False; the collectives' transposes are then JAX's unchecked ones, and
# tests/test_dispatch.py + tests/test_sharding.py verify every gradient (including the psum over
# replicated axes and over `tensor`) against the single-device run.
CHECK_VMA = False


# --------------------------------------------------------------------------------------------
# The rules of a dispatch, one function each: used by the trainer (jaxmoe.parallel.mesh, make_dispatch)
# and by the planner (jaxmoe.plan.memory, jaxmoe.plan.lower)
# --------------------------------------------------------------------------------------------


def check_dispatcher(kind: str, capacity_factor: float, platform: str | None = None, *,
                     concrete: bool = False) -> None:
    """Is ``kind`` (``mesh.dispatcher``, or the kind given to :func:`make_dispatch` when
    ``concrete``: not ``auto``) with ``mesh.a2a_capacity_factor`` valid? A UserError naming the
    key if not: the factor must be >= 0, ``ragged_all_to_all`` does not run on ``platform ==
    "cpu"`` (XLA:CPU; not checked when ``platform`` is None), and a factor > 0 needs the only
    dispatcher that drops, ``all_to_all`` (``auto`` then picks it)."""
    cf = capacity_factor
    if cf < 0:
        raise UserError(f"mesh.a2a_capacity_factor={cf} must be >= 0 (0 = dropless)")
    if kind == "auto" and not concrete:
        return
    if kind == "ragged_all_to_all" and platform == "cpu":
        raise UserError(
            "mesh.dispatcher='ragged_all_to_all' is not implemented by XLA:CPU; "
            "use mesh.dispatcher=all_to_all or allgather (or auto) on CPU"
        )
    if kind not in KINDS + TEST_KINDS:
        raise UserError(f"mesh.dispatcher={kind!r} is not one of: {'' if concrete else 'auto, '}{', '.join(KINDS)}")
    if cf > 0 and kind != "all_to_all":
        raise UserError(
            f"mesh.a2a_capacity_factor={cf} only applies to mesh.dispatcher=all_to_all "
            f"({kind} is dropless); set it to 0 or use all_to_all"
        )


def resolve_dispatcher(cfg, platform: str) -> str:
    """``mesh.dispatcher`` -> a concrete kind for this backend (checked by :func:`check_dispatcher`).

    ``auto``: ``all_to_all`` on CPU (and whenever ``mesh.a2a_capacity_factor > 0``, the only
    dispatcher that drops), ``ragged_all_to_all`` elsewhere."""
    want = cfg.mesh.dispatcher
    cf = cfg.mesh.a2a_capacity_factor
    check_dispatcher(want, cf, platform)
    if want == "auto":
        return "all_to_all" if (platform == "cpu" or cf > 0) else "ragged_all_to_all"
    return want


def check_expert_split(n_experts: int, ep_sizes: dict[str, int]) -> None:
    """The expert-parallel axes (``ep_sizes``: name -> size, in ``mesh.expert_axes`` order) must
    divide the experts (UserError)."""
    if n_experts % math.prod(ep_sizes.values()):
        what = "*".join(f"{a}={s}" for a, s in ep_sizes.items())
        one = len(ep_sizes) == 1
        raise UserError(
            f"mesh axis {what} does not divide moe.n_experts={n_experts}; choose "
            f"{'an expert axis size' if one else 'fsdp*expert sizes'} that divide{'s' if one else ''} {n_experts}"
            + ("" if one else " (or set mesh.expert_axes='expert')")
        )


def check_chunks(tokens: int, chunks: int) -> None:
    """``mesh.dispatch_chunks`` must divide a device's tokens per micro-batch (UserError)."""
    if tokens % chunks:
        raise UserError(
            f"mesh.dispatch_chunks={chunks} does not divide the {tokens} tokens per device per micro-batch"
        )


def check_fp8(recipe: str, mesh_shape: dict[str, int], ep: tuple[str, ...], chunks: int) -> None:
    """``compute.fp8`` under a mesh: its per-expert scales (jaxmoe/model/fp8.py) equal one device's
    only when an expert's owner computes every row of that expert at once, so the batch may be
    split over the expert-parallel axes only, the expert FFN not over ``tensor``, the tokens not
    into dispatch chunks; and ``blockwise``'s 128-token wgrad tiles follow the order rows arrive
    in, which is not one device's (choice rank, token) order. A UserError naming the key if not."""
    if recipe == "none":
        return
    outside = [f"{a}={mesh_shape[a]}" for a in mesh_axes("batch") if a not in ep and mesh_shape.get(a, 1) > 1]
    tensor = [f"{a}={mesh_shape[a]}" for a in mesh_axes("expert_mlp") if mesh_shape.get(a, 1) > 1]
    why = (f"the batch is split over {', '.join(outside)} outside the expert axes {'*'.join(ep)}" if outside
           else f"the expert FFN is split over {', '.join(tensor)}" if tensor
           else f"mesh.dispatch_chunks={chunks} cuts an expert's rows into chunks" if chunks > 1
           else "blockwise's 128-token tiles would follow the order rows arrive in" if recipe == "blockwise"
           else None)
    if why:
        raise UserError(f"compute.fp8={recipe!r} under this mesh would scale each expert's rows per shard "
                        f"({why}); use a mesh whose batch axes are all expert-parallel (mesh.expert_axes), "
                        "tensor=1, mesh.dispatch_chunks=1 and tensorwise or rowwise, or compute.fp8=none")


def receive_rows(kind: str, moe_cfg, n_x: int, tokens: int, capacity_factor: float) -> int:
    """Rows one device's expert FFN runs on for ``tokens`` of its tokens (one chunk), i.e. the
    size of the concrete dispatcher ``kind``'s receive buffer over ``n_x`` expert-parallel devices:
    ``all_to_all`` ``E * C`` (``C = capacity(cf)``, ``T`` when cf = 0); ``ragged_all_to_all`` the
    worst case ``X * T * min(k, E_l)`` (every source sends all its tokens here); ``allgather``
    ``X * T * k`` (every gathered assignment, ours or not)."""
    e, k = moe_cfg.n_experts, moe_cfg.top_k
    if kind == "all_to_all":
        return e * capacity(moe_cfg, tokens, factor=capacity_factor)
    if kind == "allgather":
        return n_x * tokens * k
    return n_x * tokens * min(k, e // n_x)  # ragged_all_to_all and its emulation


# --------------------------------------------------------------------------------------------
# Local pieces
# --------------------------------------------------------------------------------------------


def _local_compute(x_ND, src_R, expert_R, weights, n_local, path, moe_cfg):
    """SwiGLU of rows ``x_ND[src_R[r]]`` with local expert ``expert_R[r]``; rows whose expert is
    ``n_local`` (padding / not ours) give 0. Returns ``[R, D]``."""

    order_R = jnp.argsort(expert_R, stable=True)
    inverse_R = jnp.argsort(order_R)
    group_sizes_L = jnp.zeros((n_local,), jnp.int32).at[expert_R].add(1, mode="drop")
    x_sorted_RD = x_ND[src_R[order_R]]
    y_sorted_RD = grouped_swiglu(x_sorted_RD, group_sizes_L, weights, path=path, moe_cfg=moe_cfg)
    return y_sorted_RD[inverse_R]


# --------------------------------------------------------------------------------------------
# One chunk of each dispatcher (runs per device inside shard_map)
# --------------------------------------------------------------------------------------------


def _a2a_chunk(x_TD, idx_Tk, w_Tk, wl, *, n_exp, n_x, cf, path, moe_cfg, ax, **_):

    t, k = idx_Tk.shape
    d = x_TD.shape[-1]
    e_l = n_exp // n_x
    cap = capacity(moe_cfg, t, factor=cf)
    n_rows = receive_rows("all_to_all", moe_cfg, n_x, t, cf)  # R = E * C
    pos_Tk = slot_positions(idx_Tk, n_exp)
    keep_Tk = pos_Tk < cap
    slot_Tk = jnp.where(keep_Tk, idx_Tk * cap + pos_Tk, n_rows)  # dropped -> out of range
    # [E*C, D] send buffer, expert-major (= destination-major: expert e lives on e // E_l)
    rows_AD = jnp.broadcast_to(x_TD[:, None, :], (t, k, d)).reshape(t * k, d)
    send_RD = jnp.zeros((n_rows, d), x_TD.dtype).at[slot_Tk.reshape(-1)].add(rows_AD, mode="drop")
    kept_E = jnp.zeros((n_exp,), jnp.int32).at[slot_Tk.reshape(-1) // cap].add(1, mode="drop")
    recv_RD = jax.lax.all_to_all(send_RD, ax, 0, 0, tiled=True)  # [X(src), E_l, C, D] flat
    kept_XL = jax.lax.all_to_all(kept_E, ax, 0, 0, tiled=True).reshape(n_x, e_l)
    # slot (s, l, c) holds a real row iff c < kept_XL[s, l]
    valid_XLC = jnp.arange(cap)[None, None, :] < kept_XL[:, :, None]
    expert_R = jnp.where(valid_XLC, jnp.arange(e_l)[None, :, None], e_l).reshape(-1)
    y_RD = _local_compute(recv_RD, jnp.arange(recv_RD.shape[0]), expert_R, wl, e_l, path, moe_cfg)
    back_RD = jax.lax.all_to_all(y_RD, ax, 0, 0, tiled=True)  # my slots, computed
    y_TkD = back_RD.at[slot_Tk].get(mode="fill", fill_value=0)
    dropped = jnp.sum(~keep_Tk).astype(jnp.int32)
    return combine(y_TkD, w_Tk), dropped


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
    """Same contract as ``jax.lax.ragged_all_to_all``, built from ``all_gather`` + gathers so that
    it runs on XLA:CPU. For tests of the ragged dispatcher's offset arithmetic only: it moves
    the axis size times the data."""

    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(axis_name)
    operand_XND = jax.lax.all_gather(operand, axis_name)
    in_off_X = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # each sender's slice for me
    size_X = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off_X = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r_R = jnp.arange(output.shape[0])
    inside_XR = (r_R[None, :] >= out_off_X[:, None]) & (r_R[None, :] < (out_off_X + size_X)[:, None])
    sender_R = jnp.argmax(inside_XR, axis=0)
    hit_R = jnp.any(inside_XR, axis=0)
    src_R = jnp.clip(in_off_X[sender_R] + r_R - out_off_X[sender_R], 0, operand.shape[0] - 1)
    vals_RD = operand_XND[sender_R, src_R]
    return jnp.where(hit_R[:, None], vals_RD, output)


def _ragged_chunk(x_TD, idx_Tk, w_Tk, wl, *, n_exp, n_x, path, moe_cfg, ax, emulate=False, **_):

    t, k = idx_Tk.shape
    d = x_TD.shape[-1]
    e_l = n_exp // n_x
    n = t * k
    if emulate:
        ragged = functools.partial(ragged_all_to_all_emulated, axis_name=ax)
    else:
        ragged = functools.partial(jax.lax.ragged_all_to_all, axis_name=ax)
    expert_A = idx_Tk.reshape(-1)  # assignment a = token a // k, choice a % k
    order_A = jnp.argsort(expert_A, stable=True)  # by expert, hence by destination device
    inverse_A = jnp.argsort(order_A)
    x_send_AD = x_TD[order_A // k]
    count_E = jnp.zeros((n_exp,), jnp.int32).at[expert_A].add(1)
    send_sizes_X = count_E.reshape(n_x, e_l).sum(1)
    in_off_X = jnp.cumsum(send_sizes_X) - send_sizes_X
    count_XL = jax.lax.all_to_all(count_E, ax, 0, 0, tiled=True).reshape(n_x, e_l)  # [src, l]
    recv_sizes_X = count_XL.sum(1)
    sizes_XX = jax.lax.all_gather(send_sizes_X, ax)  # [src, dst]
    me = jax.lax.axis_index(ax)
    out_off_X = (jnp.cumsum(sizes_XX, 0) - sizes_XX)[me]  # where my slice lands on each dst
    r_max = receive_rows("ragged_all_to_all", moe_cfg, n_x, t, 0.0)
    recv_RD = ragged(x_send_AD, jnp.zeros((r_max, d), x_TD.dtype), in_off_X, send_sizes_X, out_off_X,
                     recv_sizes_X)
    # received rows: source-major, each source's rows sorted by local expert (counts count_XL[s, l])
    seg_end_XL = jnp.cumsum(count_XL.reshape(-1))  # flat [X * E_l]
    r_R = jnp.arange(r_max)
    seg_R = jnp.searchsorted(seg_end_XL, r_R, side="right")
    expert_R = jnp.where(r_R < seg_end_XL[-1], seg_R % e_l, e_l)
    y_RD = _local_compute(recv_RD, r_R, expert_R, wl, e_l, path, moe_cfg)
    recv_off_X = jnp.cumsum(recv_sizes_X) - recv_sizes_X
    back_off_X = jax.lax.all_to_all(in_off_X, ax, 0, 0, tiled=True)  # src's offset for me
    back_AD = ragged(y_RD, jnp.zeros((n, d), x_TD.dtype), recv_off_X, recv_sizes_X, back_off_X, send_sizes_X)
    y_TkD = back_AD[inverse_A].reshape(t, k, d)
    return combine(y_TkD, w_Tk), jnp.zeros((), jnp.int32)


def _allgather_chunk(x_TD, idx_Tk, w_Tk, wl, *, n_exp, n_x, path, moe_cfg, ax, **_):

    t, k = idx_Tk.shape
    e_l = n_exp // n_x
    x_GD = jax.lax.all_gather(x_TD, ax, axis=0, tiled=True)  # G = X * T gathered tokens
    idx_Gk = jax.lax.all_gather(idx_Tk, ax, axis=0, tiled=True)
    w_Gk = jax.lax.all_gather(w_Tk, ax, axis=0, tiled=True)
    me = jax.lax.axis_index(ax)
    local_Gk = idx_Gk - me * e_l
    mine_Gk = (local_Gk >= 0) & (local_Gk < e_l)
    expert_R = jnp.where(mine_Gk, local_Gk, e_l).reshape(-1)  # row r = assignment r of token r // k
    src_R = jnp.arange(expert_R.shape[0]) // k
    y_RD = _local_compute(x_GD, src_R, expert_R, wl, e_l, path, moe_cfg)
    part_GD = combine(y_RD.reshape(n_x * t, k, -1), jnp.where(mine_Gk, w_Gk, 0.0))  # fp32
    y_TD = jax.lax.psum_scatter(part_GD, ax, scatter_dimension=0, tiled=True)
    return y_TD, jnp.zeros((), jnp.int32)


# The table of dispatchers (mesh.dispatcher; "auto" is resolved per backend by resolve_dispatcher).
# Each entry runs one chunk of one device's tokens inside shard_map.
DISPATCHERS = {
    "all_to_all": _a2a_chunk,
    "ragged_all_to_all": _ragged_chunk,
    "allgather": _allgather_chunk,
    # test-only: the ragged dispatcher's index arithmetic with an all_gather emulation of the
    # collective, so that it runs on XLA:CPU
    "ragged_all_to_all_emulated": functools.partial(_ragged_chunk, emulate=True),
}
KINDS = ("all_to_all", "ragged_all_to_all", "allgather")
TEST_KINDS = ("ragged_all_to_all_emulated",)


def _check_table() -> None:
    import typing

    from jaxmoe.config.schema import MeshConfig

    declared = set(typing.get_args(typing.get_type_hints(MeshConfig)["dispatcher"])) - {"auto"}
    assert declared == set(KINDS) and set(DISPATCHERS) == set(KINDS + TEST_KINDS)


_check_table()


# --------------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------------


def make_dispatch(cfg, mesh, kind: str):
    """A callable with ``expert_ffn``'s signature running ``kind`` over ``mesh``."""

    check_dispatcher(kind, cfg.mesh.a2a_capacity_factor, concrete=True)
    chunk_fn = DISPATCHERS[kind]
    ep = expert_axes_of(getattr(cfg.mesh, "expert_axes", "expert"))
    check_fp8(cfg.compute.fp8, dict(mesh.shape), ep, cfg.mesh.dispatch_chunks)
    # collectives run over the product of the expert-parallel axes (one name or a tuple of them;
    # device j of that product, major to minor in `ep` order, owns experts j*E_l ... (j+1)*E_l-1)
    ax = ep[0] if len(ep) == 1 else ep
    n_x = math.prod(mesh.shape[a] for a in ep)
    n_chunks = cfg.mesh.dispatch_chunks
    cf = cfg.mesh.a2a_capacity_factor
    # shard_map specs from the rules table: tokens split like the batch; expert weights by their
    # declared axes ("experts", "expert_embed", "expert_mlp") except D, which enters whole
    # (gathered over fsdp when fsdp is not in ep)
    tok = logical_to_mesh_axes(("batch", None))
    w_in = logical_to_mesh_axes(("experts", None, "expert_mlp"), ep)  # gate/up [E, D, I]
    w_out = logical_to_mesh_axes(("experts", "expert_mlp", None), ep)  # down [E, I, D]
    tp = mesh_axes("expert_mlp")  # the I shards' partial outputs are summed over these
    batch = mesh_axes("batch")

    def dispatch(x, topk_idx, topk_weights, weights, moe_cfg, *, path=None):
        local_path = path or moe_cfg.compute_path  # its grouped form runs on the received rows
        n_exp = weights["gate_proj"].shape[0]
        check_expert_split(n_exp, {a: mesh.shape[a] for a in ep})

        def body(x_TD, idx_Tk, w_Tk, wg_LDI, wu_LDI, wd_LID):
            t = x_TD.shape[0]
            check_chunks(t, n_chunks)
            wl = {"gate_proj": wg_LDI, "up_proj": wu_LDI, "down_proj": wd_LID}
            one = functools.partial(chunk_fn, n_exp=n_exp, n_x=n_x, path=local_path,
                                    moe_cfg=moe_cfg, cf=cf, ax=ax)
            tc = t // n_chunks
            ys, dropped = [], jnp.zeros((), jnp.int32)
            for c in range(n_chunks):  # unrolled: chunk c's collectives can overlap c+1's compute
                sl = slice(c * tc, (c + 1) * tc)
                yc, dc = one(x_TD[sl], idx_Tk[sl], w_Tk[sl], wl)
                ys.append(yc)
                dropped = dropped + dc
            y_TD = ys[0] if n_chunks == 1 else jnp.concatenate(ys, 0)
            y_TD = jax.lax.psum(y_TD, tp)  # partial sums over the I shards (no-op if tensor=1)
            counts_E = jnp.zeros((n_exp,), jnp.int32).at[idx_Tk.reshape(-1)].add(1)
            counts_E = jax.lax.psum(counts_E, batch)
            dropped = jax.lax.psum(dropped, batch)
            return y_TD.astype(x_TD.dtype), counts_E, dropped

        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(tok, tok, tok, w_in, w_in, w_out),
            out_specs=(tok, P(), P()),
            check_vma=CHECK_VMA,
        )
        y, counts, dropped = f(
            x, topk_idx, topk_weights.astype(jnp.float32),
            weights["gate_proj"], weights["up_proj"], weights["down_proj"],
        )
        return y, {"counts": counts, "dropped": dropped}

    dispatch.kind = kind
    dispatch.mesh = mesh
    return dispatch


__all__ = ["KINDS", "check_chunks", "check_dispatcher", "check_fp8", "check_expert_split", "make_dispatch",
           "ragged_all_to_all_emulated", "receive_rows", "resolve_dispatcher"]
