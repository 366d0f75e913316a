"""The whole model: embedding -> dense blocks -> MoE blocks -> final norm -> LM head.

The functional API works on nested dicts of arrays laid out exactly as docs/LAYOUT.md:

* :func:`init_params` ``(cfg, seed) -> (params, buffers)`` (fp32),
* :func:`apply_model` ``(cfg, params, buffers, tokens, ...) -> (logits fp32, aux)``,
* :func:`param_count` (equals ``config.count_params(cfg)["total_params"]``).

:class:`Transformer` is a thin Flax NNX module holding the same dicts as ``nnx.Param`` (and an
``ExpertBias`` variable for the buffers) whose ``__call__`` is ``apply_model``.

Layer stacks are scanned: one ``jax.lax.scan`` over the ``dense/`` stack (leading axis
``first_k_dense``) and one over the ``moe/`` stack (leading axis ``n_layers - first_k_dense``), so
compile time does not grow with depth. ``cfg.train.remat`` wraps one block in ``jax.checkpoint``:
``none``; ``full`` (save nothing, recompute the block); ``save_dots`` (keep matmul outputs);
``offload`` (the named residuals ``attn_out``/``ffn_out`` are offloaded to ``pinned_host``).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import Config
from jaxmoe.losses import router_losses
from jaxmoe.model.attention import attention, attention_shapes
from jaxmoe.model.layers import rms_norm, rope_tables, swiglu
from jaxmoe.model.moe import moe_ffn

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def param_shapes(cfg: Config) -> dict:
    """Nested dict of parameter shapes (docs/LAYOUT.md), layer axes included."""
    m, e = cfg.model, cfg.moe
    d = m.d_model
    ld, lm = m.first_k_dense, m.n_moe_layers

    def stack(n, shapes):
        if isinstance(shapes, dict):
            return {k: stack(n, v) for k, v in shapes.items()}
        return (n, *shapes)

    def block(n):
        return {"attn_norm": (n, d), "ffn_norm": (n, d), "attn": stack(n, attention_shapes(m))}

    out: dict = {"embed": (m.vocab_size, d)}
    if ld > 0:
        out["dense"] = block(ld)
        f = m.dense_ffn_dim
        out["dense"]["mlp"] = {"gate_proj": (ld, d, f), "up_proj": (ld, d, f), "down_proj": (ld, f, d)}
    if lm > 0:
        out["moe"] = block(lm)
        i, ne = e.expert_ffn_dim, e.n_experts
        out["moe"]["router"] = (lm, d, ne)
        out["moe"]["experts"] = {
            "gate_proj": (lm, ne, d, i),
            "up_proj": (lm, ne, d, i),
            "down_proj": (lm, ne, i, d),
        }
        if e.n_shared_experts > 0:
            sdim = e.n_shared_experts * i
            out["moe"]["shared"] = {
                "gate_proj": (lm, d, sdim),
                "up_proj": (lm, d, sdim),
                "down_proj": (lm, sdim, d),
            }
    out["final_norm"] = (d,)
    if not m.tie_embeddings:
        out["lm_head"] = (d, m.vocab_size)
    return out


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def init_params(cfg: Config, seed: int) -> tuple[dict, dict]:
    """Random fp32 parameters and zero buffers.

    Norm weights (keys ending in ``norm``) are ones; the router ~ N(0, router_init_std); every other
    weight ~ N(0, init_std). Each leaf's key is ``fold_in(key(seed), i)`` with ``i`` its index in the
    sorted ``/``-joined paths, so values do not depend on dict insertion order.
    """
    shapes = param_shapes(cfg)
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    names = sorted("/".join(str(p.key) for p in path) for path, _ in flat)
    index = {n: i for i, n in enumerate(names)}
    root = jax.random.key(seed)

    def make(path, shape):
        name = "/".join(str(p.key) for p in path)
        leaf = name.rsplit("/", 1)[-1]
        if leaf.endswith("norm"):
            return jnp.ones(shape, jnp.float32)
        std = cfg.moe.router_init_std if leaf == "router" else cfg.model.init_std
        key = jax.random.fold_in(root, index[name])
        return jax.random.normal(key, shape, jnp.float32) * std

    params = jax.tree_util.tree_map_with_path(make, shapes, is_leaf=_is_shape)
    buffers: dict = {}
    if cfg.moe.use_expert_bias and cfg.model.n_moe_layers > 0:
        buffers = {"moe": {"expert_bias": jnp.zeros((cfg.model.n_moe_layers, cfg.moe.n_experts), jnp.float32)}}
    return params, buffers


def param_count(params) -> int:
    """Total number of scalars in ``params``."""
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def _remat(fn: Callable, mode: str) -> Callable:
    """Wrap one block's function in ``jax.checkpoint`` according to ``cfg.train.remat``."""
    if mode == "none":
        return fn
    if mode == "full":
        return jax.checkpoint(fn)
    if mode == "save_dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if mode == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["attn_out", "ffn_out"],
            offload_src="device",
            offload_dst="pinned_host",
        )
        return jax.checkpoint(fn, policy=policy)
    raise ValueError(f"unknown train.remat {mode!r}")


def apply_model(
    cfg: Config,
    params: dict,
    buffers: dict,
    tokens: jax.Array,
    *,
    forced_idx: jax.Array | None = None,
    return_probes: bool = False,
    dispatch: Callable | None = None,
):
    """Forward pass. ``tokens [B, S]`` int32 -> ``(logits [B, S, V] fp32, aux)``.

    ``forced_idx [Lm, B*S, k]`` replays a routing (parity); ``dispatch`` replaces
    :func:`jaxmoe.model.experts.expert_ffn` (expert-parallel dispatchers). ``aux`` holds
    ``router`` (logits, scores, topk_idx, topk_weights, each ``[Lm, T, ...]``), ``counts [Lm, E]``,
    ``dropped [Lm]``, ``losses`` (lb, seq_aux, router_z summed over MoE layers, unweighted) and,
    with ``return_probes``, ``probes`` (see docs and the contract in the model issue).
    """
    m, e = cfg.model, cfg.moe
    dtype = DTYPES[cfg.train.dtype]
    b, s = tokens.shape
    t = b * s
    eps = m.rms_norm_eps
    cos, sin = rope_tables(m, s)

    x = params["embed"][tokens].astype(dtype)
    probes: dict = {"embedding": x} if return_probes else {}

    def attn_part(lp, x):
        a = attention(lp["attn"], rms_norm(x, lp["attn_norm"], eps), cos, sin, m)
        a = checkpoint_name(a, "attn_out")
        return a

    def dense_body(x, lp):
        a = attn_part(lp, x)
        x = x + a
        mlp = lp["mlp"]
        f = swiglu(rms_norm(x, lp["ffn_norm"], eps), mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
        f = checkpoint_name(f, "ffn_out")
        return x + f, ((a, f) if return_probes else None)

    def moe_body(x, xs):
        lp, bias, forced = xs
        a = attn_part(lp, x)
        x = x + a
        f, r, stats = moe_ffn(
            lp, rms_norm(x, lp["ffn_norm"], eps), bias, cfg, forced_idx=forced, dispatch=dispatch
        )
        f = checkpoint_name(f, "ffn_out")
        out = {"router": r._asdict(), "counts": stats["counts"], "dropped": stats["dropped"]}
        if return_probes:
            out["attn_out"] = a
            out["moe_out"] = f
        return x + f, out

    attn_outs = []
    if "dense" in params:
        x, ys = jax.lax.scan(_remat(dense_body, cfg.train.remat), x, params["dense"])
        if return_probes:
            attn_outs.append(ys[0])
            probes["ffn_out"] = ys[1]
    if "moe" in params:
        bias = buffers.get("moe", {}).get("expert_bias") if e.use_expert_bias else None
        x, ys = jax.lax.scan(
            _remat(moe_body, cfg.train.remat), x, (params["moe"], bias, forced_idx)
        )
        router = ys["router"]
        counts, dropped = ys["counts"], ys["dropped"]
        if return_probes:
            attn_outs.append(ys["attn_out"])
            probes["moe_out"] = ys["moe_out"]
    else:
        ne, k = e.n_experts, e.top_k
        router = {
            "logits": jnp.zeros((0, t, ne), jnp.float32),
            "scores": jnp.zeros((0, t, ne), jnp.float32),
            "topk_idx": jnp.zeros((0, t, k), jnp.int32),
            "topk_weights": jnp.zeros((0, t, k), jnp.float32),
        }
        counts, dropped = jnp.zeros((0, ne), jnp.int32), jnp.zeros((0,), jnp.int32)

    x = rms_norm(x, params["final_norm"], eps)
    head = params["embed"].T if m.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("bsd,dv->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)

    aux = {
        "router": router,
        "counts": counts,
        "dropped": dropped,
        "losses": router_losses(cfg, router["logits"], router["scores"], router["topk_idx"], b, s),
    }
    if return_probes:
        probes["attn_out"] = jnp.concatenate(attn_outs, axis=0)
        probes["router_logits"] = router["logits"]
        if "moe_out" not in probes:
            probes["moe_out"] = jnp.zeros((0, b, s, m.d_model), dtype)
        if "ffn_out" not in probes:
            probes["ffn_out"] = jnp.zeros((0, b, s, m.d_model), dtype)
        probes["final_hidden"] = x
        probes["logits"] = logits
        aux["probes"] = probes
    return logits, aux


# ---------------------------------------------------------------------------------------------
# Flax NNX module
# ---------------------------------------------------------------------------------------------


class ExpertBias(nnx.Variable):
    """Non-trained routing bias (``buffers/moe/expert_bias``), updated by the sign rule."""


def _is_var(v) -> bool:
    return isinstance(v, nnx.Variable)


class Transformer(nnx.Module):
    """NNX wrapper: ``self.params`` / ``self.buffers`` hold the LAYOUT dicts as variables.

    ``model(tokens, **kw)`` is ``apply_model(cfg, params, buffers, tokens, **kw)``;
    ``model.pure()`` returns ``(params, buffers)`` as plain dicts of arrays.
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        seed = int(jax.random.randint(rngs.params(), (), 0, 2**31 - 1))
        params, buffers = init_params(cfg, seed)
        self.params = nnx.data(jax.tree.map(nnx.Param, params))
        self.buffers = nnx.data(jax.tree.map(ExpertBias, buffers))

    def pure(self) -> tuple[dict, dict]:
        get = lambda v: v[...]  # noqa: E731
        return (
            jax.tree.map(get, self.params, is_leaf=_is_var),
            jax.tree.map(get, self.buffers, is_leaf=_is_var),
        )

    def __call__(self, tokens, **kwargs):
        params, buffers = self.pure()
        return apply_model(self.cfg, params, buffers, tokens, **kwargs)
