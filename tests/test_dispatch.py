"""Expert-parallel dispatchers (jaxmoe/parallel/expert_dispatch.py) against the single-device expert FFN.

Every dispatcher that runs on CPU (all_to_all, allgather, chunked variants, and the ragged
dispatcher's index arithmetic through an all_gather emulation of ragged_all_to_all) must give the
output, the expert counts and the gradient of x, of the gate weights and of all three expert weight
stacks of ``jaxmoe.model.experts.expert_ffn`` on one device.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import UserError
from jaxmoe.model.experts import expert_ffn
from jaxmoe.parallel.expert_dispatch import make_dispatch, resolve_dispatcher
from jaxmoe.parallel.mesh import make_mesh, parse_mesh, resolve_mesh_shape

T, D, I, E, K = 128, 16, 8, 8, 2


def _cfg(**mesh):
    cfg = load_config("tiny")
    moe = dataclasses.replace(cfg.moe, n_experts=E, top_k=K, expert_ffn_dim=I, block_size=4)
    return cfg.replace(moe=moe, mesh=dataclasses.replace(cfg.mesh, **mesh))


def _inputs(seed=0, skew=False):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, D), jnp.float32)
    logits = jax.random.normal(ks[1], (T, E))
    if skew:  # make experts 0 and 1 popular so capacities overflow
        logits = logits + jnp.array([3.0, 2.0] + [0.0] * (E - 2))
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
    w = w / w.sum(-1, keepdims=True)
    weights = {
        "gate_proj": 0.3 * jax.random.normal(ks[2], (E, D, I)),
        "up_proj": 0.3 * jax.random.normal(ks[3], (E, D, I)),
        "down_proj": 0.3 * jax.random.normal(ks[4], (E, I, D)),
    }
    return x, idx.astype(jnp.int32), w, weights


def _loss_fn(ffn, moe_cfg):
    def f(x, w, weights, idx):
        y, st = ffn(x, idx, w, weights, moe_cfg)
        # a non-uniform scalar so every output element matters to the gradient
        proj = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
        return jnp.sum(y * proj), (y, st)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


@pytest.fixture(scope="module")
def reference():
    cfg = _cfg()
    x, idx, w, weights = _inputs()
    (loss, (y, st)), grads = _loss_fn(expert_ffn, cfg.moe)(x, w, weights, idx)
    return (x, idx, w, weights), (loss, y, st, grads)


def _close(a, b, rtol=1e-5, atol=1e-6, what=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


slow = pytest.mark.slow
CASES = [
    ("expert=8", "all_to_all", 1),
    pytest.param("fsdp=8", "all_to_all", 1, marks=slow),
    pytest.param("replica=2,fsdp=2,expert=2", "all_to_all", 1, marks=slow),
    ("expert=4,fsdp=2", "all_to_all", 1),
    ("expert=2,tensor=2,fsdp=2", "all_to_all", 1),
    pytest.param("expert=8", "allgather", 1, marks=slow),
    ("expert=4,fsdp=2", "allgather", 1),
    ("expert=4,fsdp=2", "ragged_all_to_all_emulated", 1),
    ("expert=4,fsdp=2", "all_to_all", 2),
    ("expert=8", "allgather", 2),
]


# experts over fsdp x expert (mesh.expert_axes = "fsdp,expert"): whole experts on every device,
# the collectives over the product of both axes
FACTORED = [
    ("fsdp=2,expert=4", "all_to_all", 1, "fsdp,expert"),
    pytest.param("replica=2,fsdp=2,expert=2", "all_to_all", 2, "fsdp,expert", marks=slow),
    pytest.param("fsdp=2,expert=4", "allgather", 1, "fsdp,expert", marks=slow),
    ("fsdp=2,expert=2,tensor=2", "ragged_all_to_all_emulated", 1, "fsdp,expert"),
]


@pytest.mark.parametrize("mesh_spec,kind,chunks,expert_axes", [c + ("expert",) for c in CASES if type(c) is tuple]
                         + [pytest.param(*c.values, "expert", marks=c.marks) for c in CASES if type(c) is not tuple]
                         + FACTORED)
def test_dispatch_matches_single_device(reference, mesh_spec, kind, chunks, expert_axes):
    (x, idx, w, weights), (loss0, y0, st0, g0) = reference
    cfg = _cfg(dispatch_chunks=chunks, expert_axes=expert_axes)
    mesh = make_mesh(resolve_mesh_shape(parse_mesh(mesh_spec), 8))
    fn = make_dispatch(cfg, mesh, kind)
    (loss, (y, st)), g = _loss_fn(fn, cfg.moe)(x, w, weights, idx)
    _close(y, y0, what="output")
    _close(loss, loss0, what="loss")
    np.testing.assert_array_equal(np.asarray(st["counts"]), np.asarray(st0["counts"]))
    assert int(st["dropped"]) == 0
    _close(g[0], g0[0], what="d x")
    _close(g[1], g0[1], what="d topk_weights")
    for name in ("gate_proj", "up_proj", "down_proj"):
        _close(g[2][name], g0[2][name], what=f"d {name}")


@pytest.mark.parametrize("mesh_spec,chunks", [("expert=4,fsdp=2", 2)])
def test_all_to_all_capacity_drops_per_source(mesh_spec, chunks):
    """cf > 0: each device (each chunk) keeps ceil(cf*T_l*k/E) slots per expert, filled by
    (choice rank, token index); equal to the single-device dense path applied per token block."""
    cf = 0.5
    x, idx, w, weights = _inputs(seed=1, skew=True)
    cfg = _cfg(a2a_capacity_factor=cf, dispatch_chunks=chunks)
    mesh = make_mesh(resolve_mesh_shape(parse_mesh(mesh_spec), 8))
    fn = make_dispatch(cfg, mesh, "all_to_all")
    (loss, (y, st)), g = _loss_fn(fn, cfg.moe)(x, w, weights, idx)

    dense = dataclasses.replace(cfg.moe, capacity_factor=cf, compute_path="dense")

    def per_block(x, idx, w, weights, moe_cfg):
        nb = 8 * chunks  # token blocks: 8 devices x chunks, contiguous
        outs = [expert_ffn(xb, ib, wb, weights, moe_cfg)
                for xb, ib, wb in zip(jnp.split(x, nb), jnp.split(idx, nb), jnp.split(w, nb))]
        y = jnp.concatenate([o[0] for o in outs])
        return y, {"counts": sum(o[1]["counts"] for o in outs), "dropped": sum(o[1]["dropped"] for o in outs)}

    (loss0, (y0, st0)), g0 = _loss_fn(per_block, dense)(x, w, weights, idx)
    assert int(st0["dropped"]) > 0, "the test must actually drop"
    assert int(st["dropped"]) == int(st0["dropped"])
    _close(y, y0, what="output")
    for name in ("gate_proj", "up_proj", "down_proj"):
        _close(g[2][name], g0[2][name], what=f"d {name}")
    _close(g[0], g0[0], what="d x")


def _drop_reference(idx, n_blocks, cap):
    """numpy: the LAYOUT.md drop rule applied per token block (device x chunk): an expert's slots
    are filled in (choice rank, token index) order, pairs past ``cap`` drop. -> dropped count."""
    dropped = 0
    for blk in np.split(np.asarray(idx), n_blocks):
        fill = {}
        for r in range(blk.shape[1]):
            for t in range(blk.shape[0]):
                e = int(blk[t, r])
                fill[e] = fill.get(e, 0) + 1
                dropped += fill[e] > cap
    return dropped


def _recv_rows(fn, moe_cfg, *args):
    """Rows of the first all_to_all's operand/result inside the shard_map (the receive buffer)."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, moe_cfg))(*args)

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "all_to_all":
                yield eqn.outvars[0].aval.shape
            for v in eqn.params.values():
                if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                    yield from walk(v.jaxpr)
                elif hasattr(v, "eqns"):
                    yield from walk(v)

    return [s for s in walk(jaxpr.jaxpr) if len(s) == 2 and s[1] == D]


@pytest.mark.parametrize("expert_axes,cf", [("fsdp,expert", 1.25), ("fsdp,expert", 0.0)])
def test_capacity_bounds_the_receive_buffer(expert_axes, cf):
    """mesh.a2a_capacity_factor = cf > 0 on fsdp=2,expert=4 with experts over both axes: the
    receive buffer holds E * ceil(cf*T_l*k/E) rows (= cf*T_l*k here; in general at most E-1 more),
    the dropped count equals a numpy reference of the drop rule, and the kept assignments give the
    single-device dense path's result; cf = 0 is dropless (receive buffer E*T_l, the worst case)."""
    x, idx, w, weights = _inputs(seed=1, skew=True)
    cfg = _cfg(a2a_capacity_factor=cf, expert_axes=expert_axes)
    mesh = make_mesh(resolve_mesh_shape(parse_mesh("fsdp=2,expert=4"), 8))
    fn = make_dispatch(cfg, mesh, "all_to_all")
    t_l = T // 8
    rows = _recv_rows(fn, cfg.moe, x, idx, w, weights)
    cap = math.ceil(cf * t_l * K / E) if cf else t_l
    assert rows and all(r[0] == E * cap for r in rows), rows
    if cf:
        assert E * cap <= cf * t_l * K + E - 1 and E * cap == int(cf * t_l * K)
    (loss, (y, st)), g = _loss_fn(fn, cfg.moe)(x, w, weights, idx)
    want = _drop_reference(idx, 8, cap)
    assert int(st["dropped"]) == want
    if cf:
        assert want > 0, "the test must actually drop"
    dense = dataclasses.replace(cfg.moe, capacity_factor=cf, compute_path="dense")
    outs = [expert_ffn(xb, ib, wb, weights, dense)
            for xb, ib, wb in zip(jnp.split(x, 8), jnp.split(idx, 8), jnp.split(w, 8))]
    _close(y, jnp.concatenate([o[0] for o in outs]), what="output")


@pytest.mark.parametrize("mesh_spec,expert_axes", [("expert=8", "expert"), ("fsdp=2,expert=4", "fsdp,expert")])
def test_ragged_all_to_all_lowers_on_cpu(mesh_spec, expert_axes):
    """XLA:CPU cannot compile ragged_all_to_all, but the real code path must trace and lower
    (over one axis, or over the fsdp x expert product: one group of all 8 devices)."""
    x, idx, w, weights = _inputs()
    cfg = _cfg(expert_axes=expert_axes)
    mesh = make_mesh(resolve_mesh_shape(parse_mesh(mesh_spec), 8))
    fn = make_dispatch(cfg, mesh, "ragged_all_to_all")
    text = _loss_fn(fn, cfg.moe).lower(x, w, weights, idx).as_text()
    lines = [ln for ln in text.splitlines() if "@ragged_all_to_all" in ln]
    assert lines and all("[[0, 1, 2, 3, 4, 5, 6, 7]]" in ln for ln in lines)


def test_resolve_dispatcher():
    cfg = _cfg()
    assert resolve_dispatcher(cfg, "cpu") == "all_to_all"
    assert resolve_dispatcher(cfg, "gpu") == "ragged_all_to_all"
    assert resolve_dispatcher(_cfg(a2a_capacity_factor=1.0), "gpu") == "all_to_all"
    assert resolve_dispatcher(_cfg(dispatcher="allgather"), "cpu") == "allgather"
    with pytest.raises(UserError, match="ragged_all_to_all.*XLA:CPU"):
        resolve_dispatcher(_cfg(dispatcher="ragged_all_to_all"), "cpu")
    with pytest.raises(UserError, match="a2a_capacity_factor"):
        resolve_dispatcher(_cfg(dispatcher="allgather", a2a_capacity_factor=1.0), "cpu")
