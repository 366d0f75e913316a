"""The training objective: forward + loss of one micro-batch, and its gradients over a step.

``model_loss`` runs the model on split state and computes the loss from its outputs
(:mod:`jaxmoe.train.losses`). ``make_grad_fn`` builds the step's gradient function: the global batch is
split into ``train.micro_batches`` micro-batches (a ``lax.scan``) whose fp32 gradients are summed;
CE and the output z-loss are sums over valid tokens divided by the *global* valid count, so their
micro sums equal the full batch exactly; aux router losses (load balance, sequence aux, router z)
are per micro-batch and averaged over micro-batches (as Megatron and torchtitan do). Forced
routing (parity replays: ``batch["forced_idx"]``, :func:`with_forced_routing`) goes through the
same function, so parity checks the training objective itself. A batch of packed documents also
holds ``segment_ids`` and ``positions`` ``[B, S]`` (:func:`packing_kwargs`); they go to the model
and are split into micro-batches with the rows they describe. The functions here take the
:class:`~jaxmoe.model.transformer.Model` (the config plus the dispatcher of its mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import Config
from jaxmoe.model.transformer import Model
from jaxmoe.train.losses import chunked_cross_entropy, compute_loss, mtp_cross_entropy, router_losses, weigh_terms


def model_loss(model: Model, params, buffers, batch, *, n_valid=None):
    """The model's forward + ``compute_loss``: returns ``(total, (metrics, aux))`` for ``jax.grad``.
    ``batch``: ``inputs``, ``targets``, ``mask`` ``[B, S]`` and, for a replayed routing,
    ``forced_idx [B, S, Lm, k]`` (:func:`with_forced_routing`); packed documents: ``segment_ids``
    and ``positions`` ``[B, S]`` (:func:`packing_kwargs`)."""
    cfg = model.cfg
    forced_idx = _forced_from_batch(batch)
    pk = packing_kwargs(batch)
    if cfg.compute.ce_chunk_tokens > 0:  # CE fused with the LM head, chunked: no [T, V] logits held
        hidden, head, aux = model(params, buffers, batch["inputs"], forced_idx=forced_idx, return_hidden=True, **pk)
        zc = cfg.train.z_loss_coef
        tok_loss, _, z = chunked_cross_entropy(hidden, head, batch["targets"], batch["mask"], n_valid,
                                               cfg.compute.ce_chunk_tokens, zc)
        b, s = batch["targets"].shape
        # ce := tok_loss - zc * z (z without gradient): ce in value (up to rounding), carrying the
        # gradient of ce + zc * z, which is how weigh_terms and make_grad_fn combine the two
        mtp = mtp_cross_entropy(cfg, aux, batch, n_valid, head, cfg.compute.ce_chunk_tokens)
        total, metrics = weigh_terms(cfg, tok_loss - zc * z, z, router_losses(cfg, aux["router"], b, s), mtp)
        return total, (metrics, aux)
    logits, aux = model(params, buffers, batch["inputs"], forced_idx=forced_idx, **pk)
    total, metrics = compute_loss(cfg, logits, aux, batch, n_valid)
    return total, (metrics, aux)


PACKING_KEYS = ("segment_ids", "positions")  # the optional batch keys of packed documents


def packing_kwargs(batch: dict) -> dict:
    """The model keyword arguments of packed documents present in ``batch``: ``segment_ids``
    ``[B, S]`` (documents 1, 2, ... per row, 0 = padding) and ``positions`` ``[B, S]`` (position
    inside the document). Neither key -> ``{}``: the model runs exactly as on plain windows."""
    return {k: batch[k] for k in PACKING_KEYS if batch.get(k) is not None}


def with_forced_routing(batch: dict, forced_idx) -> dict:
    """``batch`` with a routing to replay: ``forced_idx [Lm, B*S, k]`` (tokens row-major, as
    ``aux["router"]["topk_idx"]`` holds it) stored as ``batch["forced_idx"] [B, S, Lm, k]``, so it
    is split into micro-batches and sharded over the batch axes with the rows it routes."""
    b, s = batch["inputs"].shape
    lm, _, k = forced_idx.shape
    return {**batch, "forced_idx": jnp.moveaxis(jnp.asarray(forced_idx, jnp.int32).reshape(lm, b, s, k), 0, 2)}


def _forced_from_batch(batch: dict):
    f = batch.get("forced_idx")
    if f is None:
        return None
    b, s, lm, k = f.shape
    return jnp.moveaxis(f, 2, 0).reshape(lm, b * s, k)


def lm_loss(model, batch: dict) -> jax.Array:
    """The training loss of an NNX :class:`~jaxmoe.model.transformer.Transformer` on ``batch``
    (``inputs``, ``targets`` int ``[B, S]``, ``mask`` ``[B, S]``): for ``nnx.value_and_grad``."""
    logits, aux = model(batch["inputs"], forced_idx=_forced_from_batch(batch), **packing_kwargs(batch))
    total, _ = compute_loss(model.cfg, logits, aux, batch)
    return total


def split_micro_batches(batch: dict, n: int) -> dict:
    """[B, S] -> [n, B/n, S]: micro-batch i takes rows i*B/n ... (i+1)*B/n - 1."""
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}


def router_stats(cfg: Config, aux: dict) -> dict:
    """Per-MoE-layer load (max/mean assignments), dropped fraction and router entropy."""
    counts = aux["counts"].astype(jnp.float32)  # [Lm, E]
    if counts.shape[0] == 0:
        return {}
    load = counts.max(-1) / jnp.maximum(counts.mean(-1), 1e-9)
    assignments = counts.sum(-1)
    scores = aux["router"]["scores"]  # [Lm, T, E]
    p = scores / jnp.maximum(scores.sum(-1, keepdims=True), 1e-20)
    entropy = -(p * jnp.log(jnp.maximum(p, 1e-20))).sum(-1).mean(-1)
    return {
        "expert_load": load,
        "counts": aux["counts"],
        "dropped_frac": aux["dropped"].sum() / jnp.maximum(assignments.sum(), 1.0),
        "router_entropy": entropy,
    }


def make_grad_fn(model: Model):
    """``grads(params, buffers, batch) -> (grads, metrics, counts)`` over the step's micro-batches
    (see the module doc).

    ``batch`` holds the whole step's global batch ``[B, S]`` (with ``forced_idx``, a routing
    replayed for the whole batch: :func:`with_forced_routing`). ``counts [Lm, E]`` are the expert
    assignments summed over all micro-batches (for the bias update).
    """
    cfg = model.cfg
    n_micro = cfg.train.micro_batches
    zc = cfg.train.z_loss_coef

    def micro_objective(params, buffers, mb, n_valid):
        total, (metrics, aux) = model_loss(model, params, buffers, mb, n_valid=n_valid)
        token_part = metrics["ce"] + zc * metrics["z_loss"]  # global sums: not / n_micro
        if "mtp_ce" in metrics:
            token_part = token_part + cfg.train.mtp_loss_coef * metrics["mtp_ce"]
        objective = token_part + (total - token_part) / n_micro
        return objective, (metrics, aux)

    value_and_grad = jax.value_and_grad(micro_objective, has_aux=True)

    def grads_fn(params, buffers, batch):
        n_valid = jnp.maximum(batch["mask"].sum(), 1.0)
        micro = split_micro_batches(batch, n_micro)
        counts0 = jnp.zeros((cfg.model.n_moe_layers, cfg.moe.n_experts), jnp.float32)

        def one(mb):
            (obj, (metrics, aux)), grads = value_and_grad(params, buffers, mb, n_valid)
            m = dict(metrics)
            m["objective"] = obj
            stats = router_stats(cfg, aux)
            counts = counts0
            if stats:
                m["expert_load"] = stats["expert_load"]
                m["router_entropy"] = stats["router_entropy"]
                m["dropped"] = aux["dropped"].sum().astype(jnp.float32)
                m["assignments"] = aux["counts"].sum().astype(jnp.float32)
                counts = aux["counts"].astype(jnp.float32)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), m, counts

        def body(carry, mb):
            out = one(mb)
            return jax.tree.map(jnp.add, carry, out), None

        first = jax.tree.map(lambda x: x[0], micro)
        if n_micro == 1:
            # one micro-batch: no accumulation (a zero-filled gradient tree plus one add would be
            # two more passes over every gradient: docs/MEASUREMENTS.md, "train step")
            grads, msum, counts = one(first)
        else:
            shapes = jax.eval_shape(one, first)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (grads, msum, counts), _ = jax.lax.scan(body, zeros, micro)

        metrics = {}
        for k, v in msum.items():  # CE / z-loss are global sums already; the rest are means
            metrics[k] = v if k in ("ce", "z_loss", "mtp_ce", "objective", "dropped", "assignments") else v / n_micro
        metrics["loss"] = metrics["objective"]
        metrics["n_valid"] = n_valid
        if "dropped" in metrics:
            metrics["dropped_frac"] = metrics.pop("dropped") / jnp.maximum(metrics.pop("assignments"), 1.0)
        return grads, metrics, counts

    return grads_fn


__all__ = ["PACKING_KEYS", "lm_loss", "make_grad_fn", "model_loss", "packing_kwargs", "router_stats",
           "split_micro_batches", "with_forced_routing"]
