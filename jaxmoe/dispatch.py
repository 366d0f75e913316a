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
from jaxmoe.sharding import expert_axes_of, logical_to_mesh_axes, mesh_axes

# KINDS / TEST_KINDS: see DISPATCHERS (the table of implementations) at the end of the chunks

# Workaround (jax >= 0.7 shard_map typing): check_vma=True types every value by the manual mesh
# axes it varies over. The blocked expert path's loop carries are now built with that type
# (experts._varying_zeros), but its custom VJP (experts._blocked_ffn) still returns cotangents
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
# The rules of a dispatch, one function each: used by the trainer (jaxmoe.mesh, make_dispatch)
# and by the planner (jaxmoe.plan, jaxmoe.plan_lower)
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


def _local_compute(x_src, src_row, row_expert, weights, n_local, path, moe_cfg):
    """SwiGLU of rows ``x_src[src_row[i]]`` with local expert ``row_expert[i]``; rows whose
    expert is ``n_local`` (padding / not ours) give 0. Returns ``[len(src_row), D]``."""

    order = jnp.argsort(row_expert, stable=True)
    inverse = jnp.argsort(order)
    group_sizes = jnp.zeros((n_local,), jnp.int32).at[row_expert].add(1, mode="drop")
    x_sorted = x_src[src_row[order]]
    y_sorted = grouped_swiglu(x_sorted, group_sizes, weights, path=path, moe_cfg=moe_cfg)
    return y_sorted[inverse]


# --------------------------------------------------------------------------------------------
# One chunk of each dispatcher (runs per device inside shard_map)
# --------------------------------------------------------------------------------------------


def _a2a_chunk(x, idx, w, wl, *, n_exp, n_x, cf, path, moe_cfg, ax, **_):

    t, k = idx.shape
    d = x.shape[-1]
    e_l = n_exp // n_x
    cap = capacity(moe_cfg, t, factor=cf)
    n_rows = receive_rows("all_to_all", moe_cfg, n_x, t, cf)  # E * C
    pos = slot_positions(idx, n_exp)
    keep = pos < cap
    slot = jnp.where(keep, idx * cap + pos, n_rows)  # dropped -> out of range
    # [E*C, D] send buffer, expert-major (= destination-major: expert e lives on e // E_l)
    rows = jnp.broadcast_to(x[:, None, :], (t, k, d)).reshape(t * k, d)
    buf = jnp.zeros((n_rows, d), x.dtype).at[slot.reshape(-1)].add(rows, mode="drop")
    kept = jnp.zeros((n_exp,), jnp.int32).at[slot.reshape(-1) // cap].add(1, mode="drop")
    recv = jax.lax.all_to_all(buf, ax, 0, 0, tiled=True)  # [X(src), E_l, C, D] flat
    rc = jax.lax.all_to_all(kept, ax, 0, 0, tiled=True).reshape(n_x, e_l)
    # slot (s, l, c) holds a real row iff c < rc[s, l]
    valid = jnp.arange(cap)[None, None, :] < rc[:, :, None]
    row_e = jnp.where(valid, jnp.arange(e_l)[None, :, None], e_l).reshape(-1)
    y_rows = _local_compute(recv, jnp.arange(recv.shape[0]), row_e, wl, e_l, path, moe_cfg)
    back = jax.lax.all_to_all(y_rows, ax, 0, 0, tiled=True)  # my slots, computed
    y_assign = back.at[slot].get(mode="fill", fill_value=0)  # [T, k, D]
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return combine(y_assign, w), dropped


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
    """Same contract as ``jax.lax.ragged_all_to_all``, built from ``all_gather`` + gathers so that
    it runs on XLA:CPU. For tests of the ragged dispatcher's offset arithmetic only: it moves
    the axis size times the data."""

    del recv_sizes  # implied by the senders' send_sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [X, N, D]
    io = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # each sender's slice for me
    ss = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    oo = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0])
    inside = (r[None, :] >= oo[:, None]) & (r[None, :] < (oo + ss)[:, None])  # [X, R]
    s = jnp.argmax(inside, axis=0)
    hit = jnp.any(inside, axis=0)
    src = jnp.clip(io[s] + r - oo[s], 0, operand.shape[0] - 1)
    vals = ops[s, src]
    return jnp.where(hit[:, None], vals, output)


def _ragged_chunk(x, idx, w, wl, *, n_exp, n_x, path, moe_cfg, ax, emulate=False, **_):

    t, k = idx.shape
    d = x.shape[-1]
    e_l = n_exp // n_x
    n = t * k
    if emulate:
        ragged = functools.partial(ragged_all_to_all_emulated, axis_name=ax)
    else:
        ragged = functools.partial(jax.lax.ragged_all_to_all, axis_name=ax)
    flat_e = idx.reshape(-1)  # assignment a = token a // k, choice a % k
    order = jnp.argsort(flat_e, stable=True)  # by expert, hence by destination device
    inverse = jnp.argsort(order)
    x_send = x[order // k]
    cnt = jnp.zeros((n_exp,), jnp.int32).at[flat_e].add(1)
    send_sizes = cnt.reshape(n_x, e_l).sum(1)
    in_off = jnp.cumsum(send_sizes) - send_sizes
    rc = jax.lax.all_to_all(cnt, ax, 0, 0, tiled=True).reshape(n_x, e_l)  # [src, l]
    recv_sizes = rc.sum(1)
    sizes_all = jax.lax.all_gather(send_sizes, ax)  # [src, dst]
    me = jax.lax.axis_index(ax)
    out_off = (jnp.cumsum(sizes_all, 0) - sizes_all)[me]  # where my slice lands on each dst
    r_max = receive_rows("ragged_all_to_all", moe_cfg, n_x, t, 0.0)
    recv = ragged(x_send, jnp.zeros((r_max, d), x.dtype), in_off, send_sizes, out_off, recv_sizes)
    # received rows: source-major, each source's rows sorted by local expert (counts rc[s, l])
    seg_end = jnp.cumsum(rc.reshape(-1))
    r = jnp.arange(r_max)
    seg = jnp.searchsorted(seg_end, r, side="right")
    row_e = jnp.where(r < seg_end[-1], seg % e_l, e_l)
    y_rows = _local_compute(recv, r, row_e, wl, e_l, path, moe_cfg)
    recv_off = jnp.cumsum(recv_sizes) - recv_sizes
    back_off = jax.lax.all_to_all(in_off, ax, 0, 0, tiled=True)  # src's offset for me
    back = ragged(y_rows, jnp.zeros((n, d), x.dtype), recv_off, recv_sizes, back_off, send_sizes)
    y_assign = back[inverse].reshape(t, k, d)
    return combine(y_assign, w), jnp.zeros((), jnp.int32)


def _allgather_chunk(x, idx, w, wl, *, n_exp, n_x, path, moe_cfg, ax, **_):

    t, k = idx.shape
    e_l = n_exp // n_x
    xg = jax.lax.all_gather(x, ax, axis=0, tiled=True)  # [X*T, D]
    ig = jax.lax.all_gather(idx, ax, axis=0, tiled=True)
    wg = jax.lax.all_gather(w, ax, axis=0, tiled=True)
    me = jax.lax.axis_index(ax)
    le = ig - me * e_l
    mine = (le >= 0) & (le < e_l)
    row_e = jnp.where(mine, le, e_l).reshape(-1)  # assignment a = token a // k
    src = jnp.arange(row_e.shape[0]) // k
    y_rows = _local_compute(xg, src, row_e, wl, e_l, path, moe_cfg)
    part = combine(y_rows.reshape(n_x * t, k, -1), jnp.where(mine, wg, 0.0))  # [X*T, D] fp32
    y = jax.lax.psum_scatter(part, ax, scatter_dimension=0, tiled=True)
    return y, jnp.zeros((), jnp.int32)


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

    from jaxmoe.schema import MeshConfig

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

        def body(x, idx, w, wg, wu, wd):
            t = x.shape[0]
            check_chunks(t, n_chunks)
            wl = {"gate_proj": wg, "up_proj": wu, "down_proj": wd}
            one = functools.partial(chunk_fn, n_exp=n_exp, n_x=n_x, path=local_path,
                                    moe_cfg=moe_cfg, cf=cf, ax=ax)
            tc = t // n_chunks
            ys, dropped = [], jnp.zeros((), jnp.int32)
            for c in range(n_chunks):  # unrolled: chunk c's collectives can overlap c+1's compute
                sl = slice(c * tc, (c + 1) * tc)
                yc, dc = one(x[sl], idx[sl], w[sl], wl)
                ys.append(yc)
                dropped = dropped + dc
            y = ys[0] if n_chunks == 1 else jnp.concatenate(ys, 0)
            y = jax.lax.psum(y, tp)  # partial sums over the I shards (no-op if tensor=1)
            counts = jnp.zeros((n_exp,), jnp.int32).at[idx.reshape(-1)].add(1)
            counts = jax.lax.psum(counts, batch)
            dropped = jax.lax.psum(dropped, batch)
            return y.astype(x.dtype), counts, dropped

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


__all__ = ["KINDS", "check_chunks", "check_dispatcher", "check_expert_split", "make_dispatch",
           "ragged_all_to_all_emulated", "receive_rows", "resolve_dispatcher"]
