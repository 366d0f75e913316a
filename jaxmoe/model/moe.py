"""The MoE feed-forward block: router -> experts (dispatch + compute + combine) -> + shared experts.

:class:`MoEBlock` holds ``router [D, E]`` (:class:`~jaxmoe.model.router.Router`), ``experts``
(:class:`~jaxmoe.model.experts.Experts`), optionally ``shared`` (one fused SwiGLU of width
``n_shared_experts * expert_ffn_dim``) and, with ``use_expert_bias``, the non-trained
``expert_bias [E]``. Called on ``x [B, S, D]`` it returns the FFN output and the layer's routing
record (router logits/scores/indices/weights, counts, dropped) from which losses, metrics and
parity are computed outside the model.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model.experts import Experts
from jaxmoe.model.mlp import SwiGLU
from jaxmoe.model.params import ExpertBias, builds, normal, stack_axes, zeros
from jaxmoe.model.router import Router, RouterOut


class MoEBlock(nnx.Module):
    """Router, routed experts, shared experts (see the module doc)."""

    @builds
    def __init__(self, cfg: Config, *, stack: tuple = (), rngs: nnx.Rngs, dispatch: Callable | None = None):
        m, e = cfg.model, cfg.moe
        self.moe_cfg = e
        self.router = Router.declare(stack + (m.d_model, e.n_experts),
                                     stack_axes(stack, ("embed", "router_experts")),
                                     normal(e.router_init_std))
        self.experts = Experts(m, e, stack=stack, rngs=rngs, dispatch=dispatch)
        if e.n_shared_experts > 0:
            self.shared = SwiGLU(m.d_model, e.n_shared_experts * e.expert_ffn_dim, m.init_std,
                                 stack=stack, rngs=rngs)
        if e.use_expert_bias:
            self.expert_bias = ExpertBias.declare(stack + (e.n_experts,),
                                                  stack_axes(stack, ("router_experts",)), zeros())

    def __call__(self, x: jax.Array, *, forced_idx: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """``x [B, S, D]`` (compute dtype) -> ``(y [B, S, D], routing)``.

        Tokens are flattened row-major to ``T = B*S``. ``routing``: ``logits``, ``scores [T, E]``,
        ``topk_idx``, ``topk_weights [T, k]``, ``counts [E]``, ``dropped`` (scalar).
        ``forced_idx [T, k]`` replays a routing (parity). Built with ``dispatch`` (an
        expert-parallel dispatcher, :mod:`jaxmoe.parallel.expert_dispatch`), the experts run through it instead of
        the single-device :func:`~jaxmoe.model.experts.expert_ffn`.
        """
        b, s, d = x.shape
        xt = x.reshape(b * s, d)
        bias = self.expert_bias.get_value() if self.moe_cfg.use_expert_bias else None
        r = self.router(xt, bias, self.moe_cfg, forced_idx)
        y, stats = self.experts(xt, r.topk_idx, r.topk_weights)
        if self.moe_cfg.n_shared_experts > 0:
            y = y + self.shared(xt)
        return y.reshape(b, s, d), routing_record(r, stats["counts"], stats["dropped"])


def routing_record(r: RouterOut, counts: jax.Array, dropped: jax.Array) -> dict:
    """A layer's routing record: the :class:`~jaxmoe.model.router.RouterOut` fields, ``counts``
    and ``dropped`` (the one place these keys are spelled; stacked over layers by the model)."""
    return {**r._asdict(), "counts": counts, "dropped": dropped}


def no_routing(t: int, e) -> dict:
    """The routing record of a model without MoE layers: each entry stacked over 0 layers."""
    f32 = jnp.float32
    r = RouterOut(logits=jnp.zeros((0, t, e.n_experts), f32), scores=jnp.zeros((0, t, e.n_experts), f32),
                  topk_idx=jnp.zeros((0, t, e.top_k), jnp.int32), topk_weights=jnp.zeros((0, t, e.top_k), f32))
    return routing_record(r, jnp.zeros((0, e.n_experts), jnp.int32), jnp.zeros((0,), jnp.int32))


__all__ = ["MoEBlock", "no_routing", "routing_record"]
