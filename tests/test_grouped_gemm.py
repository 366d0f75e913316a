"""moe.ragged_kernel: the grouped matmuls of the ragged path (jaxmoe/model/grouped_gemm.py).

No GPU here, so the Mosaic GPU kernels themselves are not run. What is checked on CPU:
- the custom VJP that ties the kernels together (row padding, masking of rows outside every group,
  the transposed forward for the input gradient, the transposed kernel for the weight gradient),
  run with reference kernels that have the Mosaic kernels' contract (unspecified rows = NaN):
  output and every gradient against autodiff of ``jax.lax.ragged_dot``, empty groups included;
- the whole ragged SwiGLU with the real Mosaic GPU kernels lowers for CUDA (jax.export), forward
  and backward, so the kernels' argument checks and our shapes and dtypes agree;
- the config and device errors.
"""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import ConfigError, UserError
from jaxmoe.model import experts as experts_mod
from jaxmoe.model import grouped_gemm as gg

M, K, N, G = 37, 64, 128, 5
GS = np.array([9, 0, 14, 3, 6], np.int32)  # 32 rows in groups, 5 rows past them, one empty group


def _operands(dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(ks[0], (M, K)).astype(dtype)
    rhs = (jax.random.normal(ks[1], (G, K, N)) * 0.2).astype(dtype)
    probe = jax.random.normal(ks[2], (M, N))
    return lhs, rhs, probe


def _xla(lhs, rhs, gs):
    return gg.grouped_matmul(lhs, rhs, gs, "xla")


def _kernel(lhs, rhs, gs):
    return gg.kernel_grouped_matmul(gg.REFERENCE, lhs, rhs, gs)


def test_kernel_vjp_matches_ragged_dot_autodiff_fp32():
    lhs, rhs, probe = _operands()
    gs = jnp.asarray(GS)

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b, gs).astype(jnp.float32) * probe)

    got_y, want_y = _kernel(lhs, rhs, gs), _xla(lhs, rhs, gs)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got_y[int(GS.sum()):]).max()) == 0.0  # rows past the groups are 0, not NaN
    got = jax.grad(loss(_kernel), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(_xla), argnums=(0, 1))(lhs, rhs)
    for name, a, b in zip(("d_lhs", "d_rhs"), got, want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert float(jnp.abs(got[1][1]).max()) == 0.0  # the empty group gets exactly zero gradient
    assert float(jnp.abs(got[0][int(GS.sum()):]).max()) == 0.0


def test_kernel_vjp_bf16_within_rounding_of_fp32():
    lhs, rhs, probe = _operands(jnp.bfloat16)
    gs = jnp.asarray(GS)

    def grads(f, a, b):
        return jax.grad(lambda a, b: jnp.sum(f(a, b, gs).astype(jnp.float32) * probe), argnums=(0, 1))(a, b)

    got = grads(_kernel, lhs, rhs)
    want = grads(_xla, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    for a, b in zip(got, want):
        rel = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert rel < 1e-2, rel


def test_a_forgotten_mask_is_caught():
    """The reference kernel's NaN rows make the masking load-bearing: without it, NaN."""
    lhs, rhs, _ = _operands()
    raw = gg.REFERENCE.fwd(jnp.pad(lhs, ((0, 128 - M), (0, 0))), rhs, jnp.asarray(GS))
    assert bool(jnp.isnan(raw[int(GS.sum()):]).all()) and bool(jnp.isfinite(raw[: int(GS.sum())]).all())


def test_ragged_swiglu_through_kernels_matches_xla(monkeypatch):
    """The ragged path's SwiGLU with the mosaic_gpu wiring (gate/up as one GEMM, bf16 rounding of
    the pre-activations), the device check lifted and the reference kernels in place of Mosaic's:
    output and the gradients of x and every expert weight against the xla kernel."""
    monkeypatch.setattr(gg, "MOSAIC_GPU", gg.REFERENCE)
    monkeypatch.setattr(gg, "check_mosaic_gpu_device", lambda: None)
    ks = jax.random.split(jax.random.key(1), 4)
    e, d, i = 4, 64, 128
    w = {"gate_proj": jax.random.normal(ks[0], (e, d, i)) * 0.1, "up_proj": jax.random.normal(ks[1], (e, d, i)) * 0.1,
         "down_proj": jax.random.normal(ks[2], (e, i, d)) * 0.1}
    x = jax.random.normal(ks[3], (30, d))
    gs = jnp.asarray([7, 0, 12, 6], jnp.int32)  # 25 of 30 rows

    def loss(kernel, x, w):
        y = experts_mod.ragged_swiglu(x.astype(jnp.bfloat16), gs, w, kernel)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    (lm, ym), gm = jax.value_and_grad(lambda x, w: loss("mosaic_gpu", x, w), argnums=(0, 1), has_aux=True)(x, w)
    (lx, yx), gx = jax.value_and_grad(lambda x, w: loss("xla", x, w), argnums=(0, 1), has_aux=True)(x, w)
    assert float(jnp.abs(ym[25:].astype(jnp.float32)).max()) == 0.0
    assert abs(float(lm) - float(lx)) / float(lx) < 2e-2
    for name, a, b in zip(("x", "gate_proj", "up_proj", "down_proj"),
                          [gm[0]] + [gm[1][k] for k in ("gate_proj", "up_proj", "down_proj")],
                          [gx[0]] + [gx[1][k] for k in ("gate_proj", "up_proj", "down_proj")]):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < 3e-2, (name, rel)


class _FakeH200:
    core_count = 132  # SMs; the transposed kernel sizes its grid from the device
    device_kind = "NVIDIA H200"
    platform = "gpu"


def test_mosaic_kernels_lower_for_cuda(monkeypatch):
    """Forward and backward of the ragged SwiGLU with jax's Hopper kernels, exported for CUDA
    (lowering only: no GPU here). Catches argument-check failures (tile sizes, dtypes, shapes)."""
    trd = pytest.importorskip("jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu")
    pytest.importorskip("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
    # the transposed kernel reads jax.devices()[0].core_count while tracing; here that is a CPU
    monkeypatch.setattr(trd.jax, "devices", lambda *a, **k: [_FakeH200()])
    e, d, i, rows = 4, 256, 512, 300

    def f(x, wg, wu, wd, gs):
        gu = gg.kernel_grouped_matmul(gg.MOSAIC_GPU, x, jnp.concatenate([wg, wu], -1), gs)
        h = (jax.nn.silu(gu[:, :i].astype(jnp.float32)) * gu[:, i:].astype(jnp.float32)).astype(x.dtype)
        return jnp.sum(gg.kernel_grouped_matmul(gg.MOSAIC_GPU, h, wd, gs).astype(jnp.float32) ** 2)

    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((rows, d), bf), jax.ShapeDtypeStruct((e, d, i), bf),
            jax.ShapeDtypeStruct((e, d, i), bf), jax.ShapeDtypeStruct((e, i, d), bf),
            jax.ShapeDtypeStruct((e,), jnp.int32))
    exp = jax.export.export(jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))), platforms=("cuda",))(*args)
    text = exp.mlir_module()
    # forward x2, input gradient x2 (transposed forward), weight gradient x2
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 6, text.count("mosaic_gpu")


def _cfg(**sets):
    base = {"moe.compute_path": "ragged", "moe.ragged_kernel": "mosaic_gpu", "compute.dtype": "bfloat16",
            "model.d_model": 64, "moe.expert_ffn_dim": 128, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.head_dim": 16}
    base.update(sets)
    return load_config("tiny", overrides=[f"{k}={v}" for k, v in base.items()])


@pytest.mark.parametrize("sets, needle", [
    ({"moe.compute_path": "blocked"}, "applies to moe.compute_path='ragged' only"),
    ({"compute.dtype": "float32"}, "needs compute.dtype=bfloat16"),
    ({"moe.expert_ffn_dim": 96}, "moe.expert_ffn_dim=96"),
    ({"moe.ragged_kernel": "cutlass"}, "moe.ragged_kernel='cutlass' is not one of: auto, xla, mosaic_gpu, tokamax"),
    ({"moe.ragged_kernel": "tokamax", "moe.compute_path": "blocked"}, "'tokamax' applies to moe.compute_path='ragged'"),
])
def test_config_errors(sets, needle):
    with pytest.raises(ConfigError) as ex:
        _cfg(**sets)
    msg = str(ex.value)
    assert needle in msg and "\n" not in msg, msg


def test_valid_config_and_cpu_device_error():
    cfg = _cfg()
    assert cfg.moe.ragged_kernel == "mosaic_gpu"
    x = jnp.zeros((8, 64), jnp.bfloat16)
    w = jnp.zeros((2, 64, 128), jnp.bfloat16)
    with pytest.raises(UserError) as ex:
        gg.grouped_matmul(x, w, jnp.asarray([4, 4]), "mosaic_gpu")
    assert "runs on NVIDIA Hopper GPUs only" in str(ex.value) and "'cpu'" in str(ex.value)
    moe = dataclasses.replace(cfg.moe, n_experts=2, top_k=1)
    with pytest.raises(UserError):  # the same error through the model's expert path
        experts_mod.expert_ffn(x, jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1)),
                               {"gate_proj": w, "up_proj": w, "down_proj": jnp.zeros((2, 128, 64))}, moe)


def test_a_jax_without_the_kernels_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mosaic(name, *a, **k):
        if name.startswith("jax.experimental.pallas.ops.gpu"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    gg._mosaic_modules.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_mosaic)
    try:
        with pytest.raises(UserError) as ex:
            gg._mosaic_modules()
    finally:
        gg._mosaic_modules.cache_clear()
    msg = str(ex.value)
    assert "moe.ragged_kernel=xla" in msg and "ragged_dot_mgpu" in msg and "\n" not in msg, msg


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is not None, reason="tokamax is installed here")
def test_tokamax_without_the_gpu_extra_is_one_line():
    """moe.ragged_kernel=tokamax on an install without the [gpu] extra (this Python 3.11 core env):
    one line naming the extra, also through the model's expert path; auto stays xla."""
    cfg = _cfg(**{"moe.ragged_kernel": "tokamax", "compute.dtype": "float32"})  # a valid config
    assert cfg.moe.ragged_kernel == "tokamax"
    gg._tokamax.cache_clear()
    x, w = jnp.zeros((8, 64)), jnp.zeros((2, 64, 128))
    with pytest.raises(UserError) as ex:
        gg.grouped_matmul(x, w, jnp.asarray([4, 4]), "tokamax")
    msg = str(ex.value)
    assert "pip install 'jaxmoe[gpu]'" in msg and "Python >= 3.12" in msg and "\n" not in msg, msg
    moe = dataclasses.replace(cfg.moe, n_experts=2, top_k=1)
    with pytest.raises(UserError, match=r"jaxmoe\[gpu\]"):
        experts_mod.expert_ffn(x, jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1)),
                               {"gate_proj": w, "up_proj": w, "down_proj": jnp.zeros((2, 128, 64))}, moe)
    assert gg.concrete_kernel("auto") == "xla" and gg.concrete_kernel("tokamax") == "tokamax"
