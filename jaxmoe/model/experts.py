"""Routed experts: the stacked expert weights (an NNX module) and the expert compute paths.

``expert_ffn(x, topk_idx, topk_weights, weights, moe_cfg, path=...)`` is the single-device entry
point: every (token, expert) assignment through that expert's SwiGLU, then the fp32 combine.
Expert-parallel dispatchers (:mod:`jaxmoe.parallel.expert_dispatch`) have the same signature and take its place
in :class:`Experts` when the model is placed on a mesh. The
paths are equal in output and gradients (tests/test_experts.py); :data:`PATHS` is the table of
implementations, and says for each whether it can run under a mesh (on rows already grouped by
expert, which is what a dispatcher receives):

``dense``
    One-hot dispatch/combine einsums with a per-expert capacity ``C`` (:func:`slots.capacity`;
    ``capacity_factor == 0`` = dropless). ``O(T * E * C * D)``: for tests and small shapes, and
    the only single-device path that drops. No grouped form: not under a mesh (there, dropping
    is ``mesh.a2a_capacity_factor``).
``ragged``
    Sort assignments by expert, then a grouped matmul per projection (dropless), by
    ``moe.ragged_kernel`` (:mod:`jaxmoe.model.grouped_gemm`): ``xla`` = ``jax.lax.ragged_dot``,
    native on TPU; elsewhere (jax 0.10-0.11) lowered densely, through a ``[E, rows, K]`` masked
    copy of its operand, E times the memory and FLOPs of the work (docs/MEASUREMENTS.md, "GPU").
    ``mosaic_gpu`` = jax's Hopper grouped-GEMM kernels (bf16; not yet run on a GPU by this
    project). On CPU use ``blocked``.
``blocked``
    Dropless and fast on CPU: block-padded per-expert runs of plain matmuls with a hand-written
    backward (:mod:`jaxmoe.model.blocked`).

The combine is always accumulated in fp32 and cast once to ``x.dtype``. An expert that receives
no tokens gets exactly zero weight gradient on every path.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config.schema import ModelConfig, MoEConfig
from jaxmoe.model import fp8
from jaxmoe.model.blocked import blocked_path, blocked_swiglu_rows
from jaxmoe.model.grouped_gemm import concrete_kernel, grouped_matmul
from jaxmoe.model.params import ExpertLinear, builds, normal, stack_axes
from jaxmoe.model.slots import capacity, combine, expert_counts, slot_positions

# ---------------------------------------------------------------------------------------------
# dense: capacity einsums
# ---------------------------------------------------------------------------------------------


def _batched_swiglu(xe: jax.Array, weights: dict, valid: jax.Array | None = None) -> jax.Array:
    """SwiGLU on ``[E, C, D]`` slots with stacked weights; returns ``[E, C, D]`` in ``xe.dtype``.
    Under ``compute.fp8`` each projection is :func:`jaxmoe.model.fp8.fp8_grouped_matmul` with
    per-expert scales over the ``valid [E, C]`` slots only (filled slots; the rest never reach an amax)."""
    dt = xe.dtype
    f32 = jnp.float32
    recipe = fp8.current()
    if recipe != "none":
        return fp8.swiglu(xe, weights["gate_proj"], weights["up_proj"], weights["down_proj"],
                          lambda a, w: fp8.fp8_grouped_matmul(a, w, recipe, valid))
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
    comb = jnp.einsum("tk,tke,tkc->tec", topk_weights.astype(jnp.float32), oh_e, oh_c)
    xe = jnp.einsum("tec,td->ecd", dispatch.astype(x.dtype), x)
    filled = jnp.einsum("tec->ec", dispatch) > 0  # slots holding a token (fp8 scales see only these)
    ye = _batched_swiglu(xe, weights, filled)
    y = jnp.einsum("tec,ecd->td", comb, ye.astype(jnp.float32))
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return y.astype(x.dtype), dropped



# ---------------------------------------------------------------------------------------------
# ragged: sort by expert + ragged_dot
# ---------------------------------------------------------------------------------------------


def ragged_swiglu(x_sorted, group_sizes, weights, kernel="xla"):
    """SwiGLU of expert-grouped rows by grouped matmuls (``moe.ragged_kernel``: xla, mosaic_gpu, tokamax)."""
    dt = x_sorted.dtype
    f32 = jnp.float32
    wg, wu, wd = weights["gate_proj"], weights["up_proj"], weights["down_proj"]
    kernel = concrete_kernel(kernel)
    if kernel == "xla":  # gate and up as two dots (the parity suites' numbers are of this form)
        g, u = (grouped_matmul(x_sorted, w, group_sizes, kernel) for w in (wg, wu))
    else:  # gate and up side by side: one grouped GEMM of twice the width
        gu = grouped_matmul(x_sorted, jnp.concatenate([wg, wu], axis=-1), group_sizes, kernel)
        g, u = gu[:, : wg.shape[-1]], gu[:, wg.shape[-1]:]
    h = jax.nn.silu(g.astype(f32)) * u.astype(f32)
    return grouped_matmul(h.astype(dt), wd, group_sizes, kernel).astype(dt)



def _ragged_path(x, topk_idx, topk_weights, weights, moe_cfg):
    return _sorted_path(x, topk_idx, topk_weights, weights, moe_cfg, "ragged"), jnp.zeros((), jnp.int32)


def _blocked_tokens(x, topk_idx, topk_weights, weights, moe_cfg):
    if fp8.current() != "none":  # the blocked loops' hand-written backward has no fp8 form: rows by sort
        return _sorted_path(x, topk_idx, topk_weights, weights, moe_cfg, "blocked"), jnp.zeros((), jnp.int32)
    return blocked_path(x, topk_idx, topk_weights, weights, moe_cfg), jnp.zeros((), jnp.int32)


def _blocked_rows(x_sorted, group_sizes, weights, moe_cfg):
    return blocked_swiglu_rows(x_sorted, group_sizes, weights, moe_cfg.block_size)


def _ragged_rows(x_sorted, group_sizes, weights, moe_cfg):
    return ragged_swiglu(x_sorted, group_sizes, weights, moe_cfg.ragged_kernel)


# ---------------------------------------------------------------------------------------------
# The table of paths (moe.compute_path)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertPath:
    """One expert compute path. ``tokens(x, idx, w, weights, moe_cfg) -> (y [T, D] x.dtype,
    dropped)``; ``rows(x_sorted, group_sizes, weights, moe_cfg) -> [N, D]`` on rows grouped by
    expert (what a dispatcher runs under a mesh), or None when the path has no such form."""

    tokens: Callable
    rows: Callable | None
    drops: bool


PATHS: dict[str, ExpertPath] = {
    "dense": ExpertPath(_dense_path, rows=None, drops=True),
    "ragged": ExpertPath(_ragged_path, rows=_ragged_rows, drops=False),
    "blocked": ExpertPath(_blocked_tokens, rows=_blocked_rows, drops=False),
}
# the config declares the choices; this table must implement exactly those
assert set(PATHS) | {"auto"} == set(typing.get_args(typing.get_type_hints(MoEConfig)["compute_path"]))


def get_path(name: str, *, under_mesh: bool = False) -> ExpertPath:
    if name not in PATHS:
        raise ValueError(f"unknown moe.compute_path {name!r}; use one of {', '.join(PATHS)}")
    path = PATHS[name]
    if under_mesh and path.rows is None:
        usable = ", ".join(k for k, v in PATHS.items() if v.rows is not None)
        raise ValueError(f"moe.compute_path={name!r} cannot run under an expert-parallel mesh "
                         f"(it has no form on rows grouped by expert); use one of {usable}")
    return path


def grouped_swiglu(x_sorted, group_sizes, weights, *, path, moe_cfg):
    """SwiGLU of rows already sorted by expert.

    ``x_sorted [N, D]``: group ``e`` is ``group_sizes[e]`` contiguous rows, groups in expert order;
    rows past ``sum(group_sizes)`` are padding and produce 0. ``weights``: ``gate_proj``/``up_proj``
    ``[E, D, I]``, ``down_proj [E, I, D]``. ``path``: one with a grouped form (ragged, blocked);
    ``moe_cfg`` gives its options (``block_size``, ``ragged_kernel``). Returns ``[N, D]`` in
    ``x_sorted.dtype``.

    Under compute.fp8 every grouped form is :func:`jaxmoe.model.fp8.ragged_swiglu` (``lax.ragged_dot``
    on quantised operands, per-expert scales over the valid rows only), whatever ``moe.block_size`` /
    ``moe.ragged_kernel`` say (config/load.py refuses an explicit mosaic_gpu / tokamax kernel with fp8).
    """
    impl = get_path(path, under_mesh=True)
    if (recipe := fp8.current()) != "none":
        return fp8.ragged_swiglu(x_sorted, group_sizes, weights, recipe)
    return impl.rows(x_sorted, group_sizes, weights, moe_cfg)


def _sorted_path(x, topk_idx, topk_weights, weights, moe_cfg, path):
    """ragged: stable sort of the T*k assignments by expert, grouped SwiGLU, unsort, combine.

    Under compute.fp8 the assignments are taken in (choice rank, token) order, the order of the
    dense path's slots (:func:`slot_positions`), so blockwise's 128-token tiles of the weight
    gradient hold the same rows on every path."""
    t, k = topk_idx.shape
    rank_major = fp8.current() != "none"
    flat_e = (topk_idx.T if rank_major else topk_idx).reshape(-1)  # a = j * T + t, else t * k + j
    order = jnp.argsort(flat_e, stable=True)
    inverse = jnp.argsort(order)
    x_sorted = x[order % t] if rank_major else x[order // k]
    group_sizes = expert_counts(topk_idx, moe_cfg.n_experts)
    y_sorted = grouped_swiglu(x_sorted, group_sizes, weights, path=path, moe_cfg=moe_cfg)
    y_assign = y_sorted[inverse]
    y_assign = y_assign.reshape(k, t, -1).transpose(1, 0, 2) if rank_major else y_assign.reshape(t, k, -1)
    return combine(y_assign, topk_weights).astype(x.dtype)




def expert_ffn(x, topk_idx, topk_weights, weights, moe_cfg: MoEConfig, *, path=None):
    """Routed-expert FFN for tokens ``x [T, D]`` (compute dtype).

    ``topk_idx [T, k]`` int (a token's k experts are distinct, as top-k selection gives them; the
    blocked path relies on it), ``topk_weights [T, k]`` fp32, ``weights`` stacked per expert
    (``gate_proj``/``up_proj [E, D, I]``, ``down_proj [E, I, D]``). ``path`` defaults to
    ``moe_cfg.compute_path``. Returns ``y [T, D]`` in ``x.dtype`` and
    ``stats = {"counts": [E] int32 (before dropping), "dropped": int32 scalar}``.
    """
    impl = get_path(path or moe_cfg.compute_path)
    y, dropped = impl.tokens(x, topk_idx, topk_weights, weights, moe_cfg)
    return y, {"counts": expert_counts(topk_idx, moe_cfg.n_experts), "dropped": dropped}


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


class Experts(nnx.Module):
    """The routed experts of one MoE layer: ``gate_proj``/``up_proj [E, D, I]``,
    ``down_proj [E, I, D]``, and the function that runs them, ``dispatch``: :func:`expert_ffn`
    (one device) unless the model was built placed on a mesh, where it is that mesh's
    expert-parallel dispatcher (:func:`jaxmoe.parallel.expert_dispatch.make_dispatch`, same signature). The
    dispatcher is static structure of the module (part of its graphdef), not a call argument:
    ``experts(x, topk_idx, topk_weights)`` is the whole call."""

    @builds
    def __init__(self, m: ModelConfig, e: MoEConfig, *, stack: tuple = (), rngs: nnx.Rngs,
                 dispatch: Callable | None = None):
        shape_in = stack + (e.n_experts, m.d_model, e.expert_ffn_dim)
        shape_out = stack + (e.n_experts, e.expert_ffn_dim, m.d_model)
        ax_in = stack_axes(stack, ("experts", "expert_embed", "expert_mlp"))
        ax_out = stack_axes(stack, ("experts", "expert_mlp", "expert_embed"))
        self.moe_cfg = e
        self.dispatch = dispatch if dispatch is not None else expert_ffn
        self.gate_proj = ExpertLinear.declare(shape_in, ax_in, normal(m.init_std))
        self.up_proj = ExpertLinear.declare(shape_in, ax_in, normal(m.init_std))
        self.down_proj = ExpertLinear.declare(shape_out, ax_out, normal(m.init_std))

    def weights(self) -> dict:
        return {"gate_proj": self.gate_proj.get_value(), "up_proj": self.up_proj.get_value(),
                "down_proj": self.down_proj.get_value()}

    def __call__(self, x, topk_idx, topk_weights):
        """``x [T, D]``, ``topk_idx``/``topk_weights [T, k]`` -> ``(y [T, D], stats)`` (see
        :func:`expert_ffn`)."""
        return self.dispatch(x, topk_idx, topk_weights, self.weights(), self.moe_cfg)


__all__ = ["ExpertPath", "Experts", "PATHS", "capacity", "expert_ffn", "get_path", "grouped_swiglu", "ragged_swiglu",
           "slot_positions"]
