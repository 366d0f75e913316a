"""Expert compute paths: dense, ragged and blocked agree in output and every gradient; dropping
follows the numpy reference of the capacity rule; experts without tokens get exactly zero grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config.schema import MoEConfig
from jaxmoe.model.experts import capacity, expert_ffn, grouped_swiglu

PATHS = ("dense", "ragged", "blocked")
T, D, I, E = 40, 16, 24, 8


def _weights(key, e=E):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "gate_proj": jax.random.normal(k1, (e, D, I)) * 0.3,
        "up_proj": jax.random.normal(k2, (e, D, I)) * 0.3,
        "down_proj": jax.random.normal(k3, (e, I, D)) * 0.3,
    }


def _routing(key, k, banned=()):
    logits = jax.random.normal(key, (T, E))
    for b in banned:
        logits = logits.at[:, b].set(-1e9)
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), k)
    return idx.astype(jnp.int32), w


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / max(float(jnp.linalg.norm(b.ravel())), 1e-30))


def _run_all(idx, w, cfg):
    x = jax.random.normal(jax.random.key(1), (T, D))
    weights = _weights(jax.random.key(2))
    probe = jax.random.normal(jax.random.key(3), (T, D))

    def loss(x, weights, w, path):
        y, stats = expert_ffn(x, idx, w, weights, cfg, path=path)
        return jnp.sum(y * probe), (y, stats)

    out = {}
    for path in PATHS:
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
        (_, (y, stats)), grads = fn(x, weights, w, path)
        out[path] = (y, stats, grads)
    return out


def _assert_paths_agree(out):
    y0, s0, g0 = out["dense"]
    for path in ("ragged", "blocked"):
        y, s, g = out[path]
        assert _rel(y, y0) <= 1e-5, path
        np.testing.assert_array_equal(s["counts"], s0["counts"])
        assert int(s["dropped"]) == 0
        leaves0, leaves = jax.tree.leaves(g0), jax.tree.leaves(g)
        assert len(leaves) == 5  # x, gate_proj, up_proj, down_proj, topk_weights
        for a, b in zip(leaves, leaves0):
            assert _rel(a, b) <= 1e-5, path


@pytest.mark.parametrize("k", [2, 3])
def test_paths_agree_normal_routing(k):
    cfg = MoEConfig(n_experts=E, top_k=k, expert_ffn_dim=I, block_size=4)
    idx, w = _routing(jax.random.key(0), k)
    out = _run_all(idx, w, cfg)
    _assert_paths_agree(out)
    # the output is not trivially zero, and matches a per-token numpy reference
    x = np.asarray(jax.random.normal(jax.random.key(1), (T, D)), np.float64)
    wt = {n: np.asarray(v, np.float64) for n, v in _weights(jax.random.key(2)).items()}
    ref = np.zeros((T, D))
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            g = x[t] @ wt["gate_proj"][e]
            h = g / (1 + np.exp(-g)) * (x[t] @ wt["up_proj"][e])
            ref[t] += float(w[t, j]) * (h @ wt["down_proj"][e])
    got = np.asarray(out["blocked"][0], np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-5


def test_empty_experts_get_exactly_zero_gradient():
    cfg = MoEConfig(n_experts=E, top_k=2, expert_ffn_dim=I, block_size=4)
    idx, w = _routing(jax.random.key(4), 2, banned=(1, 5, 6))
    out = _run_all(idx, w, cfg)
    _assert_paths_agree(out)
    for path in PATHS:
        gw = out[path][2][1]
        for name in gw:
            assert float(jnp.abs(gw[name][jnp.asarray([1, 5, 6])]).max()) == 0.0, (path, name)
            assert float(jnp.abs(gw[name][0]).max()) > 0, (path, name)
        np.testing.assert_array_equal(np.asarray(out[path][1]["counts"])[[1, 5, 6]], 0)


def test_all_tokens_to_one_expert():
    cfg = MoEConfig(n_experts=E, top_k=1, expert_ffn_dim=I, block_size=8)
    idx = jnp.full((T, 1), 3, jnp.int32)
    w = jax.random.uniform(jax.random.key(5), (T, 1))
    out = _run_all(idx, w, cfg)
    _assert_paths_agree(out)
    gw = out["blocked"][2][1]["gate_proj"]
    assert float(jnp.abs(jnp.delete(gw, 3, axis=0)).max()) == 0.0
    np.testing.assert_array_equal(out["ragged"][1]["counts"], [0, 0, 0, T, 0, 0, 0, 0])
    # k = 2 with every first choice on expert 0 and every second on expert 7
    cfg2 = MoEConfig(n_experts=E, top_k=2, expert_ffn_dim=I, block_size=8)
    idx2 = jnp.tile(jnp.asarray([[0, 7]], jnp.int32), (T, 1))
    _assert_paths_agree(_run_all(idx2, jax.random.uniform(jax.random.key(6), (T, 2)), cfg2))


@pytest.mark.parametrize("run_rows", [8, 12])
def test_blocked_runs_cover_long_groups_and_every_tail(monkeypatch, run_rows):
    """Groups longer than one run (several full runs) and remainders needing each tail length.

    With ``RUN_ROWS`` 8 or 12 and block 2, runs are 4 blocks (12 rounds down to a power of
    two), tails 2 and 1; the skewed routing gives groups of many lengths, incl. one of 40 rows.
    """
    from jaxmoe.model import blocked

    monkeypatch.setattr(blocked, "RUN_ROWS", run_rows)
    cfg = MoEConfig(n_experts=E, top_k=2, expert_ffn_dim=I, block_size=2)
    logits = jax.random.normal(jax.random.key(11), (T, E)) + jnp.asarray([9.0] + [0.0] * (E - 1))
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), 2)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=E)
    assert counts[0] == T and ((counts[1:] % 2) == 1).any() and (counts[1:] >= 9).any()
    _assert_paths_agree(_run_all(idx.astype(jnp.int32), w, cfg))


def _numpy_keep(idx, e, cap):
    """Reference drop rule: fill slots in (choice rank, token) order."""
    t, k = idx.shape
    fill = np.zeros(e, int)
    keep = np.zeros((t, k), bool)
    for j in range(k):
        for i in range(t):
            ex = idx[i, j]
            if fill[ex] < cap:
                keep[i, j] = True
            fill[ex] += 1
    return keep


@pytest.mark.parametrize("cf", [0.5, 0.75, 1.0])
def test_dense_capacity_drops_match_numpy(cf):
    k = 2
    cfg = MoEConfig(n_experts=E, top_k=k, expert_ffn_dim=I, capacity_factor=cf)
    # skewed routing so that some experts overflow
    logits = jax.random.normal(jax.random.key(7), (T, E)) + jnp.linspace(2, 0, E)
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), k)
    cap = capacity(cfg, T)
    assert cap == int(np.ceil(cf * T * k / E))
    keep = _numpy_keep(np.asarray(idx), E, cap)
    x = jax.random.normal(jax.random.key(1), (T, D))
    weights = _weights(jax.random.key(2))
    y, stats = jax.jit(lambda *a: expert_ffn(*a, cfg, path="dense"))(x, idx, w, weights)
    assert int(stats["dropped"]) == int((~keep).sum())
    if cf < 1.0:
        assert int(stats["dropped"]) > 0
    np.testing.assert_array_equal(stats["counts"], np.bincount(np.asarray(idx).ravel(), minlength=E))
    # a dropped pair contributes zero and the token's other weights are not renormalised
    y_ref, _ = jax.jit(lambda *a: expert_ffn(*a, cfg, path="ragged"))(x, idx, w * jnp.asarray(keep), weights)
    assert _rel(y, y_ref) <= 1e-5


def test_capacity_factor_zero_is_dropless():
    cfg = MoEConfig(n_experts=E, top_k=2, capacity_factor=0.0)
    assert capacity(cfg, T) == T


@pytest.mark.parametrize("path", ["ragged", "blocked"])
def test_grouped_swiglu_padding_rows_are_zero(path):
    weights = _weights(jax.random.key(8))
    gs = jnp.asarray([3, 0, 5, 1, 0, 0, 2, 4], jnp.int32)  # 15 rows used
    x = jax.random.normal(jax.random.key(9), (20, D))
    y = jax.jit(lambda *a: grouped_swiglu(*a, path=path, moe_cfg=MoEConfig(block_size=4)))(x, gs, weights)
    assert float(jnp.abs(y[15:]).max()) == 0.0
    experts = np.repeat(np.arange(E), np.asarray(gs))
    xn = np.asarray(x, np.float64)
    for r, e in enumerate(experts):
        g = xn[r] @ np.asarray(weights["gate_proj"][e])
        h = g / (1 + np.exp(-g)) * (xn[r] @ np.asarray(weights["up_proj"][e]))
        np.testing.assert_allclose(y[r], h @ np.asarray(weights["down_proj"][e]), rtol=1e-4, atol=1e-5)


def test_bf16_paths_run_and_roughly_agree():
    cfg = MoEConfig(n_experts=E, top_k=2, expert_ffn_dim=I, block_size=4)
    idx, w = _routing(jax.random.key(0), 2)
    x = jax.random.normal(jax.random.key(1), (T, D)).astype(jnp.bfloat16)
    weights = _weights(jax.random.key(2))
    ys = {p: jax.jit(lambda *a, p=p: expert_ffn(*a, cfg, path=p)[0])(x, idx, w, weights) for p in PATHS}
    for p in PATHS:
        assert ys[p].dtype == jnp.bfloat16
        assert _rel(ys[p].astype(jnp.float32), ys["dense"].astype(jnp.float32)) < 2e-2
    def loss(wt):
        return jnp.sum(expert_ffn(x, idx, w, wt, cfg, path="blocked")[0].astype(jnp.float32))

    g = jax.jit(jax.grad(loss))(weights)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(g))
