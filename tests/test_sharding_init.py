"""Start-up at scale: parameters and optimizer state are created under ``jit`` with the
rule-derived output shardings (jaxmoe.model.transformer.init_fn, jaxmoe.train.step.opt_init_fn -- the
programs jaxmoe.train.loop.Trainer runs for a fresh state), so each device materialises only its own
shard: the compiled programs' output shardings equal MeshContext.state_shardings, and the
partitioned programs never hold a sharded leaf at its full (global) shape."""

import dataclasses

import jax
import numpy as np

from jaxmoe.config import load_config
from jaxmoe.model.transformer import abstract_params, declared_groups, init_fn, init_params
from jaxmoe.parallel.mesh import build_context, parse_mesh
from jaxmoe.train.optim import build_optimizer
from jaxmoe.train.step import init_state, opt_init_fn


def _shape_str(x, shape):
    return f"{'f32' if x.dtype == np.float32 else x.dtype.name}[{','.join(map(str, shape))}]"


def test_jitted_init_materialises_only_each_devices_shard():
    cfg = load_config("tiny", overrides=["optim.optimizer=muon"])
    cfg = cfg.replace(mesh=dataclasses.replace(cfg.mesh, expert_axes="fsdp,expert"))
    cfg, ctx = build_context(cfg, parse_mesh("fsdp=2,expert=4"))
    params, buffers = abstract_params(cfg)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    abstract = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
    sh = ctx.state_shardings(abstract)

    pinit = init_fn(cfg, (sh["params"], sh["buffers"]))
    compiled = pinit.lower(0).compile()
    got = jax.tree.leaves(compiled.output_shardings)
    want = jax.tree.leaves((sh["params"], sh["buffers"]))
    assert len(got) == len(want)
    for g, w, x in zip(got, want, jax.tree.leaves((params, buffers))):
        assert g.is_equivalent_to(w, x.ndim), (g, w)
    text = compiled.as_text()
    leaves = jax.tree.leaves((params, buffers))
    # (a full shape that is also some other leaf's per-device shape cannot be told apart by text)
    shard_shapes = {_shape_str(x, w.shard_shape(x.shape)) for x, w in zip(leaves, want)}
    n_sharded = 0
    for x, w in zip(leaves, want):
        shard = w.shard_shape(x.shape)
        if shard != x.shape and _shape_str(x, x.shape) not in shard_shapes:
            # a sharded leaf: never built whole in the partitioned program
            n_sharded += 1
            assert _shape_str(x, x.shape) not in text, x.shape
            assert _shape_str(x, shard) in text, shard
    assert n_sharded >= 8

    p, b = pinit(0)  # the values: those of the unsharded init, bit for bit
    ref_p, ref_b = init_params(cfg, cfg.train.seed)
    for a, r in zip(jax.tree.leaves((p, b)), jax.tree.leaves((ref_p, ref_b))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    e = p["moe"]["experts"]["gate_proj"]
    assert {s.data.shape for s in e.addressable_shards} == {(e.shape[0], 1, *e.shape[2:])}  # one expert each

    oinit = opt_init_fn(cfg, tx, sh)
    compiled = oinit.lower(p, b).compile()
    want = jax.tree.leaves({k: v for k, v in sh.items() if k not in ("params", "buffers")})
    absr = jax.tree.leaves({k: v for k, v in abstract.items() if k not in ("params", "buffers")})
    got = jax.tree.leaves(compiled.output_shardings)
    assert len(got) == len(want)
    text = compiled.as_text()
    shard_shapes = {_shape_str(x, w.shard_shape(x.shape)) for x, w in zip(absr, want)}
    for g, w, x in zip(got, want, absr):
        assert g.is_equivalent_to(w, len(x.shape))
        if w.shard_shape(x.shape) != x.shape and _shape_str(x, x.shape) not in shard_shapes:
            assert _shape_str(x, x.shape) not in text, x.shape
    # the experts' optimizer state (Muon momentum [Lm, E, D, I]) is never built whole
    assert "f32[2,8,64,64]" not in text
