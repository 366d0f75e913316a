"""Attention kernels: ``jax.nn.dot_product_attention`` (compute.attention_kernel=dot_product) equals
the explicit scores (fp32: rel <= 1e-6 on the output and every gradient), for GQA, for MLA's
unequal q/k and v head dims (zero padding), and through the whole model's loss and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.model.attention import attend
from jaxmoe.model.transformer import Model, init_params
from jaxmoe.train.objective import model_loss


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("h,kv,d,dv", [(8, 4, 16, 16), (4, 4, 24, 16), (4, 2, 8, 12)])
def test_dot_product_kernel_equals_explicit(h, kv, d, dv):
    b, s = 2, 12
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, s, h, d))
    k = jax.random.normal(ks[1], (b, s, kv, d))
    v = jax.random.normal(ks[2], (b, s, kv, dv))
    w = jax.random.normal(ks[3], (b, s, h, dv))
    scale = 0.3

    def loss(kernel):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v, scale, kernel) * w),
                                          argnums=(0, 1, 2)))

    (lx, gx), (ld, gd) = loss("explicit")(q, k, v), loss("dot_product")(q, k, v)
    out_x = attend(q, k, v, scale, "explicit")
    out_d = attend(q, k, v, scale, "dot_product")
    assert out_d.shape == (b, s, h, dv)
    assert _rel(out_d, out_x) <= 1e-6
    # the loss is a signed sum (cancellation): its error is measured against the sum of |terms|
    assert abs(float(ld - lx)) <= 1e-6 * float(jnp.sum(jnp.abs(out_x * w)))
    for a, c in zip(gd, gx):
        assert _rel(a, c) <= 1e-6
    # causal: the first position attends only to itself
    np.testing.assert_allclose(out_d[:, 0], jnp.repeat(v[:, 0], h // kv, axis=1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("s_len,q_block", [(96, 32), (100, 32)])
def test_explicit_kernel_query_blocks_equal_one_block(monkeypatch, s_len, q_block):
    """The explicit kernel's causal query blocks (keys above the diagonal's blocks never scored)
    give the single masked S x S softmax's output and gradients; a length that is not a multiple
    of the block (100) runs as one block."""
    from jaxmoe.model import attention

    ks = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(ks[0], (2, s_len, 4, 16))
    k = jax.random.normal(ks[1], (2, s_len, 2, 16))
    v = jax.random.normal(ks[2], (2, s_len, 2, 16))
    w = jax.random.normal(ks[3], (2, s_len, 4, 16))

    def run(qb):
        monkeypatch.setattr(attention, "_Q_BLOCK", qb)
        f = lambda q, k, v: jnp.sum(attend(q, k, v, 0.25, "explicit") * w)  # noqa: E731
        return jax.jit(lambda q, k, v: (attend(q, k, v, 0.25, "explicit"),
                                        jax.grad(f, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    (o1, g1), (ob, gb) = run(0), run(q_block)
    assert _rel(ob, o1) <= 1e-6
    for a, c in zip(gb, g1):
        assert _rel(a, c) <= 1e-6
    # the blocked form really is different work: fewer score entries than S x S
    def n_dots(qb):
        return str(jax.make_jaxpr(lambda q, k, v: attend(q, k, v, 0.25, "explicit"))(q, k, v)).count("dot_general")
    monkeypatch.setattr(attention, "_Q_BLOCK", q_block)
    blocked = n_dots(q_block)
    expected = 2 * (s_len // q_block) if s_len % q_block == 0 else 2
    assert blocked == expected


def test_dot_product_kernel_bf16():
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 16, 4, 16)) for kk in ks)
    ref = attend(q, k, v, 0.25, "explicit")
    out = attend(*(t.astype(jnp.bfloat16) for t in (q, k, v)), 0.25, "dot_product")
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), ref) < 3e-2


# CI time: MLA (padded v) is the harder case
@pytest.mark.parametrize("preset", [pytest.param("tiny", marks=pytest.mark.slow), "tiny-mla"])
def test_model_loss_and_grads_equal_across_kernels(preset):
    b, s = 2, 8
    tok = jax.random.randint(jax.random.key(0), (b, s + 1), 0, 256)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": jnp.ones((b, s), jnp.float32)}
    out = {}
    for kernel in ("explicit", "dot_product"):
        cfg = load_config(preset, overrides=[f"train.seq_len={s}", f"compute.attention_kernel={kernel}"])
        params, buffers = init_params(cfg, 0)
        f = jax.jit(jax.value_and_grad(lambda p: model_loss(Model(cfg), p, buffers, batch)[0]))
        out[kernel] = f(params)
    (lx, gx), (ld, gd) = out["explicit"], out["dot_product"]
    assert _rel(ld, lx) <= 1e-6
    flat_x, flat_d = jax.tree_util.tree_leaves_with_path(gx), jax.tree.leaves(gd)
    assert len(flat_x) == len(flat_d)
    for (path, a), c in zip(flat_x, flat_d):
        assert _rel(c, a) <= 1e-6, jax.tree_util.keystr(path)


def test_unknown_kernel_is_a_config_error():
    with pytest.raises(ConfigError, match="attention_kernel"):
        load_config("tiny", overrides=["compute.attention_kernel=flash"])
