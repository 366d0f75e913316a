"""One training step, jit-compiled: state, gradients, optimizer, guards, expert-bias update.

``init_state`` builds a train state (a plain pytree, so that checkpoints and shardings see it
whole); ``make_train_step`` the jitted step with donated state: the gradients of the training
objective over the step's micro-batches (:func:`jaxmoe.train.objective.make_grad_fn`), global-norm
clipping and the optimizer (:mod:`jaxmoe.train.optim`), a non-finite guard that skips the update, and
the aux-loss-free expert-bias update on the expert counts summed over the whole step.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.model.transformer import Model, init_params
from jaxmoe.train.losses import update_expert_bias
from jaxmoe.train.objective import make_grad_fn, model_loss
from jaxmoe.train.optim import global_norm

# --------------------------------------------------------------------------------------------
# State and step
# --------------------------------------------------------------------------------------------


def init_state(cfg: Config, tx, params=None, buffers=None) -> dict:
    """A fresh training state (a plain pytree, so that checkpoints and shardings see it whole)."""

    if params is None:
        params, buffers = init_params(cfg, cfg.train.seed)
    return {
        "params": params,
        "buffers": buffers,
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(jax.random.key(cfg.train.seed + 1)),
        "bad_steps": jnp.zeros((), jnp.int32),  # consecutive non-finite steps
    }


def opt_init_fn(cfg: Config, tx, shardings=None):
    """``(params, buffers) -> state without params/buffers`` (optimizer state, step, rng, ...) as
    one jitted program; with ``shardings`` (a train state's, e.g. ``MeshContext.state_shardings``)
    its outputs are created sharded, so each device materialises only its own shards."""
    out = None if shardings is None else {k: v for k, v in shardings.items() if k not in ("params", "buffers")}
    return jax.jit(lambda p, b: {k: v for k, v in init_state(cfg, tx, p, b).items()
                                 if k not in ("params", "buffers")}, out_shardings=out)


# --------------------------------------------------------------------------------------------
# Where the state lives: optimizer state in pinned host memory (optim.offload_optimizer)
# --------------------------------------------------------------------------------------------

HOST_KIND = "pinned_host"


def state_shardings(cfg: Config, abstract_state: dict, mesh_ctx=None):
    """Shardings of a train state: the mesh's (``mesh_ctx.state_shardings``) or, without a mesh,
    the first device; with ``optim.offload_optimizer`` every ``opt_state`` leaf's sharding is the
    same layout in ``pinned_host`` memory. None when neither a mesh nor offloading asks for any
    (jit then places the state itself)."""
    offload = cfg.optim.offload_optimizer
    if offload:
        dev0 = jax.local_devices()[0]
        if HOST_KIND not in {m.kind for m in dev0.addressable_memories()}:
            raise UserError(f"optim.offload_optimizer: {dev0.platform} device {dev0.id} has no "
                            f"{HOST_KIND} memory; set optim.offload_optimizer=false")
    if mesh_ctx is not None:
        sh = mesh_ctx.state_shardings(abstract_state)
    elif offload:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        sh = jax.tree.map(lambda _: dev, abstract_state)
    else:
        return None
    if offload:
        sh = {**sh, "opt_state": jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), sh["opt_state"])}
    return sh


def _to_space(tree, space):
    """Move every leaf of ``tree`` to memory ``space`` inside jit, keeping its sharding
    (``jax.memory.Space``: jax >= 0.6; on XLA:CPU host and device memory are the same RAM, the
    copies are annotations that the compiled HLO shows as memory space S(5))."""
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def make_train_step(model: Model, tx, *, donate: bool = True):
    """Build the jit-compiled train step ``step(state, batch) -> (state, metrics)`` of ``model``
    (``Model(cfg)`` on one device, ``MeshContext.model()`` on a mesh).

    gradients (``make_grad_fn``) -> global-norm + finiteness check -> optimizer (clipping is part
    of ``tx``) -> expert-bias update on the step's summed counts. A non-finite loss, gradient or
    *update* (e.g. a non-finite learning rate or optimizer state) keeps params, buffers and
    optimizer state unchanged and counts a bad step (``metrics["bad_steps"]``: in a row).
    """

    cfg = model.cfg
    grads_fn = make_grad_fn(model)
    use_bias = cfg.moe.use_expert_bias and cfg.model.n_moe_layers > 0
    offload = cfg.optim.offload_optimizer

    def step(state, batch):
        params, buffers = state["params"], state["buffers"]
        grads, metrics, counts = grads_fn(params, buffers, batch)
        grad_norm = global_norm(grads)  # the same expression as the clipping's: computed once
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

        opt_state = state["opt_state"]
        if offload:  # streamed in for the update only (after the gradients: overlaps the backward)
            opt_state = _to_space(opt_state, jax.memory.Space.Device)
        updates, new_opt = tx.update(grads, opt_state, params)
        # every entry, not the norm: a huge but finite update's squared norm overflows fp32
        finite = finite & jax.tree.reduce(jnp.logical_and, jax.tree.map(lambda u: jnp.isfinite(u).all(), updates))
        new_params = optax.apply_updates(params, updates)
        new_buffers = buffers
        if use_bias:
            bias = buffers["moe"]["expert_bias"]
            new_bias = update_expert_bias(bias, counts, cfg.moe.bias_update_rate, cfg.moe.bias_update_rule)
            new_buffers = {**buffers, "moe": {**buffers["moe"], "expert_bias": new_bias}}

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = {
            "params": keep(new_params, params),
            "buffers": keep(new_buffers, buffers),
            "opt_state": keep(new_opt, opt_state),
            "step": state["step"] + 1,
            "rng": state["rng"],
            "bad_steps": jnp.where(finite, 0, state["bad_steps"] + 1).astype(jnp.int32),
        }
        if offload:
            new_state["opt_state"] = _to_space(new_state["opt_state"], jax.memory.Space.Host)
        metrics["grad_norm"] = grad_norm
        metrics["skipped"] = ~finite
        metrics["counts"] = counts
        metrics["bad_steps"] = new_state["bad_steps"]
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_eval_step(model: Model):
    """The jit-compiled eval step ``(params, buffers, batch) -> {"loss", "ce"}`` of ``model``."""

    def ev(params, buffers, batch):
        total, (metrics, _) = model_loss(model, params, buffers, batch)
        return {"loss": total, "ce": metrics["ce"]}

    return jax.jit(ev)


# --------------------------------------------------------------------------------------------
# Peak FLOP/s for MFU
# --------------------------------------------------------------------------------------------

# dense bf16 peak per device (FLOP/s), vendor figures
_PEAK = {"h200": 989e12, "h100": 989e12, "gh200": 989e12, "a100": 312e12, "b200": 2250e12, "gb200": 2500e12}


def measure_matmul_peak(n: int = 2048, dtype: str = "float32", reps: int = 5) -> float:
    """FLOP/s of a jitted ``[n, n] @ [n, n]`` matmul in ``dtype`` on the default device: the best
    of ``reps`` timed calls after one untimed call (compilation). The one matmul timer of the
    trainer's MFU and of ``bench/`` (train_step.py, gpu.py)."""
    a = jnp.ones((n, n), getattr(jnp, dtype))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak_flops(dtype: str) -> tuple[float, str]:
    """Peak FLOP/s of one device and where it came from (table for GPUs; measured on CPU)."""

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "").lower()
    for name, peak in _PEAK.items():
        if name in kind.replace(" ", ""):
            return (peak if dtype == "bfloat16" else peak / 2), f"table:{kind}"
    # CPU (or unknown): measure a large fp32 matmul once; MFU is then relative to that.
    return measure_matmul_peak(1024, "float32", 5), f"measured-matmul:{kind or dev.platform}"


__all__ = ["HOST_KIND", "device_peak_flops", "init_state", "measure_matmul_peak", "make_eval_step", "make_train_step",
           "opt_init_fn", "state_shardings"]
