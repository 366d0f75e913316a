"""FP8 matmuls (``compute.fp8``): quantise-dequantise with current (just-in-time) scaling.

Every operand of every GEMM of a covered matmul -- forward ``y = x @ w``, input gradient
``dx = g @ w^T``, weight gradient ``dw = x^T @ g`` -- is quantised to ``float8_e4m3fn`` (max 448;
the gradient ``g`` to ``float8_e5m2``, max 57344, under tensorwise) with scales computed from the
operand itself at that moment (no amax history), then dequantised, and the product is taken in
fp32 (``preferred_element_type=float32``: fp32 accumulation). On CPU this *simulates* an FP8 GEMM:
the values are exactly the FP8 grid times the scale, the arithmetic is fp32. On GPU the same graph
(``convert(f8) -> multiply(scale) -> dot``) is the pattern XLA's GEMM rewriter can fuse into a
cuBLASLt FP8 GEMM for one scale per operand (tensorwise); per-row / per-tile scales are not fused
by XLA in jax 0.10 and stay a dequantise + fp32 dot (issue 40 item 4 is open).

Recipes (the scale of an operand is ``fmax / amax`` over its scaling group, the operand is
``clip(x * scale, -fmax, fmax)`` rounded to the format (round to nearest even) and dequantised as
``q * (1 / scale)``; an all-zero group gets scale 1, never NaN; amax is clamped below at 1e-12 as
torchao does):

* ``tensorwise`` -- torchao 0.18's ``Float8LinearConfig.from_recipe_name("tensorwise")``: one
  scale per tensor (per expert for stacked expert weights and per expert's rows for expert
  activations), exact ``fmax / amax`` (``round_scales_to_power_of_2=False``), e4m3 for inputs and
  weights, **e5m2 for grad_output** in both backward GEMMs (its ``cast_config_grad_output``).
  Checked against torchao's ``Float8Linear(emulate=True)`` in tests/test_fp8_torchao.py.
* ``rowwise`` -- torchao's ``"rowwise"``: one scale per row of the operand along the GEMM's
  contraction axis (forward: per token row of ``x``, per output column of ``w``; dgrad: per row of
  ``g``, per input row of ``w``; wgrad: per feature column of ``x`` and of ``g``, over tokens),
  scales rounded down to a power of two, e4m3 for all three GEMMs.
* ``blockwise`` -- DeepSeek-V3 (arXiv 2412.19437 section 3.3): activations and gradients in 1x128
  tiles along the contraction axis (so 128x1 over tokens in the weight gradient), weights in
  128x128 blocks (the same blocks serve the forward and the transposed dgrad), exact ``448 / amax``,
  e4m3 for all, fp32 accumulation. A dimension below 128 is one tile.

Valid rows (MaxText #4971): an expert buffer's rows past an expert's count (capacity or padding
tails) may hold anything. ``valid [M]`` masks them: they are zeroed *before* any amax and before the
matmul (so their garbage -- inf, NaN, 1e30 -- reaches neither a scale nor a product nor a weight
gradient), and their gradient rows are zero.

The router, norms, embeddings and the LM head never come here (``jaxmoe.model.router`` and
``transformer.Transformer.__call__`` use their own fp32 / compute-dtype einsums). torchtitan 0.3.0's
float8 converter converts every Linear by default (``filter_fqns=[]``, dims divisible by 16), but its
float8 configs filter them: ``["lm_head"]`` (llama3), ``["lm_head", "router.gate"]`` (deepseek_v3).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
E4M3_MAX = 448.0
E5M2_MAX = 57344.0  # float8_e5m2: tensorwise's gradient format (torchao's default recipe)
BLOCK = 128  # DeepSeek-V3's tile / block edge
AMAX_EPS = 1e-12  # torchao's EPS: amax is clamped to at least this before 448 / amax

# per recipe: power-of-two scales? gradients (grad_output, both backward GEMMs) in e5m2?
_POW2 = {"tensorwise": False, "rowwise": True, "blockwise": False}
_GRAD_E5M2 = {"tensorwise": True, "rowwise": False, "blockwise": False}


def _format(recipe: str, grad: bool):
    """(dtype, max) of an operand: e5m2 for a gradient under tensorwise, e4m3 otherwise."""
    return (jnp.float8_e5m2, E5M2_MAX) if grad and _GRAD_E5M2[recipe] else (jnp.float8_e4m3fn, E4M3_MAX)


# The recipe in force while a model traces its forward (set by ``Transformer.__call__`` from
# ``compute.fp8`` through :func:`scoped`; read by ``layers.linear`` and the expert paths). The
# backward never reads it: the recipe is a static argument of the custom VJP.
_RECIPE = contextvars.ContextVar("jaxmoe_fp8", default="none")


def current() -> str:
    """The fp8 recipe of the forward being traced ("none" outside a model call)."""
    return _RECIPE.get()


@contextlib.contextmanager
def using(recipe: str):
    """Trace the enclosed model code under ``recipe``."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; one of {RECIPES}")
    token = _RECIPE.set(recipe)
    try:
        yield
    finally:
        _RECIPE.reset(token)


def scoped(method):
    """Decorator for a model's ``__call__(self, ...)``: run it under ``self.cfg.compute.fp8``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with using(self.cfg.compute.fp8):
            return method(self, *args, **kwargs)

    return wrapper


def tile_shape(recipe: str, shape: tuple[int, int], contract: int, weight: bool) -> tuple[int, int]:
    """The scaling group of a 2-D operand of ``shape`` whose GEMM contracts axis ``contract``."""
    r, c = shape
    if recipe == "tensorwise":
        return r, c
    if recipe == "rowwise":
        return (1, c) if contract == 1 else (r, 1)
    if recipe == "blockwise":
        if weight:
            return min(BLOCK, r), min(BLOCK, c)
        return (1, min(BLOCK, c)) if contract == 1 else (min(BLOCK, r), 1)
    raise ValueError(f"unknown fp8 recipe {recipe!r}; one of {RECIPES}")


def scales(amax: jax.Array, recipe: str, fmax: float = E4M3_MAX) -> jax.Array:
    """``fmax / amax`` (fp32; 448 for e4m3), 1 where ``amax == 0``; a power of two (rounded down)
    for rowwise."""
    amax = amax.astype(jnp.float32)
    s = jnp.where(amax > 0, fmax / jnp.maximum(amax, AMAX_EPS), 1.0)
    if _POW2[recipe]:
        s = jnp.exp2(jnp.floor(jnp.log2(s)))
    return s


def group_amax(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``max |x|`` over each ``tile`` of the 2-D ``x``, broadcast back to ``x.shape`` (zero-padded
    to whole tiles, which cannot raise an amax)."""
    r, c = x.shape
    tr, tc = tile
    pr, pc = -r % tr, -c % tc
    a = jnp.pad(jnp.abs(x), ((0, pr), (0, pc)))
    m = a.reshape((r + pr) // tr, tr, (c + pc) // tc, tc).max(axis=(1, 3))
    return jnp.repeat(jnp.repeat(m, tr, axis=0), tc, axis=1)[:r, :c]


def _round_trip(x, s, recipe, grad):
    dtype, fmax = _format(recipe, grad)
    return jnp.clip(x * s, -fmax, fmax).astype(dtype).astype(jnp.float32) * (1.0 / s)


def fake_quant(x: jax.Array, recipe: str, contract: int, weight: bool = False, valid=None,
               grad: bool = False) -> jax.Array:
    """``x`` (2-D) quantised with ``recipe``'s scales for a GEMM contracting axis ``contract`` (to
    e4m3; to e5m2 when ``grad`` under tensorwise), dequantised to fp32. ``valid [rows]``: rows
    outside it become 0 first."""
    x = x.astype(jnp.float32)
    if valid is not None:
        x = jnp.where(valid[:, None], x, 0.0)
    s = scales(group_amax(x, tile_shape(recipe, x.shape, contract, weight)), recipe, _format(recipe, grad)[1])
    return _round_trip(x, s, recipe, grad)  # times the inverse scale (torch_ref.fp8 computes the same)


def _mm(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x, w, recipe, valid):
    return _mm(fake_quant(x, recipe, 1, valid=valid), fake_quant(w, recipe, 0, weight=True))


def _fwd(x, w, recipe, valid):
    return _fp8_matmul(x, w, recipe, valid), (x, w, valid)


def _bwd(recipe, res, g):
    x, w, valid = res
    g = g.astype(jnp.float32)
    if valid is not None:
        g = jnp.where(valid[:, None], g, 0.0)
    dx = _mm(fake_quant(g, recipe, 1, grad=True), fake_quant(w.T, recipe, 0, weight=True))  # dgrad
    dw = _mm(fake_quant(x, recipe, 0, valid=valid).T, fake_quant(g, recipe, 0, grad=True))  # wgrad, over tokens
    if valid is not None:
        dx = jnp.where(valid[:, None], dx, 0.0)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_fp8_matmul.defvjp(_fwd, _bwd)


def fp8_matmul(x: jax.Array, w: jax.Array, recipe: str, valid: jax.Array | None = None) -> jax.Array:
    """``x [..., K] @ w [K, N]`` under ``recipe`` (see the module doc), fp32 result ``[..., N]``;
    ``valid`` (shape ``x.shape[:-1]``, bool) marks the rows that count."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    v = None if valid is None else valid.reshape(-1)
    return _fp8_matmul(x2, w, recipe, v).reshape(*lead, w.shape[-1])


def fp8_grouped_matmul(x: jax.Array, w: jax.Array, recipe: str, valid: jax.Array) -> jax.Array:
    """Per group ``e``: ``x[e] [C, K] @ w[e] [K, N]`` with the group's own scales (tensorwise: one
    scale per expert's valid rows and one per expert's weight); ``valid [E, C]``. fp32 ``[E, C, N]``."""
    return jax.vmap(lambda xe, we, ve: _fp8_matmul(xe, we, recipe, ve))(x, w, valid)


def _row_groups(group_sizes: jax.Array, n_rows: int) -> tuple[jax.Array, jax.Array]:
    """Rows sorted by expert (group ``e`` = ``group_sizes[e]`` contiguous rows, groups in order):
    each row's group (``E`` for rows past the groups: padding) and its rank inside its group."""
    e = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    r = jnp.arange(n_rows, dtype=ends.dtype)
    seg = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)
    starts = ends - group_sizes
    return seg, r - jnp.where(seg < e, starts[jnp.minimum(seg, e - 1)], 0)


def grouped_fake_quant(x: jax.Array, group_sizes: jax.Array, recipe: str, contract: int,
                       grad: bool = False) -> jax.Array:
    """Activation rows ``x [N, K]`` sorted by expert, quantised as :func:`fake_quant` quantises each
    expert's rows alone (what the dense path does on its ``[E, C, K]`` slots): tensorwise one scale
    per expert; rowwise / blockwise along K (``contract == 1``) per row / per 1x128 tile; over the
    tokens (``contract == 0``, the weight gradient's operands) per feature column over the expert's
    rows (rowwise) or over 128-row tiles counted from the expert's first row (blockwise). Rows past
    ``sum(group_sizes)`` (padding, whatever they hold) become 0 before any amax."""
    n, kdim = x.shape
    e = group_sizes.shape[0]
    seg, rank = _row_groups(group_sizes, n)
    x = jnp.where((seg < e)[:, None], x.astype(jnp.float32), 0.0)
    tr, tc = tile_shape(recipe, (n, kdim), contract, weight=False)
    if tr == 1:  # per row: the groups do not matter
        return fake_quant(x, recipe, contract, grad=grad)
    if recipe == "blockwise":  # 128-row tiles inside each group, numbered over all groups
        tiles_e = -(-group_sizes // BLOCK)
        first_tile = jnp.cumsum(tiles_e) - tiles_e
        row_seg = jnp.where(seg < e, first_tile[jnp.minimum(seg, e - 1)] + rank // BLOCK, n // BLOCK + e)
        n_seg = n // BLOCK + e + 1
    else:  # tensorwise, rowwise over tokens: the whole group
        row_seg, n_seg = seg, e + 1
    pc = -kdim % tc
    a = jnp.pad(jnp.abs(x), ((0, 0), (0, pc))).reshape(n, (kdim + pc) // tc, tc).max(axis=-1)
    amax = jax.ops.segment_max(a, row_seg, num_segments=n_seg)[row_seg]  # [N, column tiles]
    s = scales(jnp.repeat(amax, tc, axis=1)[:, :kdim], recipe, _format(recipe, grad)[1])
    return _round_trip(x, s, recipe, grad)


def _expert_weights_q(w: jax.Array, recipe: str) -> jax.Array:
    """Stacked expert weights ``[E, K, N]``, each expert's quantised on its own (weight tiles)."""
    return jax.vmap(lambda we: fake_quant(we, recipe, 0, weight=True))(w)


def _ragged(a, w, group_sizes):
    return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str) -> jax.Array:
    """Per expert ``e``: its rows of ``x [N, K]`` (sorted by expert, ``group_sizes [E]``) times
    ``w[e] [K, N_out]``, fp32 ``[N, N_out]`` (0 on padding rows), every operand of the three GEMMs
    quantised with :func:`grouped_fake_quant` / per-expert weight scales: the ragged form of
    :func:`fp8_grouped_matmul`, equal to it on the same rows. The GEMMs are ``lax.ragged_dot``."""
    return _ragged(grouped_fake_quant(x, group_sizes, recipe, 1), _expert_weights_q(w, recipe), group_sizes)


def _ragged_fwd(x, w, group_sizes, recipe):
    return fp8_ragged_matmul(x, w, group_sizes, recipe), (x, w, group_sizes)


def _ragged_bwd(recipe, res, g):
    x, w, gs = res
    g = g.astype(jnp.float32)  # grouped_fake_quant zeroes its padding rows
    dx = _ragged(grouped_fake_quant(g, gs, recipe, 1, grad=True), _expert_weights_q(jnp.swapaxes(w, 1, 2), recipe), gs)
    xq, gq = grouped_fake_quant(x, gs, recipe, 0), grouped_fake_quant(g, gs, recipe, 0, grad=True)
    # wgrad per expert, xq_e^T @ gq_e: the transpose of ragged_dot in its right operand (linear)
    dw = jax.linear_transpose(lambda ww: _ragged(xq, ww, gs), jnp.zeros(w.shape, jnp.float32))(gq)[0]
    return dx.astype(x.dtype), dw.astype(w.dtype), None


fp8_ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)


def swiglu(x, wg, wu, wd, mm):
    """The expert SwiGLU under fp8 for any matmul form ``mm(a, w)`` (fp32 out), in ``x.dtype``."""
    dt = x.dtype
    h = (jax.nn.silu(mm(x, wg)) * mm(x, wu)).astype(dt)
    return mm(h, wd).astype(dt)


def ragged_swiglu(x_sorted: jax.Array, group_sizes: jax.Array, weights: dict, recipe: str) -> jax.Array:
    """SwiGLU of rows sorted by expert under ``recipe`` (:func:`fp8_ragged_matmul` per projection);
    the rows form of every expert path under fp8 (blocked and ragged alike, and under a mesh)."""
    return swiglu(x_sorted, weights["gate_proj"], weights["up_proj"], weights["down_proj"],
                  lambda a, w: fp8_ragged_matmul(a, w, group_sizes, recipe))


__all__ = ["AMAX_EPS", "BLOCK", "E4M3_MAX", "E5M2_MAX", "RECIPES", "current", "fake_quant", "fp8_grouped_matmul",
           "fp8_matmul", "fp8_ragged_matmul", "group_amax", "grouped_fake_quant", "ragged_swiglu", "scales", "scoped",
           "swiglu", "tile_shape", "using"]
