"""FlexShard: owner-placed Muon (jaxmoe/train/muon_placement.py) equals single-device Muon, and the compiled
(SPMD-partitioned) optimizer update moves what it should: nothing for experts held whole, fewer
bytes than an all-gather of every matrix for dense matrices (jaxmoe/plan/hlo_stats.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.config import load_config
from jaxmoe.model.transformer import abstract_params, declared_groups
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import declared_axes_flat, param_specs
from jaxmoe.plan.hlo_stats import count_collectives, optimizer_update_collectives, total
from jaxmoe.train.muon_placement import ns_flops, owner_placed, placement, plan_owners
from jaxmoe.train.optim import build_optimizer, param_labels
from jaxmoe.trees import key_path_str

MESHES = {"fsdp2xexpert4": dict(replica=1, fsdp=2, expert=4, tensor=1),
          "fsdp8": dict(replica=1, fsdp=8, expert=1, tensor=1)}


def _cfg(placement="owner"):
    return load_config("tiny", overrides=["optim.optimizer=muon", "optim.muon_ns_dtype=float32",
                                          "optim.grad_clip=0", f"optim.muon_placement={placement}"])


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        out.update(_flat(v, p) if isinstance(v, dict) else {p: v})
    return out


def _factored_specs(cfg, sizes):
    """The rules' specs with every expert leaf's E axis over fsdp x expert (whole experts per
    device: the factored-mesh layout), written as parameter shardings, not as a rule."""
    params, _ = abstract_params(cfg)
    axes = declared_axes_flat(cfg)
    specs = param_specs(params, axes, sizes)

    def fix(path, spec):
        ax = axes[path]
        if "experts" not in ax:
            return spec
        live = tuple(a for a in ("fsdp", "expert") if sizes[a] > 1)
        return P(*[(live if len(live) > 1 else live[0]) if name == "experts" else None for name in ax])

    flat = {p: fix(p, s) for p, s in _flat(specs).items()}
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: flat[key_path_str(kp)], params)


# ------------------------------------------------------------------------------------------
# the owner plan
# ------------------------------------------------------------------------------------------


def test_plan_owners_balances_ns_cost_and_keeps_buffers_minimal():
    classes = {"big": (5, (64, 128)), "mid": (3, (32, 32)), "small": (7, (8, 16))}
    plans, load = plan_owners(classes, 4)
    for key, (m, shape) in classes.items():
        slots = plans[key].slots
        assert slots.shape == (4, math.ceil(m / 4))  # K = ceil(M / N)
        assert sorted(slots[slots >= 0].tolist()) == list(range(m))  # each matrix exactly once
        flat = slots.reshape(-1)
        assert all(flat[plans[key].where[i]] == i for i in range(m))  # where inverts slots
    expected = np.zeros(4)
    for key, (m, shape) in classes.items():
        for d in range(4):
            expected[d] += (plans[key].slots[d] >= 0).sum() * ns_flops(shape)
    np.testing.assert_allclose(load, expected)
    # LPT by hand: the 5 big ones go 0,1,2,3 then 0 (K=2); the 3 mid to 1,2,3; small fill after
    assert plans["big"].slots[:, 0].tolist() == [0, 1, 2, 3] and plans["big"].slots[0, 1] == 4
    assert sorted(plans["mid"].slots[1:, 0].tolist()) == [0, 1, 2]
    assert load.max() - load.min() <= ns_flops((64, 128))


def test_owner_placed_reads_shardings_not_rules():
    mesh = make_mesh(MESHES["fsdp2xexpert4"])
    sh = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    shardings = {"experts_whole": sh(None, ("fsdp", "expert"), None, None),
                 "experts_split": sh(None, "expert", "fsdp", None),
                 "dense": sh(None, ("fsdp", "expert"), None),
                 "replicated": sh()}
    shapes = {"experts_whole": (2, 8, 16, 16), "experts_split": (2, 8, 16, 16), "dense": (2, 16, 8),
              "replicated": (2, 8, 8)}
    assert owner_placed(shardings, shapes) == ["dense", "replicated"]
    assert [placement(shardings[k], len(shapes[k])) for k in sorted(shapes)] == \
        ["owner", "gather", "local", "owner"]


# ------------------------------------------------------------------------------------------
# the optimizer on a mesh: values and collectives
# ------------------------------------------------------------------------------------------


def _run(cfg, params, grads, shardings):
    groups = declared_groups(cfg)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, groups, shardings)
    if shardings is not None:
        params = jax.device_put(params, shardings)
    state = tx.init(params)
    update = jax.jit(tx.update)
    ups = []
    for g in grads:
        if shardings is not None:
            g = jax.device_put(g, shardings)
        u, state = update(g, state, params)
        params = jax.tree.map(lambda p, d: p + d, params, u)
        ups.append(jax.tree.map(np.asarray, u))
    return jax.tree.map(np.asarray, params), ups


_REF: dict = {}


@pytest.mark.parametrize("mesh_name,layout", [
    ("fsdp2xexpert4", "factored"),  # experts whole over fsdp x expert: in place
    ("fsdp2xexpert4", "rules"),  # this tree's rules: E over expert, `in` over fsdp -> gathered
    pytest.param("fsdp8", "factored", marks=pytest.mark.slow)])
def test_owner_update_equals_single_device(mesh_name, layout):
    cfg = _cfg()
    sizes = MESHES[mesh_name]
    mesh = make_mesh(sizes)
    specs = (_factored_specs(cfg, sizes) if layout == "factored"
             else param_specs(abstract_params(cfg)[0], declared_axes_flat(cfg), sizes))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    abstract, _ = abstract_params(cfg)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape), jnp.float32), abstract)
    grads = [jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), abstract)
             for _ in range(2)]
    if "ref" not in _REF:  # one device, no placement (shared by both meshes)
        _REF["ref"] = _run(cfg, params, grads, None)
    ref_p, ref_u = _REF["ref"]
    got_p, got_u = _run(cfg, params, grads, shardings)
    labels = _flat(param_labels(declared_groups(cfg)))
    mats = {k: v.shape for k, v in _flat(abstract).items() if labels[k] == "muon"}
    placed = owner_placed(_flat(shardings), mats)
    assert placed and not any("experts" in k for k in placed)  # experts stay where they live
    # Why these tolerances: fp32 Newton-Schulz is itself ~1.2e-6 (relative, Frobenius) from its
    # float64 value on these shapes, and only batching two matrices in one matmul instead of one
    # at a time moves it by up to 7e-7 (measured on XLA:CPU); 5 quintic steps amplify such
    # rounding. So each update (lr * O + decay) agrees to 1e-5 and the parameters to 1e-6.
    for step, (ru, gu) in enumerate(zip(ref_u, got_u)):
        for k, r in _flat(ru).items():  # every parameter, every step's update
            g = _flat(gu)[k]
            rel = np.linalg.norm(g - r) / np.linalg.norm(r)
            assert rel <= 1e-5, (mesh_name, step, k, rel)
    for k, r in _flat(ref_p).items():
        g = _flat(got_p)[k]
        assert np.linalg.norm(g - r) / np.linalg.norm(r) <= 1e-6, k
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-6, err_msg=k)


def test_compiled_update_collectives_factored_mesh():
    """fsdp=2 x expert=4 with experts over both: the compiled expert update has no collective;
    the dense owner-placed update moves fewer bytes than an all-gather of every dense matrix,
    and fewer than the replicated placement."""
    cfg = _cfg()
    sizes = MESHES["fsdp2xexpert4"]
    mesh = make_mesh(sizes)
    specs = _factored_specs(cfg, sizes)
    owner = optimizer_update_collectives(cfg, mesh, specs=specs)
    assert owner["expert"] == {}, owner["expert"]
    ops, moved = total(owner["dense"])
    assert ops > 0 and set(owner["dense"]) == {"all-to-all"}, owner["dense"]
    abstract, _ = abstract_params(cfg)
    labels = _flat(param_labels(declared_groups(cfg)))
    axes = declared_axes_flat(cfg)
    dense_matrices = [v for k, v in _flat(abstract).items() if labels[k] == "muon" and "experts" not in axes[k]]
    allgather_bytes = sum(4 * math.prod(v.shape) for v in dense_matrices)  # fp32, every matrix whole
    assert moved < allgather_bytes, (moved, allgather_bytes)
    repl = optimizer_update_collectives(_cfg("replicated"), mesh, specs=specs)
    assert moved < total(repl["dense"])[1], (owner["dense"], repl["dense"])
    assert "optimizer update" in owner["module"] and "fsdp=2,expert=4" in owner["module"]


def test_count_collectives_parses_sync_async_and_tuples():
    text = """
ENTRY %main (p: f32[4,8]) -> f32[16,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %ag = f32[16,8]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %rs = f32[1,8]{1,0} reduce-scatter(%p), channel_id=2, dimensions={0}, to_apply=%add
  %a2a = (f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}) all-to-all(%s0, %s1, %s2, %s3)
  %ars = bf16[4,8]{1,0} all-reduce-start(%q), channel_id=3, to_apply=%add
  %ard = bf16[4,8]{1,0} all-reduce-done(%ars)
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1}}
  ROOT %ag2 = f32[16,8]{1,0} all-gather(%p), channel_id=4, dimensions={0}
}"""
    got = count_collectives(text)
    assert got == {"all-gather": {"count": 2, "bytes": 2 * 512}, "reduce-scatter": {"count": 1, "bytes": 128},
                   "all-to-all": {"count": 1, "bytes": 128}, "all-reduce": {"count": 1, "bytes": 64},
                   "collective-permute": {"count": 1, "bytes": 128}}
    assert count_collectives("ENTRY %m () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}") == {}
