"""Losses and the expert-bias update against direct numpy computations (docs/LAYOUT.md "Losses")."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import load_config
from jaxmoe.train.losses import (
    compute_loss,
    cross_entropy,
    load_balance_loss,
    router_losses,
    router_z_loss,
    seq_aux_loss,
    update_expert_bias,
    weigh_terms,
)

RNG = np.random.default_rng(0)


def _lse(a):
    m = a.max(-1, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(-1, keepdims=True)))[..., 0]


def test_bias_update_example():
    new = update_expert_bias(jnp.zeros(2), jnp.asarray([10, 0]), 0.1)
    np.testing.assert_allclose(new, [-0.1, 0.1], rtol=1e-6)


def test_bias_update_stacked_matches_numpy():
    bias = RNG.normal(size=(3, 5)).astype(np.float32)
    counts = np.array([[4, 4, 4, 4, 4], [9, 1, 5, 5, 0], [0, 0, 0, 0, 20]])
    delta = 0.01 * np.sign(counts.mean(-1, keepdims=True) - counts)
    delta -= delta.mean(-1, keepdims=True)
    np.testing.assert_allclose(update_expert_bias(jnp.asarray(bias), jnp.asarray(counts), 0.01),
                               bias + delta, rtol=1e-6, atol=1e-7)


def test_cross_entropy_and_z_loss():
    logits = RNG.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = RNG.integers(0, 7, size=(2, 5))
    mask = (RNG.random((2, 5)) > 0.3).astype(np.float32)
    lse = _lse(logits)
    nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    ce_ref = (nll * mask).sum() / mask.sum()
    z_ref = (lse**2 * mask).sum() / mask.sum()
    ce, z = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    np.testing.assert_allclose([ce, z], [ce_ref, z_ref], rtol=1e-5)
    # an explicit global count replaces mask.sum()
    ce, z = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), n_valid=20)
    np.testing.assert_allclose([ce, z], [(nll * mask).sum() / 20, (lse**2 * mask).sum() / 20], rtol=1e-5)


def _random_routing(t, e, k):
    logits = RNG.normal(size=(t, e)).astype(np.float32)
    idx = np.argsort(-logits, axis=-1)[:, :k]
    return logits, idx


def test_load_balance_loss():
    t, e, k = 12, 6, 2
    logits, idx = _random_routing(t, e, k)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    f = np.array([(idx == j).sum() for j in range(e)]) / (t * k)
    ref = e * np.sum(f * p.mean(0))
    np.testing.assert_allclose(load_balance_loss(jnp.asarray(p), jnp.asarray(idx), e), ref, rtol=1e-5)


def test_seq_aux_loss():
    b, s, e, k = 3, 4, 6, 2
    logits, idx = _random_routing(b * s, e, k)
    sc = 1 / (1 + np.exp(-logits))
    sn = sc / sc.sum(-1, keepdims=True)
    per_seq = []
    for i in range(b):
        rows = slice(i * s, (i + 1) * s)
        counts = np.array([(idx[rows] == j).sum() for j in range(e)])
        per_seq.append(np.sum(e / (k * s) * counts * sn[rows].mean(0)))
    ref = np.mean(per_seq)
    got = seq_aux_loss(jnp.asarray(sn), jnp.asarray(idx), b, s, e, k)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_router_z_loss():
    logits = RNG.normal(size=(9, 5)).astype(np.float32) * 4
    np.testing.assert_allclose(router_z_loss(jnp.asarray(logits)), np.mean(_lse(logits) ** 2), rtol=1e-5)


def test_compute_loss_weights_terms():
    cfg = load_config("tiny", overrides=["train.z_loss_coef=0.5", "moe.lb_coef=0.25",
                                         "moe.seq_aux_coef=0.125", "moe.router_z_coef=2"])
    logits = jnp.asarray(RNG.normal(size=(2, 3, 7)).astype(np.float32))
    batch = {"inputs": jnp.zeros((2, 3), jnp.int32), "targets": jnp.ones((2, 3), jnp.int32),
             "mask": jnp.ones((2, 3), jnp.float32)}
    rl = {"lb": jnp.float32(3.0), "seq_aux": jnp.float32(5.0), "router_z": jnp.float32(7.0)}
    ce, z = cross_entropy(logits, batch["targets"], batch["mask"])
    total, m = weigh_terms(cfg, ce, z, rl)
    np.testing.assert_allclose(total, ce + 0.5 * z + 0.75 + 0.625 + 14.0, rtol=1e-6)
    assert set(m) == {"loss", "ce", "z_loss", "lb", "seq_aux", "router_z"}
    np.testing.assert_allclose([m["ce"], m["z_loss"], m["lb"]], [ce, z, 3.0], rtol=1e-6)
    # compute_loss: the same weighting of the router losses of a routing record (one layer)
    e, k, t = cfg.moe.n_experts, cfg.moe.top_k, 6
    rlogits = jnp.asarray(RNG.normal(size=(1, t, e)).astype(np.float32))
    scores = jax.nn.softmax(rlogits, -1)
    router = {"logits": rlogits, "scores": scores, "topk_idx": jax.lax.top_k(scores, k)[1]}
    total2, m2 = compute_loss(cfg, logits, {"router": router}, batch)
    rl2 = router_losses(cfg, router, 2, 3)
    np.testing.assert_allclose(total2, weigh_terms(cfg, ce, z, rl2)[0], rtol=1e-6)
    assert float(m2["lb"]) > 0 and float(m2["router_z"]) > 0
