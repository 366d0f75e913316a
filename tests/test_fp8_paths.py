"""compute.fp8 on every expert path (issue 40): the ragged operands quantise exactly as each expert's
rows alone, the ragged FP8 matmul equals the slot form, blocked / ragged equal dense, the
expert-parallel mesh equals one device, and what cannot keep one device's scales is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import ConfigError, load_config
from jaxmoe.errors import UserError
from jaxmoe.model import fp8
from jaxmoe.parallel.expert_dispatch import check_fp8

RECIPES = ("tensorwise", "rowwise", "blockwise")
COUNTS = np.array([130, 0, 7, 200])  # an empty expert; two above one 128-row tile
K, N_OUT, TAIL = 160, 24, 6  # K > 128: two 1x128 tiles along K for blockwise
GARBAGE = np.array([np.inf, np.nan, 1e30, -np.inf, -1e30, 3.0], np.float32)


def _rows(seed=0):
    """Rows sorted by expert (COUNTS), TAIL garbage rows after them, and the dense slot form."""
    rng = np.random.default_rng(seed)
    n = int(COUNTS.sum())
    x = rng.standard_normal((n, K)).astype(np.float32) * np.exp(rng.standard_normal((n, 1))).astype(np.float32)
    dirty = np.concatenate([x, np.resize(GARBAGE, (TAIL, K))], axis=0)
    c = int(COUNTS.max())
    slots = np.zeros((len(COUNTS), c, K), np.float32)
    starts = np.cumsum(COUNTS) - COUNTS
    for e, (s, m) in enumerate(zip(starts, COUNTS)):
        slots[e, :m] = x[s:s + m]
    valid = np.arange(c)[None, :] < COUNTS[:, None]
    return x, dirty, slots, valid, starts


@pytest.mark.parametrize("contract", [0, 1])
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_quantisation_is_each_experts_rows_alone(recipe, contract):
    x, dirty, _, _, starts = _rows()
    got = np.asarray(fp8.grouped_fake_quant(jnp.asarray(dirty), jnp.asarray(COUNTS, jnp.int32), recipe, contract))
    for s, m in zip(starts, COUNTS):
        if m:
            want = np.asarray(fp8.fake_quant(jnp.asarray(x[s:s + m]), recipe, contract))
            np.testing.assert_array_equal(got[s:s + m], want)
    assert (got[len(x):] == 0).all()  # garbage rows reached no amax and stay 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_ragged_matmul_equals_the_slot_form_with_garbage_tails(recipe):
    x, dirty, slots, valid, starts = _rows(1)
    rng = np.random.default_rng(2)
    w = (0.1 * rng.standard_normal((len(COUNTS), K, N_OUT))).astype(np.float32)
    gs = jnp.asarray(COUNTS, jnp.int32)
    g_rows = rng.standard_normal((len(dirty), N_OUT)).astype(np.float32)
    g_rows[len(x):] = np.resize(GARBAGE, (TAIL, N_OUT))  # a cotangent with garbage in the tail too
    g_slots = np.zeros((len(COUNTS), slots.shape[1], N_OUT), np.float32)
    for e, (s, m) in enumerate(zip(starts, COUNTS)):
        g_slots[e, :m] = g_rows[s:s + m]

    y, vjp = jax.vjp(lambda a, b: fp8.fp8_ragged_matmul(a, b, gs, recipe), jnp.asarray(dirty), jnp.asarray(w))
    dx, dw = (np.asarray(t) for t in vjp(jnp.asarray(g_rows)))
    ys, vjps = jax.vjp(lambda a, b: fp8.fp8_grouped_matmul(a, b, recipe, jnp.asarray(valid)),
                       jnp.asarray(slots), jnp.asarray(w))
    dxs, dws = (np.asarray(t) for t in vjps(jnp.asarray(g_slots)))
    y, ys = np.asarray(y), np.asarray(ys)
    assert np.isfinite(y).all() and np.isfinite(dx).all() and np.isfinite(dw).all()
    assert (y[len(x):] == 0).all() and (dx[len(x):] == 0).all()
    # the same quantised operands; only the fp32 summation order differs (ragged_dot vs the einsum):
    # within a few ulps of each output's scale (K = 160 products of very different sizes)
    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())

    for e, (s, m) in enumerate(zip(starts, COUNTS)):
        if not m:
            continue
        close(y[s:s + m], ys[e, :m])
        close(dx[s:s + m], dxs[e, :m])
    close(dw, dws)
    assert (dw[1] == 0).all()  # the empty expert


# --------------------------------------------------------------------------------------------
# the model: every path against dense, the mesh against one device
# --------------------------------------------------------------------------------------------

B, S = 8, 16


def _cfg(recipe, path, seq=S, **extra):
    sets = [f"compute.fp8={recipe}", f"moe.compute_path={path}", "moe.capacity_factor=0",
            f"train.batch_size={B}", f"train.seq_len={seq}"]
    return load_config(preset="tiny", overrides=sets + [f"{k}={v}" for k, v in extra.items()])


def _batch(cfg):
    rng = np.random.default_rng(0)
    v, b, s = cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len
    return {"inputs": rng.integers(0, v, (b, s)).astype(np.int32),
            "targets": rng.integers(0, v, (b, s)).astype(np.int32), "mask": np.ones((b, s), np.float32)}


def _loss_and_grads(cfg, ctx=None, params=None, buffers=None):
    from jaxmoe.model.transformer import Model, init_params
    from jaxmoe.train.objective import model_loss

    if params is None:
        params, buffers = init_params(cfg, 0)
    batch = _batch(cfg)
    model = Model(cfg)
    if ctx is not None:
        params, buffers = ctx.place_params(params), ctx.place_params(buffers)
        batch, model = ctx.place_batch(batch), ctx.model()

    def f(p):
        total, (_, aux) = model_loss(model, p, buffers, batch)
        return total, aux["counts"]

    (loss, counts), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return float(loss), np.asarray(counts), jax.tree.map(np.asarray, grads)


def _worst(ga, gb):
    """The largest relative Frobenius error over every gradient leaf, and its path."""
    fa, fb = jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)
    assert len(fa) == len(fb)
    return max((float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30)), jax.tree_util.keystr(kp))
               for (kp, a), b in zip(fa, fb))


_DENSE = {}


def _dense(recipe):
    if recipe not in _DENSE:
        _DENSE[recipe] = _loss_and_grads(_cfg(recipe, "dense"))
    return _DENSE[recipe]


# The quantised operands are the same on every path (tests above), so what differs is XLA's fp32
# summation order (ragged_dot against the slot einsums, shard_map's partial sums). Measured on tiny,
# 8x16 tokens (docs/MEASUREMENTS.md, "FP8"): the loss bit-identical on every path, the worst
# gradient 1.9e-7 (rowwise, blockwise: blocked / ragged vs dense) and 4.1e-7 (mesh vs one device),
# except where an operand lands on the other side of a rounding boundary because of that order
# and moves one element by one FP8 step: tensorwise's e5m2 gradients (2^-2 steps) do so once here,
# 3.7e-4 on the routed experts' up_proj. Scales over the wrong rows move every element (the e4m3
# step is 6-12 %), far above these.
PATH_TOL = {"tensorwise": 2e-3, "rowwise": 1e-5, "blockwise": 1e-5}


@pytest.mark.parametrize("path", ["blocked", "ragged"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_path_matches_dense_loss_and_every_gradient(recipe, path):
    loss_d, counts_d, grads_d = _dense(recipe)
    loss, counts, grads = _loss_and_grads(_cfg(recipe, path))
    np.testing.assert_array_equal(counts, counts_d)
    assert abs(loss - loss_d) <= 1e-6 * abs(loss_d), (loss, loss_d)
    worst = _worst(grads, grads_d)
    rel = abs(loss - loss_d) / abs(loss_d)
    print(f"fp8 {recipe} {path} vs dense: loss {rel:.1e}, worst grad {worst[0]:.1e} {worst[1]}")
    assert worst[0] < PATH_TOL[recipe], worst
    # fp8 is really on along this path: the loss moved off the high-precision one
    assert loss != _loss_and_grads(_cfg("none", path))[0]


def test_blockwise_wgrad_tiles_over_128_rows_of_an_expert_match_dense():
    """8 x 64 tokens top-2 over 8 experts: ~128 rows per expert, some above one 128-row tile, so the
    weight gradient's 128-token tiles see the same rows only if every path orders an expert's rows
    as the dense slots do (choice rank, then token)."""
    loss_d, counts_d, grads_d = _loss_and_grads(_cfg("blockwise", "dense", seq=64))
    assert counts_d.max() > 128, counts_d
    loss, counts, grads = _loss_and_grads(_cfg("blockwise", "blocked", seq=64))
    assert loss == loss_d
    worst = _worst(grads, grads_d)
    assert worst[0] < PATH_TOL["blockwise"], worst


@pytest.mark.parametrize("recipe,kind", [("tensorwise", "all_to_all"), ("rowwise", "allgather")])
def test_expert_parallel_mesh_matches_one_device(recipe, kind):
    from jaxmoe.model.transformer import init_params
    from jaxmoe.parallel.mesh import build_context, parse_mesh

    one = _cfg(recipe, "blocked")
    params, buffers = init_params(one, 0)
    loss_1, counts_1, grads_1 = _loss_and_grads(one, params=params, buffers=buffers)
    cfg = one.replace(mesh=dataclasses.replace(one.mesh, dispatcher=kind, expert_axes="fsdp,expert"))
    cfg, ctx = build_context(cfg, parse_mesh("fsdp=2,expert=4"))
    loss, counts, grads = _loss_and_grads(cfg, ctx, params, buffers)
    np.testing.assert_array_equal(counts, counts_1)
    assert abs(loss - loss_1) <= 1e-6 * abs(loss_1), (loss, loss_1)
    worst = _worst(grads, grads_1)
    print(f"fp8 {recipe} mesh fsdp=2,expert=4 ({kind}) vs one device: worst grad {worst[0]:.1e} {worst[1]}")
    assert worst[0] < PATH_TOL[recipe], worst


# --------------------------------------------------------------------------------------------
# refusals: one line each, naming the key
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe,shape,ep,chunks,match", [
    ("tensorwise", {"fsdp": 2, "expert": 4}, ("expert",), 1, "batch is split over fsdp=2 outside"),
    ("rowwise", {"replica": 2, "expert": 4}, ("fsdp", "expert"), 1, "replica=2 outside"),
    ("tensorwise", {"expert": 4, "tensor": 2}, ("expert",), 1, "expert FFN is split over tensor=2"),
    ("rowwise", {"expert": 8}, ("expert",), 2, "mesh.dispatch_chunks=2"),
    ("blockwise", {"expert": 8}, ("expert",), 1, "blockwise's 128-token tiles"),
])
def test_mesh_refusals(recipe, shape, ep, chunks, match):
    with pytest.raises(UserError, match=match) as err:
        check_fp8(recipe, shape, ep, chunks)
    assert "\n" not in str(err.value) and "compute.fp8" in str(err.value)


def test_accepted_meshes_and_none():
    check_fp8("tensorwise", {"expert": 8, "tensor": 1}, ("expert",), 1)
    check_fp8("rowwise", {"fsdp": 2, "expert": 4}, ("fsdp", "expert"), 1)
    check_fp8("none", {"fsdp": 2, "expert": 4, "tensor": 2}, ("expert",), 4)


def test_the_mesh_check_runs_when_the_model_is_placed():
    from jaxmoe.parallel.mesh import build_context, parse_mesh

    cfg = _cfg("tensorwise", "blocked")
    with pytest.raises(UserError, match="fsdp=2 outside"):
        cfg2, ctx = build_context(cfg, parse_mesh("fsdp=2,expert=4"))
        ctx.model()


def test_an_explicit_grouped_gemm_kernel_is_refused():
    with pytest.raises(ConfigError, match="moe.ragged_kernel='tokamax'") as err:
        load_config(preset="tiny", overrides=["compute.fp8=rowwise", "moe.compute_path=ragged",
                                              "moe.ragged_kernel=tokamax"])
    assert "\n" not in str(err.value)
    load_config(preset="tiny", overrides=["compute.fp8=rowwise", "moe.compute_path=blocked"])
