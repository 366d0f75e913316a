"""Grouped matmuls of the ``ragged`` expert path (``moe.ragged_kernel``).

``out[r] = lhs[r] @ rhs[g(r)]`` for rows ``lhs [M, K]`` grouped by expert (group ``g`` is
``group_sizes[g]`` contiguous rows, groups in order; rows past ``sum(group_sizes)`` give 0) and
stacked weights ``rhs [G, K, N]``.

``xla``
    ``jax.lax.ragged_dot``, differentiated by JAX. Native on TPU; on CPU and GPU (jax 0.10-0.11)
    XLA lowers it densely, through a ``[G, M, K]`` masked copy of its operand (docs/MEASUREMENTS.md,
    "GPU"), so on those backends it is a reference, not a fast path.
``mosaic_gpu``
    The grouped-GEMM kernels that jax ships for Hopper GPUs (Pallas Mosaic GPU, ``wgmma``,
    compute capability 9.x, 16-bit operands): ``ragged_dot_mgpu.ragged_dot`` for the forward and
    the input gradient, ``transposed_ragged_dot_mgpu.transposed_ragged_dot`` for the weight
    gradient (``lhs_g^T @ dout_g`` per group), tied together by a ``jax.custom_vjp`` here. The
    kernels store their result in the operands' dtype (fp32 accumulation inside, one rounding at
    the end, as a bf16 torch ``Linear`` does); the ``xla`` path returns fp32. Status: lowered for
    CUDA and checked against ``xla`` through reference kernels with the same contract on CPU
    (tests/test_grouped_gemm.py); not yet run on a GPU by this project -- ``bench/gpu.sh``'s
    ``*/ragged_mgpu`` variants run it and compare it with ``xla`` on the device.
``tokamax``
    ``tokamax.ragged_dot`` (the ``[gpu]`` extra: Python >= 3.12, jax >= 0.11), the same API as
    ``lax.ragged_dot``, for the forward and, through tokamax's own VJP, both gradients (dlhs,
    drhs). On a GPU tokamax picks from its list (``mosaic`` on sm90/sm100, then ``triton``, then
    ``xla``); elsewhere its ``xla`` implementation (:data:`TOKAMAX_IMPL` overrides the choice: the
    CUDA lowering checks of ``bench/lane312.sh`` set ``mosaic_gpu``). Result in ``lhs.dtype``, as
    ``mosaic_gpu``. Guarded here (:func:`tokamax_grouped_matmul`): the weight gradient of an empty
    group is set to zero and the rows past the groups give zero output and zero input gradient
    (tokamax issue #887 reports nonzero gradients for empty groups). Checked against ``xla`` on CPU
    in the Python 3.12 lane (tests/test_tokamax.py); not yet run on a GPU by this project.
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config.autoconf import tokamax_importable
from jaxmoe.config.schema import MoEConfig
from jaxmoe.errors import UserError

# the choices the config declares (moe.ragged_kernel), implemented below
KERNELS = tuple(k for k in typing.get_args(typing.get_type_hints(MoEConfig)["ragged_kernel"]) if k != "auto")
_ROW_PAD = 128  # rows are zero-padded to a multiple of this (the kernels' largest row tile)
_BLOCK_K = 64


class Kernels(NamedTuple):
    """A grouped-GEMM kernel pair with the Mosaic GPU kernels' contract.

    ``fwd(lhs [M, K], rhs [G, K, N] or [G, N, K] if transpose_rhs, group_sizes) -> [M, N]`` in
    ``lhs.dtype``, rows outside every group unspecified; ``tgrad(lhs [M, K], rhs [M, N],
    group_sizes) -> [G, K, N]`` in ``lhs.dtype``, ``lhs_g^T @ rhs_g`` per group (zero for an
    empty group). ``M`` is a multiple of 128; rows past ``sum(group_sizes)`` are zero."""

    fwd: Callable
    tgrad: Callable


def _block(n: int) -> int:
    return 128 if n % 128 == 0 else 64


@functools.cache
def _mosaic_modules():
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError as e:  # a jax without them, or without Mosaic GPU support
        raise UserError(
            f"moe.ragged_kernel='mosaic_gpu' needs jax.experimental.pallas.ops.gpu.ragged_dot_mgpu "
            f"and transposed_ragged_dot_mgpu, which this jax {jax.__version__} cannot import ({e}); "
            "use moe.ragged_kernel=xla"
        ) from None
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def _call(fn, *args, **kw):
    """``fn(*args, **kw)`` with the keywords ``fn`` does not take left out: the tuning knobs of
    these kernels have come and gone between jax releases (the tile sizes have not)."""
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kw.items() if k in params})


def _mosaic_fwd(lhs, rhs, group_sizes, transpose_rhs=False):
    rd, _ = _mosaic_modules()
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    kw = {}
    if transpose_rhs:
        if "transpose_rhs" in inspect.signature(rd.ragged_dot).parameters:
            kw["transpose_rhs"] = True
        else:  # older jax: no in-kernel transpose; pass a transposed copy of the weights
            rhs = jnp.swapaxes(rhs, 1, 2)
    return _call(rd.ragged_dot, lhs, rhs, group_sizes=group_sizes, block_m=128, block_n=_block(n),
                 block_k=_BLOCK_K, max_concurrent_steps=4, grid_block_n=1, **kw)


def _mosaic_tgrad(lhs, rhs, group_sizes):
    _, trd = _mosaic_modules()
    # the kernel's (K, M) x (K, N) -> (G, M, N) with the ragged, contracted K = our rows
    return _call(trd.transposed_ragged_dot, lhs, rhs, group_sizes=group_sizes,
                 block_m=_block(lhs.shape[1]), block_n=_block(rhs.shape[1]), block_k=_BLOCK_K,
                 max_concurrent_steps=4, grid_block_n=1)


MOSAIC_GPU = Kernels(_mosaic_fwd, _mosaic_tgrad)


def _pad_rows(a):
    """``a [M, ...]`` zero-padded to a multiple of ``_ROW_PAD`` rows."""
    m_pad = -(-a.shape[0] // _ROW_PAD) * _ROW_PAD
    return jnp.pad(a, ((0, m_pad - a.shape[0]), (0, 0))) if m_pad != a.shape[0] else a


def _inside(m, group_sizes):
    """``[M, 1]`` bool: the rows that belong to a group (the first ``sum(group_sizes)``)."""
    return (jnp.arange(m) < jnp.sum(group_sizes))[:, None]


def _reference_fwd(lhs, rhs, group_sizes, transpose_rhs=False):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    # rows outside every group are unspecified in the kernels' contract: NaN here, so a caller
    # that forgets to mask them fails the tests
    return jnp.where(_inside(lhs.shape[0], group_sizes), out, jnp.nan).astype(lhs.dtype)


def _reference_tgrad(lhs, rhs, group_sizes):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


# jnp implementations of the Mosaic GPU kernels' contract (any backend): what the tests run the
# custom VJP below with on CPU
REFERENCE = Kernels(_reference_fwd, _reference_tgrad)


def _masked_fwd(kernels: Kernels, lhs, rhs, group_sizes, transpose_rhs=False):
    out = kernels.fwd(_pad_rows(lhs), rhs, group_sizes, transpose_rhs)[: lhs.shape[0]]
    return jnp.where(_inside(lhs.shape[0], group_sizes), out, jnp.zeros((), out.dtype))  # NaN-safe


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def kernel_grouped_matmul(kernels: Kernels, lhs, rhs, group_sizes):
    """``out [M, N]`` in ``lhs.dtype`` through ``kernels`` (``lhs`` and ``rhs`` of one dtype)."""
    return _masked_fwd(kernels, lhs, rhs, group_sizes)


def _kgm_fwd(kernels, lhs, rhs, group_sizes):
    return _masked_fwd(kernels, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _kgm_bwd(kernels, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    d_lhs = _masked_fwd(kernels, dout, rhs, group_sizes, transpose_rhs=True)  # dout_g @ rhs_g^T
    inside = _inside(lhs.shape[0], group_sizes)
    # rows past the groups must not reach the weight gradient (dout there can be anything)
    d_rhs = kernels.tgrad(_pad_rows(jnp.where(inside, lhs, 0)), _pad_rows(jnp.where(inside, dout, 0)),
                          group_sizes)
    return d_lhs, d_rhs.astype(rhs.dtype), None


kernel_grouped_matmul.defvjp(_kgm_fwd, _kgm_bwd)


def check_mosaic_gpu_device() -> None:
    """Raise a one-line UserError unless this process runs on a Hopper GPU (the kernels' wgmma)."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise UserError(f"moe.ragged_kernel='mosaic_gpu' runs on NVIDIA Hopper GPUs only; this "
                        f"process's JAX backend is {backend!r} (use moe.ragged_kernel=xla)")
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "") or "")
    if not cc.startswith("9."):
        raise UserError(f"moe.ragged_kernel='mosaic_gpu' needs compute capability 9.x (Hopper "
                        f"wgmma); {dev.device_kind} has {cc or 'unknown'} (use moe.ragged_kernel=xla)")


# tokamax's implementation (None: its own fallback list); see the module doc
TOKAMAX_IMPL: str | None = None


@functools.cache
def _tokamax():
    try:
        import tokamax
    except ImportError as e:
        py = ".".join(map(str, sys.version_info[:2]))
        raise UserError(
            f"moe.ragged_kernel='tokamax' needs the tokamax package (pip install 'jaxmoe[gpu]', which "
            f"installs it on Python >= 3.12 with jax >= 0.11); this is Python {py} with jax "
            f"{jax.__version__} ({e}); use moe.ragged_kernel=xla or mosaic_gpu"
        ) from None
    return tokamax


def _tokamax_dot(lhs, rhs, group_sizes):
    impl = TOKAMAX_IMPL
    if impl is None and jax.default_backend() != "gpu":
        impl = "xla"
    return _tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, implementation=impl)


@jax.custom_vjp
def tokamax_grouped_matmul(lhs, rhs, group_sizes):
    """``out [M, N]`` in ``lhs.dtype`` by ``tokamax.ragged_dot``; zero rows past the groups."""
    return _tk_fwd(lhs, rhs, group_sizes)[0]


def _tk_fwd(lhs, rhs, group_sizes):
    out, vjp = jax.vjp(lambda a, b: _tokamax_dot(a, b, group_sizes), lhs, rhs)
    inside = _inside(lhs.shape[0], group_sizes)
    return jnp.where(inside, out, jnp.zeros((), out.dtype)), (vjp, group_sizes, inside)


def _tk_bwd(res, dout):
    vjp, group_sizes, inside = res
    d_lhs, d_rhs = vjp(jnp.where(inside, dout, 0).astype(dout.dtype))
    # the guard for tokamax #887: an empty group's weights get no gradient, nor rows past the groups
    d_rhs = jnp.where((group_sizes > 0)[:, None, None], d_rhs, jnp.zeros((), d_rhs.dtype))
    return jnp.where(inside, d_lhs, jnp.zeros((), d_lhs.dtype)), d_rhs, None


tokamax_grouped_matmul.defvjp(_tk_fwd, _tk_bwd)


def concrete_kernel(kernel: str) -> str:
    """``kernel``, with ``auto`` (a caller without a resolved config; the model resolves its own)
    chosen by jaxmoe.config.autoconf's rule for this process's backend."""
    if kernel != "auto":
        return kernel
    return "tokamax" if jax.default_backend() == "gpu" and tokamax_importable() else "xla"


def grouped_matmul(lhs, rhs, group_sizes, kernel: str = "xla"):
    """``[M, K] x [G, K, N] -> [M, N]`` by ``kernel`` (module doc); ``rhs`` cast to ``lhs.dtype``.

    ``xla`` returns fp32, ``mosaic_gpu`` and ``tokamax`` ``lhs.dtype``; rows past ``sum(group_sizes)`` are 0."""
    gs = group_sizes.astype(jnp.int32)
    rhs = rhs.astype(lhs.dtype)
    kernel = concrete_kernel(kernel)
    if kernel == "xla":
        out = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
        return jnp.where(_inside(lhs.shape[0], gs), out, 0)
    if kernel == "mosaic_gpu":
        check_mosaic_gpu_device()
        return kernel_grouped_matmul(MOSAIC_GPU, lhs, rhs, gs)
    if kernel == "tokamax":
        return tokamax_grouped_matmul(lhs, rhs, gs)
    raise ValueError(f"moe.ragged_kernel={kernel!r} is not one of: {', '.join(KERNELS)}")


__all__ = ["KERNELS", "Kernels", "MOSAIC_GPU", "REFERENCE", "TOKAMAX_IMPL", "check_mosaic_gpu_device",
           "concrete_kernel", "grouped_matmul", "kernel_grouped_matmul", "tokamax_grouped_matmul"]
