"""The whole model: embedding -> dense layers -> MoE layers -> final norm -> LM head.

:class:`Transformer` is a Flax NNX module. Its state is the canonical layout of docs/LAYOUT.md
(``embed``, ``dense/...``, ``moe/...``, ``final_norm``, ``lm_head``; the ``expert_bias``
buffers apart), so checkpoints, the HF name mapping and the sharding rules all see the same
paths. Two ways to use it:

* as a Flax module: ``model = Transformer(cfg, rngs=nnx.Rngs(0)); logits, aux = model(tokens)``,
  trainable with ``nnx.Optimizer`` / optax (README, tests/test_model.py);
* functionally, on split state (what the jitted train step does): :func:`init_params`
  ``(cfg, seed) -> (params, buffers)`` as nested dicts of arrays, and :class:`Model`
  ``(cfg, dispatch)(params, buffers, tokens) -> (logits, aux)``, which merges them into the
  module (:func:`apply_model` for one device).

Placed on a mesh, the model is built with that mesh's expert-parallel dispatcher
(``Transformer(cfg, rngs=..., dispatch=ctx.dispatch)`` or ``ctx.model()``): the dispatcher is
part of the module's structure, so no call below the model's own takes one.

Layer stacks are scanned: the dense layers and the MoE layers are each one layer module declared
with a leading ``layers`` axis (``stack=(L,)``), run by ``jax.lax.scan`` over its split state
(inside the scan body the merged layer holds one layer's slices), so compile time does not grow
with depth. ``cfg.compute.remat`` wraps one layer in
``jax.checkpoint``: ``none``; ``full`` (save nothing, recompute the layer); ``save_dots`` (keep
matmul outputs); ``offload`` (the named residuals :data:`OFFLOADED` -- layer inputs, attention
output, MoE block input and output -- go to ``pinned_host``; the rest is recomputed).

``aux`` is the routing record per MoE layer (stacked ``[Lm, ...]``): ``router`` (``logits``,
``scores [Lm, T, E]``, ``topk_idx``, ``topk_weights [Lm, T, k]``), ``counts [Lm, E]``,
``dropped [Lm]``, and with ``return_probes`` the ``probes`` of every stage in forward order.
Losses are computed from it outside the model (:mod:`jaxmoe.train.losses`).
"""

from __future__ import annotations

import collections
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import Config
from jaxmoe.config.autoconf import resolve_auto
from jaxmoe.model import fp8
from jaxmoe.model.attention import make_attention
from jaxmoe.model.layers import rope_tables
from jaxmoe.model.mlp import SwiGLU
from jaxmoe.model.moe import MoEBlock, no_routing
from jaxmoe.model.mtp import MTPFusion, run_mtp
from jaxmoe.model.params import Buffer, Decl, Embedding, Linear, RMSNorm, builds, declarations, normal, ones, stack_axes
from jaxmoe.model.router import RouterOut
from jaxmoe.trees import unflatten

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))``, then ``x + ffn(ffn_norm(x))``."""

    def _init_attention(self, cfg: Config, stack: tuple, rngs: nnx.Rngs) -> None:
        m = cfg.model
        norm = stack_axes(stack, ("norm",))
        self.attn_norm = RMSNorm.declare(stack + (m.d_model,), norm, ones(), eps=m.rms_norm_eps)
        self.attn = make_attention(m, stack=stack, kernel=cfg.compute.attention_kernel, rngs=rngs)
        self.ffn_norm = RMSNorm.declare(stack + (m.d_model,), norm, ones(), eps=m.rms_norm_eps)

    def ffn(self, h, forced_idx=None):
        raise NotImplementedError

    def __call__(self, x, cos, sin, forced_idx=None, segment_ids=None):
        """-> ``(x, attn_out, ffn_out, routing or None)``. The residuals a remat policy may keep
        are named (:data:`OFFLOADED`): the layer input, the attention output, the FFN / MoE
        block's input and output. ``segment_ids [B, S]``: packed documents (attention module doc)."""
        x = checkpoint_name(x, "layer_in")
        a = checkpoint_name(self.attn(self.attn_norm(x), cos, sin, segment_ids), "attn_out")
        x = x + a
        h = checkpoint_name(self.ffn_norm(x), "ffn_in")
        f, routing = self.ffn(h, forced_idx)
        f = checkpoint_name(f, "ffn_out")
        return x + f, a, f, routing


class DenseLayer(DecoderLayer):
    """A decoder layer with a dense SwiGLU FFN (``mlp``): the first ``first_k_dense`` layers."""

    @builds
    def __init__(self, cfg: Config, *, stack: tuple = (), rngs: nnx.Rngs):
        self._init_attention(cfg, stack, rngs)
        m = cfg.model
        self.mlp = SwiGLU(m.d_model, m.dense_ffn_dim, m.init_std, stack=stack, rngs=rngs)

    def ffn(self, h, forced_idx=None):
        return self.mlp(h), None


class MoELayer(DecoderLayer, MoEBlock):
    """A decoder layer whose FFN is the MoE block. It extends :class:`MoEBlock`, so the block's
    weights sit at the layer's level (``moe/router``, ``moe/experts/*``, ``moe/shared/*``), as
    in the canonical layout (checkpoints, the HF name map and the sharding rules read those paths;
    a ``block`` submodule would insert a level), and ``model.moe`` is a ``MoEBlock`` to a user."""

    @builds
    def __init__(self, cfg: Config, *, stack: tuple = (), rngs: nnx.Rngs, dispatch: Callable | None = None):
        self._init_attention(cfg, stack, rngs)
        MoEBlock.__init__(self, cfg, stack=stack, rngs=rngs, dispatch=dispatch)

    def ffn(self, h, forced_idx=None):
        return MoEBlock.__call__(self, h, forced_idx=forced_idx)


class MTPMoELayer(MoELayer, MTPFusion):
    """A multi-token-prediction depth whose block is an MoE layer (:mod:`jaxmoe.model.mtp`)."""

    @builds
    def __init__(self, cfg: Config, *, stack: tuple = (), rngs: nnx.Rngs, dispatch: Callable | None = None):
        MoELayer.__init__(self, cfg, stack=stack, rngs=rngs, dispatch=dispatch)
        self._init_mtp(cfg, stack)


class MTPDenseLayer(DenseLayer, MTPFusion):
    """A multi-token-prediction depth whose block is a dense layer (a model without MoE layers)."""

    @builds
    def __init__(self, cfg: Config, *, stack: tuple = (), rngs: nnx.Rngs):
        DenseLayer.__init__(self, cfg, stack=stack, rngs=rngs)
        self._init_mtp(cfg, stack)


# remat="offload": the per-layer residuals kept for the backward, all in pinned host memory.
# With everything else recomputed, a layer's backward needs exactly these: its input (the scan's
# saved layer inputs, [L, B, S, D] -- what dominates once the rest is recomputed), the attention
# output and the MoE block's input (so the attention is not re-run to rebuild the block's input),
# and the block's output. (Names that the backward does not need are simply not saved.)
OFFLOADED = ("layer_in", "attn_out", "ffn_in", "ffn_out")


def _remat(fn: Callable, mode: str) -> Callable:
    """Wrap one layer's function in ``jax.checkpoint`` according to ``cfg.compute.remat``."""
    if mode == "none":
        return fn
    if mode == "full":
        return jax.checkpoint(fn)
    if mode == "save_dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if mode == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(OFFLOADED),
            offload_src="device",
            offload_dst="pinned_host",
        )
        return jax.checkpoint(fn, policy=policy)
    raise ValueError(f"unknown compute.remat {mode!r}")


def _scan_layers(layers: nnx.Module, x, forced_idx, mode, unroll, return_probes, cos, sin, segment_ids=None):
    """Run a stacked layer module over ``x`` with ``jax.lax.scan`` over its split state,
    ``unroll`` layers per iteration (``compute.scan_unroll``; 0 = all of them)."""
    graphdef, state = nnx.split(layers)
    n = jax.tree.leaves(state)[0].shape[0]

    def body(x, xs):
        layer_state, forced = xs
        layer = nnx.merge(graphdef, layer_state)
        x, a, f, routing = layer(x, cos, sin, forced, segment_ids)
        out = {}
        if routing is not None:
            out["routing"] = routing
        if return_probes:
            out["attn_out"], out["ffn_out"] = a, f
        return x, out

    return jax.lax.scan(_remat(body, mode), x, (state, forced_idx), unroll=min(unroll or n, n))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class Transformer(nnx.Module):
    """The MoE language model of ``cfg`` (see the module doc). ``dispatch``: the expert-parallel
    dispatcher of the mesh the model is placed on (``MeshContext.dispatch``,
    :func:`jaxmoe.parallel.expert_dispatch.make_dispatch`); None runs the experts on one device. It is bound into
    the MoE layers' :class:`~jaxmoe.model.experts.Experts` here, so ``model(tokens)`` is the
    whole call."""

    @builds
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, dispatch: Callable | None = None):
        cfg = resolve_auto(cfg)  # `auto` fields -> this backend's values (jaxmoe.config.autoconf)
        m = cfg.model
        self.cfg = cfg
        self.embed = Embedding.declare((m.vocab_size, m.d_model), ("vocab", "embed"), normal(m.init_std))
        if m.first_k_dense > 0:  # layer stacks: one module each, scanned
            self.dense = DenseLayer(cfg, stack=(m.first_k_dense,), rngs=rngs)
        if m.n_moe_layers > 0:
            self.moe = MoELayer(cfg, stack=(m.n_moe_layers,), rngs=rngs, dispatch=dispatch)
        if m.mtp_layers > 0:  # multi-token prediction depths (jaxmoe.model.mtp)
            self.mtp = (MTPMoELayer(cfg, stack=(m.mtp_layers,), rngs=rngs, dispatch=dispatch) if m.n_moe_layers > 0
                        else MTPDenseLayer(cfg, stack=(m.mtp_layers,), rngs=rngs))
        self.final_norm = RMSNorm.declare((m.d_model,), ("norm",), ones(), eps=m.rms_norm_eps)
        if not m.tie_embeddings:
            self.lm_head = Linear.declare((m.d_model, m.vocab_size), ("embed", "vocab"),
                                          normal(m.init_std), group="head")

    @fp8.scoped  # compute.fp8: the recipe the covered matmuls trace under (jaxmoe.model.fp8)
    def __call__(self, tokens: jax.Array, *, forced_idx: jax.Array | None = None,
                 return_probes: bool = False, return_hidden: bool = False,
                 segment_ids: jax.Array | None = None, positions: jax.Array | None = None):
        """``tokens [B, S]`` int32 -> ``(logits [B, S, V] fp32, aux)``; with ``return_hidden`` the
        final-normed hidden states ``[B, S, D]`` in place of the logits (see :meth:`head`).

        ``forced_idx [Lm, B*S, k]`` replays a routing (parity). Packed documents:
        ``segment_ids [B, S]`` (1, 2, ... per row, 0 = padding) keeps attention inside each
        document (:func:`jaxmoe.model.attention.document_mask`); ``positions [B, S]`` (each
        token's position in its document) drive RoPE instead of ``0..S-1``. Both default to
        None: the whole row causal, positions ``0..S-1`` (the same graph as without them).
        """
        cfg = self.cfg
        m, e = cfg.model, cfg.moe
        dtype = DTYPES[cfg.compute.dtype]
        b, s = tokens.shape
        t = b * s
        cos, sin = rope_tables(m, s, positions)
        x = self.embed(tokens).astype(dtype)
        probes: dict = {"embedding": x} if return_probes else {}
        kw = dict(mode=cfg.compute.remat, unroll=cfg.compute.scan_unroll, return_probes=return_probes, cos=cos, sin=sin,
                  segment_ids=segment_ids)
        attn_outs = []
        if m.first_k_dense > 0:
            x, ys = _scan_layers(self.dense, x, None, **kw)
            if return_probes:
                attn_outs.append(ys["attn_out"])
                probes["ffn_out"] = ys["ffn_out"]
        if m.n_moe_layers > 0:
            x, ys = _scan_layers(self.moe, x, forced_idx, **kw)
            routing = ys["routing"]
            if return_probes:
                attn_outs.append(ys["attn_out"])
                probes["moe_out"] = ys["ffn_out"]
        else:
            routing = no_routing(t, e)
        mtp = None
        if m.mtp_layers > 0:  # h_0 = the last main layer's output before the final norm
            mtp = run_mtp(self.mtp, self.embed.get_value(), tokens, x, cos, sin, segment_ids,
                          wrap=lambda f: _remat(f, cfg.compute.remat))
        x = self.final_norm(x)
        if return_hidden:  # the loss applies the LM head itself (chunked cross-entropy)
            logits = x
        elif m.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            head = self.lm_head.get_value()
            logits = jnp.einsum("bsd,dv->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)
        aux = {
            "router": {k: routing[k] for k in RouterOut._fields},
            "counts": routing["counts"],
            "dropped": routing["dropped"],
        }
        if mtp is not None:  # per-depth hidden states [N, B, S, D] (or logits), the MTP routing
            aux["mtp_hidden" if return_hidden else "mtp_logits"] = mtp[0] if return_hidden else self.logits(mtp[0])
            if mtp[1] is not None:
                aux["mtp_routing"] = mtp[1]
        if return_probes:
            probes["attn_out"] = jnp.concatenate(attn_outs, axis=0)
            probes["router_logits"] = routing["logits"]
            probes.setdefault("moe_out", jnp.zeros((0, b, s, m.d_model), dtype))
            probes.setdefault("ffn_out", jnp.zeros((0, b, s, m.d_model), dtype))
            probes["final_hidden"] = x
            probes["logits"] = logits
            aux["probes"] = probes
        return logits, aux

    def logits(self, x: jax.Array) -> jax.Array:
        """The shared LM head on hidden states ``[..., S, D]`` -> fp32 logits ``[..., S, V]``."""
        return jnp.einsum("...sd,dv->...sv", x, self.head(), preferred_element_type=jnp.float32)

    def head(self) -> jax.Array:
        """The LM head as ``[D, V]`` in the compute dtype (the tied embedding transposed):
        ``logits = hidden @ head`` with fp32 accumulation."""
        dtype = DTYPES[self.cfg.compute.dtype]
        w = self.embed.get_value().T if self.cfg.model.tie_embeddings else self.lm_head.get_value()
        return w.astype(dtype)

    def pure(self) -> tuple[dict, dict]:
        """``(params, buffers)`` as plain nested dicts of arrays (the canonical layout)."""
        return split_state(self)


# ---------------------------------------------------------------------------------------------
# Functional API on split state
# ---------------------------------------------------------------------------------------------


# flax >= 0.12: nnx.to_pure_dict / nnx.replace_by_pure_dict (State methods are deprecated there);
# older releases only have the State methods.
def _to_pure(state) -> dict:
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def _replace_by_pure(state, pure: dict) -> None:
    if hasattr(nnx, "replace_by_pure_dict"):
        nnx.replace_by_pure_dict(state, pure)
    else:
        state.replace_by_pure_dict(pure)


def split_state(model: nnx.Module) -> tuple[dict, dict]:
    """``(params, buffers)`` of a model as nested dicts (trained parameters, non-trained buffers)."""
    _, params, buffers = nnx.split(model, nnx.Param, Buffer)
    return _to_pure(params), _to_pure(buffers)


_TEMPLATES: collections.OrderedDict = collections.OrderedDict()


def template(cfg: Config, dispatch: Callable | None = None):
    """``(graphdef, abstract params State, abstract buffers State)`` of ``cfg``'s model built with
    ``dispatch``, once per (config, dispatcher) without allocating (``nnx.eval_shape``)."""
    key = (cfg.to_json(), dispatch)
    hit = _TEMPLATES.get(key)
    if hit is None:
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dispatch=dispatch))
        hit = nnx.split(abstract, nnx.Param, Buffer)
        _TEMPLATES[key] = hit
        while len(_TEMPLATES) > 64:
            _TEMPLATES.popitem(last=False)
    _TEMPLATES.move_to_end(key)
    return hit


def _fill(abstract_state, pure: dict):
    state = jax.tree.map(lambda v: v, abstract_state)
    _replace_by_pure(state, pure)
    return state


class Model:
    """``cfg``'s model as a function of split state: what the jitted train, eval and parity steps
    trace. ``dispatch`` is the expert-parallel dispatcher of the mesh the model is placed on
    (``MeshContext.model()``; None = one device), bound into the module it builds, so the steps
    and the objective pass the model, never a dispatcher.

    ``Model(cfg)(params, buffers, tokens)`` -> ``(logits, aux)`` (:meth:`Transformer.__call__`;
    ``segment_ids`` / ``positions`` of packed documents as there); with ``return_hidden``:
    ``(hidden [B, S, D], head [D, V], aux)`` (chunked cross-entropy)."""

    def __init__(self, cfg: Config, dispatch: Callable | None = None):
        self.cfg = resolve_auto(cfg)  # what the objective reads too (compute.ce_chunk_tokens)
        self.dispatch = dispatch

    def merge(self, params: dict, buffers: dict) -> Transformer:
        """The :class:`Transformer` holding ``params`` / ``buffers`` (no copy)."""
        graphdef, abs_params, abs_buffers = template(self.cfg, self.dispatch)
        return nnx.merge(graphdef, _fill(abs_params, params), _fill(abs_buffers, buffers or {}))

    def __call__(self, params: dict, buffers: dict, tokens: jax.Array, *,
                 forced_idx: jax.Array | None = None, return_probes: bool = False,
                 return_hidden: bool = False, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):
        model = self.merge(params, buffers)
        out = model(tokens, forced_idx=forced_idx, return_probes=return_probes, return_hidden=return_hidden,
                    segment_ids=segment_ids, positions=positions)
        return (out[0], model.head(), out[1]) if return_hidden else out


_INIT_FNS: collections.OrderedDict = collections.OrderedDict()


def init_fn(cfg: Config, out_shardings=None) -> Callable:
    """``seed -> (params, buffers)``: the model's declared init as ONE jitted program (cached per
    config). With ``out_shardings`` each device materialises only its own shards."""
    key = (cfg.to_json(), repr(out_shardings))
    fn = _INIT_FNS.get(key)
    if fn is None:
        def make(seed):
            return split_state(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(seed))))

        fn = jax.jit(make, out_shardings=out_shardings)
        _INIT_FNS[key] = fn
        while len(_INIT_FNS) > 32:
            _INIT_FNS.popitem(last=False)
    return fn


def init_params(cfg: Config, seed: int) -> tuple[dict, dict]:
    """Random fp32 parameters and zero buffers of ``cfg``'s model, as
    ``Transformer(cfg, rngs=nnx.Rngs(seed))`` makes them: norms ones, routers ~
    N(0, router_init_std), every other weight ~ N(0, init_std) (the declarations in the modules)."""
    return init_fn(cfg)(seed)


def abstract_params(cfg: Config) -> tuple[dict, dict]:
    """``(params, buffers)`` as ``jax.ShapeDtypeStruct`` trees (nothing allocated)."""
    _, p, b = template(cfg)
    return _to_pure(p), _to_pure(b)


def apply_model(cfg: Config, params: dict, buffers: dict, tokens: jax.Array, **kw):
    """The forward pass of ``cfg``'s model on one device: ``Model(cfg)(params, buffers, tokens,
    **kw)`` (see :class:`Model`)."""
    return Model(cfg)(params, buffers, tokens, **kw)


def LAYER_STACKS(cfg: Config) -> list[tuple[str, int, int]]:  # noqa: N802 (a table, by config)
    """The stacked layer modules: ``(state path, first layer index, number of layers)``."""
    m = cfg.model
    out = []
    if m.first_k_dense > 0:
        out.append(("dense", 0, m.first_k_dense))
    if m.n_moe_layers > 0:
        out.append(("moe", m.first_k_dense, m.n_moe_layers))
    if m.mtp_layers > 0:  # HF stores the MTP depths as layers L .. L + N - 1
        out.append(("mtp", m.n_layers, m.mtp_layers))
    return out


def model_declarations(cfg: Config) -> dict[str, Decl]:
    """Every declared variable of ``cfg``'s model by canonical path (params, then buffers)."""
    _, p, b = template(cfg)
    return {**declarations(p), **declarations(b)}


def declared_groups(cfg: Config) -> dict:
    """The optimizer group of every parameter, nested like ``params`` (for jaxmoe.train.optim)."""
    return unflatten({k: d.group for k, d in model_declarations(cfg).items() if d.trained})


def param_count(params) -> int:
    """Total number of scalars in ``params``."""
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


__all__ = ["DTYPES", "LAYER_STACKS", "DecoderLayer", "DenseLayer", "Model", "MoELayer", "Transformer",
           "abstract_params", "apply_model", "declared_groups", "init_fn", "init_params",
           "model_declarations", "param_count", "split_state", "template"]
