"""``moe.ragged_kernel=tokamax``: tokamax's grouped matmul against ``lax.ragged_dot`` (forward,
input and weight gradients; empty and uneven groups; rows past the groups), the guard for empty
groups' gradients (tokamax #887), the ragged SwiGLU through it against ``xla``, and the whole
train step lowered for CUDA on this CPU host (the Mosaic GPU custom call, no dense
``[G, R, K]`` operand).

tokamax needs Python >= 3.12 and jax >= 0.11 (the ``[gpu]`` extra): these tests run in the lane of
``bench/lane312.sh`` and skip on the core install (Python 3.11). On CPU tokamax executes its
``xla`` implementation (its Mosaic GPU and Triton kernels need a GPU, and its Triton path needs
``jax_triton``); the CUDA lowering uses ``mosaic_gpu`` with tokamax's ``cross_compile`` option and
a pretended sm90 device (tokamax picks its kernel by the device's compute capability).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tokamax = pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 and jax >= 0.11: run bench/lane312.sh")

from jaxmoe.config import load_config  # noqa: E402
from jaxmoe.model import grouped_gemm as gg  # noqa: E402
from jaxmoe.model.experts import ragged_swiglu  # noqa: E402

M, K, N = 40, 16, 24
GROUPS = {"uneven": [10, 3, 22, 5], "empty": [10, 0, 22, 0], "short": [7, 0, 20, 3]}  # short: 30 < M rows


def _arrays(seed=0, g=4):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((M, K)), jnp.float32), jnp.asarray(r.standard_normal((g, K, N)), jnp.float32),
            jnp.asarray(r.standard_normal((M, N)), jnp.float32))


def _loss(f, lhs, rhs, gs, dout):
    return jnp.sum(f(lhs, rhs, gs).astype(jnp.float32) * dout)


def _xla(lhs, rhs, gs):
    out = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(lhs.shape[0]) < jnp.sum(gs))[:, None], out, 0)


def _raw_tokamax(lhs, rhs, gs):
    return tokamax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32, implementation="xla")


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("impl", ["raw", "jaxmoe"])
def test_matches_lax_ragged_dot(groups, impl):
    """Forward, d_lhs and d_rhs of tokamax (raw, and through jaxmoe's guarded wrapper) equal
    lax.ragged_dot's; the rows past the groups and the empty groups' weights get zeros."""
    lhs, rhs, dout = _arrays()
    gs = jnp.asarray(GROUPS[groups], jnp.int32)
    f = _raw_tokamax if impl == "raw" else gg.tokamax_grouped_matmul
    rows = int(sum(GROUPS[groups]))
    out, ref = jax.jit(f)(lhs, rhs, gs), _xla(lhs, rhs, gs)
    np.testing.assert_allclose(out[:rows], ref[:rows], rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda a, b: _loss(f, a, b, gs, dout), (0, 1)))(lhs, rhs)
    g_ref = jax.grad(lambda a, b: _loss(_xla, a, b, gs, dout), (0, 1))(lhs, rhs)
    np.testing.assert_allclose(g[0][:rows], g_ref[0][:rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g[1], g_ref[1], rtol=1e-5, atol=1e-5)
    if impl == "jaxmoe":  # the wrapper's contract: zeros past the groups
        assert not np.any(np.asarray(out[rows:])) and not np.any(np.asarray(g[0][rows:]))
    for e, n in enumerate(GROUPS[groups]):
        if n == 0:
            assert not np.any(np.asarray(g[1][e])), f"group {e} is empty but its weight gradient is not zero"


def test_empty_group_guard(monkeypatch):
    """tokamax #887 (nonzero weight gradients for empty groups), simulated: a tokamax whose
    weight gradient is garbage for every group; jaxmoe's wrapper still gives the empty groups
    zero and leaves the others as tokamax computed them."""

    @jax.custom_vjp
    def buggy(lhs, rhs, gs):
        return _raw_tokamax(lhs, rhs, gs).astype(lhs.dtype)

    def fwd(lhs, rhs, gs):
        return buggy(lhs, rhs, gs), (lhs, rhs, gs)

    def bwd(res, dout):
        lhs, rhs, gs = res
        _, vjp = jax.vjp(lambda a, b: _raw_tokamax(a, b, gs), lhs, rhs)
        d_lhs, d_rhs = vjp(dout.astype(jnp.float32))
        return d_lhs, d_rhs + 1.0, None  # every group's weights: off by one, the empty ones too

    buggy.defvjp(fwd, bwd)
    monkeypatch.setattr(gg, "_tokamax_dot", buggy)
    lhs, rhs, dout = _arrays()
    gs = jnp.asarray(GROUPS["empty"], jnp.int32)
    d_rhs = jax.grad(lambda b: _loss(gg.tokamax_grouped_matmul, lhs, b, gs, dout))(rhs)
    ref = jax.grad(lambda b: _loss(_xla, lhs, b, gs, dout))(rhs)
    assert not np.any(np.asarray(d_rhs[1])) and not np.any(np.asarray(d_rhs[3]))  # the empty groups
    np.testing.assert_allclose(d_rhs[0], ref[0] + 1.0, rtol=1e-5, atol=1e-5)  # tokamax's own value kept


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_ragged_swiglu_tokamax_equals_xla(dtype, tol):
    """The ragged path's SwiGLU (gate/up as one GEMM, then down) through tokamax against xla: the
    output and the gradients of the input and of all three weights."""
    r = np.random.default_rng(1)
    g, d, f = 4, 16, 24
    x = jnp.asarray(r.standard_normal((M, d)), dtype)
    w = {k: jnp.asarray(r.standard_normal(s) * 0.3, dtype)
         for k, s in (("gate_proj", (g, d, f)), ("up_proj", (g, d, f)), ("down_proj", (g, f, d)))}
    gs = jnp.asarray(GROUPS["short"], jnp.int32)
    rows = int(sum(GROUPS["short"]))

    def loss(kernel, x, w):
        y = ragged_swiglu(x, gs, w, kernel)
        return jnp.sum(y[:rows].astype(jnp.float32) ** 2), y

    (l_t, y_t), g_t = jax.value_and_grad(lambda x, w: loss("tokamax", x, w), (0, 1), has_aux=True)(x, w)
    (l_x, y_x), g_x = jax.value_and_grad(lambda x, w: loss("xla", x, w), (0, 1), has_aux=True)(x, w)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(y_t[:rows]), f32(y_x[:rows]), rtol=tol, atol=tol)
    scale = lambda a: max(1.0, float(np.max(np.abs(f32(a)))))  # noqa: E731
    np.testing.assert_allclose(f32(g_t[0][:rows]), f32(g_x[0][:rows]), atol=tol * scale(g_x[0]))
    for k in w:
        np.testing.assert_allclose(f32(g_t[1][k]), f32(g_x[1][k]), atol=tol * scale(g_x[1][k]), err_msg=k)
        assert not np.any(f32(g_t[1][k])[1]), k  # group 1 is empty


# -- the train step lowered for CUDA -----------------------------------------------------------
G, D, F, B, S, K_TOP = 4, 128, 128, 2, 96, 2
ROWS = B * S * K_TOP  # 384 assignment rows: more than any weight dim (D, F, 2F)


def dense_operands(text: str) -> set[str]:
    """``[G, R, K]`` tensors (R >= ROWS, K in {D, F, 2F}) in StableHLO text."""
    return {m.group(0) for m in re.finditer(rf"tensor<{G}x(\d+)x(\d+)x(?:bf16|f32)>", text)
            if int(m.group(1)) >= ROWS and int(m.group(2)) in (D, F, 2 * F)}


def _step_cfg(kernel):
    sets = {"compute.dtype": "bfloat16", "model.d_model": D, "moe.expert_ffn_dim": F, "moe.n_experts": G,
            "moe.top_k": K_TOP, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 32,
            "train.batch_size": B, "train.seq_len": S, "model.max_seq_len": S, "model.n_layers": 2,
            "model.first_k_dense": 0, "compute.attention_kernel": "dot_product", "optim.optimizer": "adamw",
            "moe.compute_path": "ragged", "moe.ragged_kernel": kernel}
    return load_config("tiny", overrides=[f"{k}={v}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def tokamax_cuda_text():
    from tokamax._src import gpu_utils

    from jaxmoe.plan.lower import lower_abstract

    cfg = _step_cfg("tokamax")
    mp = pytest.MonkeyPatch()
    mp.setattr(gg, "TOKAMAX_IMPL", "mosaic_gpu")  # tokamax's Hopper kernel, not its fallback list
    mp.setattr(gpu_utils, "_compute_capability", lambda device=None: 9.0)  # lowered as for an H100
    try:
        with tokamax.config.cross_compile(True):  # tokamax's own switch for lowering off-device
            lowered, _, _ = lower_abstract(cfg, "cuda")
            return lowered.as_text()
    finally:
        mp.undo()


def test_dense_pattern_can_match():
    assert dense_operands(f"tensor<{G}x{ROWS}x{D}xbf16> tensor<{G}x512x{2 * F}xf32>") == {
        f"tensor<{G}x{ROWS}x{D}xbf16>", f"tensor<{G}x512x{2 * F}xf32>"}
    assert not dense_operands(f"tensor<{G}x{D}x{2 * F}xbf16> tensor<{G}x{2 * F}x{D}xbf16> tensor<8x{ROWS}x{D}xf32>")


def test_tokamax_step_lowered_for_cuda_is_a_grouped_gemm(tokamax_cuda_text):
    text = tokamax_cuda_text
    calls = re.findall(r"stablehlo.custom_call @(\w+)", text)
    # forward gate/up and down, their input gradients and weight gradients, per MoE layer (scanned: once)
    assert sum(c.startswith("mosaic_gpu") for c in calls) >= 6, sorted(set(calls))
    assert '"chlo.ragged_dot"' not in text
    assert dense_operands(text) == set(), dense_operands(text)


def test_xla_step_lowered_for_cuda_is_the_counter_example():
    """The same step with moe.ragged_kernel=xla: chlo.ragged_dot, which XLA expands densely."""
    from jaxmoe.plan.lower import lower_abstract

    text = lower_abstract(_step_cfg("xla"), "cuda")[0].as_text()
    assert text.count('"chlo.ragged_dot"') >= 3 and "mosaic_gpu" not in text
