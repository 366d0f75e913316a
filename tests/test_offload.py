"""Host memory used by name: the optimizer state in pinned_host (optim.offload_optimizer) and the
named per-layer residuals offloaded by compute.remat=offload -- placed in host memory (read from the
compiled HLO, the arrays' shardings and the gradient's residuals) and numerically identical to the
run without offload over 5 steps; host-resident optimizer state saved and restored."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.checkpoint.checkpointer import Checkpointer
from jaxmoe.config import load_config
from jaxmoe.model.transformer import OFFLOADED, Model, abstract_params, declared_groups, init_params
from jaxmoe.train.objective import model_loss
from jaxmoe.train.optim import build_optimizer
from jaxmoe.train.step import HOST_KIND, init_state, make_train_step, state_shardings

STEPS = 5
BASE = ["optim.optimizer=muon", "train.batch_size=4", "train.seq_len=16", "train.steps=5",
        "optim.warmup_steps=1", "optim.muon_ns_dtype=float32"]


def _cfg(*extra):
    return load_config("tiny", overrides=BASE + list(extra))


def _batches(cfg):
    rng = np.random.default_rng(0)
    b, s, v = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    out = []
    for _ in range(STEPS):
        tok = rng.integers(0, v, (b, s + 1)).astype(np.int32)
        out.append({"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
                    "mask": jnp.ones((b, s), jnp.float32)})
    return out


def _train(cfg):
    """5 steps of the real train step; -> (losses, compiled step, final state)."""
    tx = build_optimizer(cfg.optim, cfg.train.steps, abstract_params(cfg)[0], declared_groups(cfg))
    params, buffers = init_params(cfg, cfg.train.seed)
    state = init_state(cfg, tx, params, buffers)
    sh = state_shardings(cfg, jax.eval_shape(lambda: state))
    if sh is not None:
        state = jax.device_put(state, sh)
    batches = _batches(cfg)
    compiled = make_train_step(Model(cfg), tx).lower(state, batches[0]).compile()
    losses = []
    for batch in batches:
        state, m = compiled(state, batch)
        losses.append(float(m["loss"]))
    return losses, compiled, state


_RUNS: dict = {}


def _run(*extra):
    if extra not in _RUNS:
        _RUNS[extra] = _train(_cfg(*extra))
    return _RUNS[extra]


def _entry_params(hlo: str) -> list[str]:
    """The entry computation's parameter layouts (``f32[2,64]{1,0:S(5)}``: memory space 5 = host)."""
    head = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
    return re.findall(r"[a-z0-9]+\[[0-9,]*\]\{[^}]*\}", head)


def test_optimizer_state_in_pinned_host_same_losses():
    base_losses, base_c, base_state = _run()
    losses, compiled, state = _run("optim.offload_optimizer=true")
    assert losses == base_losses  # bit for bit: the same computation, other memory
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(base_state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    opt = jax.tree.leaves(state["opt_state"])
    assert opt and all(x.sharding.memory_kind == HOST_KIND for x in opt)
    assert all(x.sharding.memory_kind != HOST_KIND for x in jax.tree.leaves(state["params"]))
    # the compiled step takes (and, aliased, returns) exactly the optimizer state in host memory
    host = [p for p in _entry_params(compiled.as_text()) if ":S(5)" in p]
    assert len(host) == len(opt) and not [p for p in _entry_params(base_c.as_text()) if ":S(5)" in p]


def test_host_resident_state_saves_and_restores(tmp_path):
    cfg = _cfg("optim.offload_optimizer=true")
    _, _, state = _run("optim.offload_optimizer=true")
    ck = Checkpointer(tmp_path / "ckpt", keep=2, async_save=False)
    ck.save(STEPS, state, {"step": STEPS})
    ck.wait()
    abstract = jax.eval_shape(lambda: state)
    sh = state_shardings(cfg, abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh)
    restored, meta = ck.restore(target)
    ck.close()
    assert meta["step"] == STEPS
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(x.sharding.memory_kind == HOST_KIND for x in jax.tree.leaves(restored["opt_state"]))


@pytest.mark.slow
def test_activation_offload_same_losses_and_residuals_in_host_memory():
    base_losses, _, base_state = _run()
    losses, _, state = _run("compute.remat=offload")
    np.testing.assert_allclose(losses, base_losses, rtol=1e-6, atol=0)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(base_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    # the residuals the backward keeps: with remat=offload the per-layer [L, B, S, D] stacks of
    # the named values live in pinned_host; without it, nothing does
    cfg = _cfg("compute.remat=offload")
    params, buffers = init_params(cfg, 0)
    batch = _batches(cfg)[0]
    m = cfg.model
    stack = (m.n_moe_layers, cfg.train.batch_size, cfg.train.seq_len, m.d_model)

    def residuals(c):
        fn = jax.jit(lambda p: model_loss(Model(c), p, buffers, batch)[0])
        _, vjp = jax.vjp(fn, params)
        return [x for x in jax.tree.leaves(vjp) if isinstance(x, jax.Array)]

    host = [x for x in residuals(cfg) if x.sharding.memory_kind == HOST_KIND]
    assert sum(x.shape == stack for x in host) >= 3, [(x.shape, x.dtype) for x in host]  # layer_in, attn_out, ffn_in
    assert not [x for x in residuals(_cfg()) if x.sharding.memory_kind == HOST_KIND]
    assert {"layer_in", "attn_out", "ffn_in"} <= set(OFFLOADED)
