"""Chunked cross-entropy (compute.ce_chunk_tokens): equals the whole-logits CE and z-loss (fp32:
rel <= 1e-6 on the values and every gradient), with a masked, unevenly chunked batch, through the
model with micro-batches and tied embeddings; the compiled step holds no [T, V] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.model.transformer import Model, init_params
from jaxmoe.train.losses import chunked_cross_entropy, cross_entropy
from jaxmoe.train.objective import make_grad_fn


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _data(b=3, s=7, d=16, v=50, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(ks[0], (b, s, d)).astype(dtype)
    head = (jax.random.normal(ks[1], (d, v)) * 0.5).astype(dtype)
    targets = jax.random.randint(ks[2], (b, s), 0, v)
    mask = (jax.random.uniform(ks[3], (b, s)) > 0.3).astype(jnp.float32)
    return hidden, head, targets, mask


def _whole(hidden, head, targets, mask, n_valid=None):
    logits = jnp.einsum("bsd,dv->bsv", hidden, head, preferred_element_type=jnp.float32)
    return cross_entropy(logits, targets, mask, n_valid)


@pytest.mark.parametrize("chunk", [1, 5, 21, 64])
def test_chunked_equals_whole_values_and_grads(chunk):
    hidden, head, targets, mask = _data()
    zc = 0.3

    def whole(h, w):
        ce, z = _whole(h, w, targets, mask, 9.0)
        return 2.5 * (ce + zc * z), (ce, z)

    def chunked(h, w):
        loss, ce, z = chunked_cross_entropy(h, w, targets, mask, 9.0, chunk, zc)
        return 2.5 * loss, (ce, z)  # an outer weight: the cotangent reaching the custom VJP is 2.5

    (ref, (ce0, z0)), g0 = jax.jit(jax.value_and_grad(whole, argnums=(0, 1), has_aux=True))(hidden, head)
    (tot, (ce1, z1)), g1 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(hidden, head)
    for a, b in ((tot, ref), (ce1, ce0), (z1, z0), (g1[0], g0[0]), (g1[1], g0[1])):
        assert _rel(a, b) <= 1e-6
    # n_valid defaults to the mask's count, as cross_entropy's; without a gradient, values only
    assert _rel(chunked_cross_entropy(hidden, head, targets, mask, chunk_tokens=chunk)[1],
                _whole(hidden, head, targets, mask)[0]) <= 1e-6


def test_chunked_bf16():
    hidden, head, targets, mask = _data(dtype=jnp.bfloat16)
    _, ce, z = chunked_cross_entropy(hidden, head, targets, mask, chunk_tokens=8)
    ce0, z0 = _whole(hidden, head, targets, mask)
    assert _rel(ce, ce0) < 1e-5 and _rel(z, z0) < 1e-5  # same bf16 inputs, fp32 logits both ways
    g = jax.grad(lambda h: chunked_cross_entropy(h, head, targets, mask, chunk_tokens=8)[0])(hidden)
    g0 = jax.grad(lambda h: _whole(h, head, targets, mask)[0])(hidden)
    assert g.dtype == jnp.bfloat16 and _rel(g.astype(jnp.float32), g0.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time
def test_model_grads_equal_with_chunked_ce(tied):
    b, s = 4, 8
    tok = jax.random.randint(jax.random.key(1), (b, s + 1), 0, 256)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:],
             "mask": jnp.ones((b, s), jnp.float32).at[0, :3].set(0.0)}
    out = {}
    for chunk in (0, 12):
        cfg = load_config("tiny", overrides=[
            f"train.seq_len={s}", f"train.batch_size={b}", "train.micro_batches=2",
            "train.z_loss_coef=0.1", f"model.tie_embeddings={str(tied).lower()}",
            f"compute.ce_chunk_tokens={chunk}"])
        params, buffers = init_params(cfg, 0)
        compiled = jax.jit(make_grad_fn(Model(cfg))).lower(params, buffers, batch).compile()
        out[chunk] = compiled(params, buffers, batch)
        if chunk:
            hlo = compiled.as_text()
            # no whole-logits buffer: neither [T, V] nor [B, S, V] (micro-batch T = 16, V = 256)
            assert "f32[16,256]" not in hlo and "f32[2,8,256]" not in hlo
            assert "f32[12,256]" in hlo  # one chunk's logits
    (g0, m0, _), (g1, m1, _) = out[0], out[12]
    for k in ("loss", "ce", "z_loss"):
        assert _rel(m1[k], m0[k]) <= 1e-6, k
    for (path, a), c in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        assert _rel(c, a) <= 1e-6, jax.tree_util.keystr(path)


def test_negative_chunk_is_a_config_error():
    with pytest.raises(ConfigError, match="ce_chunk_tokens"):
        load_config("tiny", overrides=["compute.ce_chunk_tokens=-1"])
