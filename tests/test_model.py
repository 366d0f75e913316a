"""Whole model: parameter layout and counts, path equivalence of logits and every gradient,
causality, bf16, remat modes, forced routing replay, the NNX wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import load_config
from jaxmoe.config.counting import count_params
from jaxmoe.model.transformer import Model, Transformer, apply_model, init_params, param_count
from jaxmoe.train.objective import model_loss

B, S = 2, 8


def _cfg(name, *overrides):
    return load_config(name, overrides=[f"train.seq_len={S}", *overrides])


def _batch(vocab=256, seed=0):
    tok = jax.random.randint(jax.random.key(seed), (B, S + 1), 0, vocab)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": jnp.ones((B, S), jnp.float32)}


def _shapes(tree):
    return jax.tree.map(lambda a: tuple(a.shape), tree)


def test_init_shapes_match_layout_tiny_mla():
    cfg = _cfg("tiny-mla")
    params, buffers = init_params(cfg, 0)
    # docs/LAYOUT.md with D=64, V=256, H=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16,
    # Ld=1 (F=128), Lm=2, E=8, I=32, one shared expert (S=32), untied head
    attn = lambda n: {  # noqa: E731
        "q_a_proj": (n, 64, 32), "q_a_norm": (n, 32), "q_b_proj": (n, 32, 4 * 24),
        "kv_a_proj": (n, 64, 40), "kv_a_norm": (n, 32), "kv_b_proj": (n, 32, 4 * 32),
        "o_proj": (n, 64, 64),
    }
    expected = {
        "embed": (256, 64),
        "dense": {"attn_norm": (1, 64), "ffn_norm": (1, 64), "attn": attn(1),
                  "mlp": {"gate_proj": (1, 64, 128), "up_proj": (1, 64, 128), "down_proj": (1, 128, 64)}},
        "moe": {"attn_norm": (2, 64), "ffn_norm": (2, 64), "attn": attn(2), "router": (2, 64, 8),
                "experts": {"gate_proj": (2, 8, 64, 32), "up_proj": (2, 8, 64, 32), "down_proj": (2, 8, 32, 64)},
                "shared": {"gate_proj": (2, 64, 32), "up_proj": (2, 64, 32), "down_proj": (2, 32, 64)}},
        "final_norm": (64,),
        "lm_head": (64, 256),
    }
    assert _shapes(params) == expected
    assert _shapes(buffers) == {"moe": {"expert_bias": (2, 8)}}
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves((params, buffers)))
    np.testing.assert_array_equal(params["moe"]["attn"]["kv_a_norm"], 1.0)
    assert float(jnp.std(params["moe"]["experts"]["gate_proj"])) == pytest.approx(0.02, rel=0.05)


def test_init_shapes_match_layout_tiny():
    cfg = _cfg("tiny", "model.tie_embeddings=true")
    params, buffers = init_params(cfg, 0)
    expected = {
        "embed": (256, 64),
        "moe": {"attn_norm": (2, 64), "ffn_norm": (2, 64),
                "attn": {"q_proj": (2, 64, 64), "k_proj": (2, 64, 32), "v_proj": (2, 64, 32),
                         "o_proj": (2, 64, 64), "q_norm": (2, 16), "k_norm": (2, 16)},
                "router": (2, 64, 8),
                "experts": {"gate_proj": (2, 8, 64, 64), "up_proj": (2, 8, 64, 64), "down_proj": (2, 8, 64, 64)}},
        "final_norm": (64,),
    }
    assert _shapes(params) == expected and buffers == {}


@pytest.mark.parametrize("name", ["tiny", "tiny-mla", "mixtral-tiny"])
def test_param_count_matches_analytic(name):
    cfg = load_config(name)
    assert param_count(init_params(cfg, 0)[0]) == count_params(cfg)["total_params"]


def _loss_and_grads(cfg, params, buffers, batch):
    """One compiled program: loss, metrics, aux (with the logits as aux["logits"]) and grads."""

    def fn(p):
        (loss, (metrics, aux)), grads = jax.value_and_grad(
            lambda p: model_loss(Model(cfg), p, buffers, batch), has_aux=True)(p)
        aux = dict(aux, logits=apply_model(cfg, p, buffers, batch["inputs"])[0])
        return loss, metrics, aux, grads

    return jax.jit(fn)(params)


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / max(float(jnp.linalg.norm(b.ravel())), 1e-30))


@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-mla", marks=pytest.mark.slow)])  # CI time
def test_paths_give_equal_logits_and_grads(name):
    batch = _batch()
    results = {}
    for path in ("dense", "ragged", "blocked"):
        cfg = _cfg(name, f"moe.compute_path={path}", "moe.seq_aux_coef=0.01", "moe.router_z_coef=0.01")
        params, buffers = init_params(cfg, 0)
        if buffers:  # exercise the selection bias
            buffers = {"moe": {"expert_bias": jax.random.normal(jax.random.key(3), (2, 8)) * 0.01}}
        results[path] = _loss_and_grads(cfg, params, buffers, batch)
    l0, m0, a0, g0 = results["dense"]
    assert np.isfinite(float(l0))
    assert all(float(m0[k]) > 0 for k in ("ce", "lb", "seq_aux", "router_z"))
    for path in ("ragged", "blocked"):
        l, m, a, g = results[path]
        assert _rel(l, l0) <= 1e-6
        assert _rel(a["logits"], a0["logits"]) <= 1e-5
        np.testing.assert_array_equal(a["router"]["topk_idx"], a0["router"]["topk_idx"])
        flat0 = jax.tree_util.tree_flatten_with_path(g0)[0]
        flat = dict(jax.tree_util.tree_flatten_with_path(g)[0])
        assert len(flat) == len(flat0)
        for key, v0 in flat0:
            assert float(jnp.linalg.norm(v0)) > 0, key
            assert _rel(flat[key], v0) <= 1e-5, (path, jax.tree_util.keystr(key))


def test_aux_probes_and_forced_replay():
    cfg = _cfg("tiny-mla")
    params, buffers = init_params(cfg, 0)
    tok = _batch()["inputs"]

    @jax.jit
    def run(p, b, t, f):
        plain = apply_model(cfg, p, b, t, return_probes=True)
        forced = apply_model(cfg, p, b, t, forced_idx=f)
        return plain, forced

    (logits, aux), _ = run(params, buffers, tok, jnp.zeros((2, B * S, 2), jnp.int32))
    forced_idx = aux["router"]["topk_idx"]
    t = B * S
    assert logits.dtype == jnp.float32 and logits.shape == (B, S, 256)
    assert _shapes(aux["router"]) == {"logits": (2, t, 8), "scores": (2, t, 8), "topk_idx": (2, t, 2),
                                      "topk_weights": (2, t, 2)}
    assert aux["counts"].shape == (2, 8) and aux["dropped"].shape == (2,)
    np.testing.assert_array_equal(aux["counts"].sum(-1), t * 2)
    pr = aux["probes"]
    assert _shapes(pr) == {"embedding": (B, S, 64), "attn_out": (3, B, S, 64), "router_logits": (2, t, 8),
                           "moe_out": (2, B, S, 64), "ffn_out": (1, B, S, 64), "final_hidden": (B, S, 64),
                           "logits": (B, S, 256)}
    np.testing.assert_array_equal(pr["logits"], logits)
    # forced routing: replaying the model's own choice reproduces the logits; replaying a
    # different routing changes them and is reported back as the routing used
    other = (forced_idx + 1) % 8
    (_, _), (logits_o, aux_o) = run(params, buffers, tok, other)
    np.testing.assert_array_equal(aux_o["router"]["topk_idx"], other)
    assert float(jnp.abs(logits_o - logits).max()) > 1e-5
    (_, _), (logits_f, aux_f) = run(params, buffers, tok, forced_idx)
    assert _rel(logits_f, logits) <= 1e-6


def test_causality():
    cfg = _cfg("tiny-mla")
    params, buffers = init_params(cfg, 1)
    f = jax.jit(lambda t: apply_model(cfg, params, buffers, t)[0])
    tok = _batch()["inputs"]
    tok2 = tok.at[:, 5].set((tok[:, 5] + 1) % 256)
    a, b = f(tok), f(tok2)
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(a[:, 5:] - b[:, 5:]).max()) > 1e-4


def test_bf16_runs():
    cfg32 = _cfg("tiny")
    cfg16 = _cfg("tiny", "compute.dtype=bfloat16")
    params, buffers = init_params(cfg32, 0)
    batch = _batch()
    l16, m16, _, g16 = _loss_and_grads(cfg16, params, buffers, batch)
    # fp32 CE of random-init logits is ~log(256) = 5.55; bf16 must land close to it
    assert np.isfinite(float(l16)) and abs(float(m16["ce"]) - np.log(256)) < 0.1
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g16))


@pytest.mark.parametrize("mode", ["full", pytest.param("save_dots", marks=pytest.mark.slow),
                                  pytest.param("offload", marks=pytest.mark.slow)])  # CI time
def test_remat_modes_match_none(mode):
    batch = _batch()
    cfg = _cfg("tiny")
    params, buffers = init_params(cfg, 0)
    l0, _, _, g0 = _loss_and_grads(cfg, params, buffers, batch)
    cfg_m = _cfg("tiny", f"compute.remat={mode}")
    l, _, _, g = _loss_and_grads(cfg_m, params, buffers, batch)
    assert _rel(l, l0) <= 1e-6, mode
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        assert _rel(a, b) <= 1e-5, mode


def test_nnx_module_matches_functional():
    cfg = _cfg("mixtral-tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    params, buffers = model.pure()
    assert param_count(params) == count_params(cfg)["total_params"]
    tok = _batch()["inputs"]
    np.testing.assert_array_equal(model(tok)[0], apply_model(cfg, params, buffers, tok)[0])


def _layer_scan_unrolls(cfg, params, buffers):
    """The ``unroll`` of every scan over the layer stack in the model's jaxpr."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan" and eqn.params["length"] == cfg.model.n_layers:
                found.append(eqn.params["unroll"])
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    if hasattr(sub, "jaxpr"):
                        walk(getattr(sub.jaxpr, "jaxpr", sub.jaxpr))

    tokens = jnp.zeros((B, S), jnp.int32)
    walk(jax.make_jaxpr(lambda p: apply_model(cfg, p, buffers, tokens)[0])(params).jaxpr)
    return found


def test_scan_unroll_matches_rolled_scan():
    """compute.scan_unroll: every layer unrolled (0) and 2 layers per iteration of a 3-layer stack
    (one iteration and a remainder) give the rolled scan's loss and every gradient."""
    batch = _batch()
    cfg = _cfg("tiny", "model.n_layers=3", "compute.scan_unroll=1")  # the rolled scan (auto: 0 here)
    params, buffers = init_params(cfg, 0)
    l0, _, _, g0 = _loss_and_grads(cfg, params, buffers, batch)
    assert _layer_scan_unrolls(cfg, params, buffers) == [1]
    ref = jax.tree_util.tree_flatten_with_path(g0)[0]
    for unroll in (0, 2):
        cfg_u = _cfg("tiny", "model.n_layers=3", f"compute.scan_unroll={unroll}")
        l, _, _, g = _loss_and_grads(cfg_u, params, buffers, batch)
        assert _rel(l, l0) <= 1e-6, unroll
        assert _layer_scan_unrolls(cfg_u, params, buffers) == [unroll or 3]
        got = jax.tree_util.tree_flatten_with_path(g)[0]
        assert [p for p, _ in got] == [p for p, _ in ref]
        for (path, a), (_, b) in zip(got, ref):
            assert _rel(a, b) <= 1e-6, (unroll, jax.tree_util.keystr(path), _rel(a, b))
