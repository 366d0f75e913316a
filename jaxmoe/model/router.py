"""The fp32 router: scores, biased / group-limited selection, top-k, gate weights.

Semantics (docs/LAYOUT.md "Routing semantics"):

* scores: ``softmax(logits)`` (Mixtral/Qwen3) or ``sigmoid(logits)`` (DeepSeek-V3).
* selection score: ``scores + bias`` when ``use_expert_bias``, for either score function
  (DeepSeek-V3's aux-loss-free rule; torchtitan applies its ``expert_bias_E`` the same way to
  softmax and sigmoid scores, and its qwen3 / deepseek_v3 flavors enable it by default). With
  ``n_groups > 1`` a group's score is the sum of its top-2 selection scores, the best
  ``topk_groups`` groups are kept and the others masked to -inf; top-k on the selection scores.
* weights: the *unbiased* ``scores[idx]`` (the bias never enters the weights), divided by their
  sum if ``norm_topk_prob`` (``sum + 1e-20`` for sigmoid, as DeepSeek-V3; softmax sums are at
  least ``k / E``, far above that epsilon, so HF's plain sum and torchtitan's ``+ 1e-20`` agree
  bit for bit in fp32); times ``route_scale``.
* Ties go to the lower index: ``jax.lax.top_k`` documents "If two elements are equal, the
  lower-index element appears first" (tests/test_router.py checks it), for experts and groups.
* ``forced_idx`` (parity replay) replaces the selected indices; weights come from the scores at
  those indices exactly as above.

The math is the pure function :func:`route`; :class:`Router` is the router weight ``[D, E]``
(path ``moe/router``) as a declared parameter that routes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config.schema import MoEConfig
from jaxmoe.model.params import Weight


class RouterOut(NamedTuple):
    logits: jax.Array  # [T, E] fp32: x @ w_router
    scores: jax.Array  # [T, E] fp32: softmax probs or sigmoid scores (unbiased)
    topk_idx: jax.Array  # [T, k] int32, sorted by selection score descending
    topk_weights: jax.Array  # [T, k] fp32 gate weights


def select_experts(scores: jax.Array, bias: jax.Array | None, c: MoEConfig) -> jax.Array:
    """Top-k expert indices ``[T, k]`` from scores ``[T, E]`` (+ bias, + group limit)."""
    sel = scores if bias is None else scores + bias.astype(jnp.float32)
    if c.n_groups > 1:
        t, e = sel.shape
        grouped = sel.reshape(t, c.n_groups, e // c.n_groups)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, keep = jax.lax.top_k(group_score, c.topk_groups)  # [T, topk_groups]
        keep_mask = jnp.zeros((t, c.n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
        sel = jnp.where(keep_mask[:, :, None], grouped, -jnp.inf).reshape(t, e)
    _, idx = jax.lax.top_k(sel, c.top_k)
    return idx.astype(jnp.int32)


def gate_weights(scores: jax.Array, idx: jax.Array, c: MoEConfig) -> jax.Array:
    """Gate weights ``[T, k]`` from the unbiased scores at ``idx``."""
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if c.norm_topk_prob:
        denom = w.sum(-1, keepdims=True)
        if c.score_func == "sigmoid":
            denom = denom + 1e-20
        w = w / denom
    return w * c.route_scale


def route(
    x: jax.Array,
    w_router: jax.Array,
    bias: jax.Array | None,
    moe_cfg: MoEConfig,
    forced_idx: jax.Array | None = None,
) -> RouterOut:
    """Route tokens ``x [T, D]`` with router weight ``[D, E]``; ``bias [E]`` or None (selection only).

    Everything is fp32 regardless of the compute dtype of ``x``.
    """
    c = moe_cfg
    logits = jnp.dot(
        x.astype(jnp.float32), w_router.astype(jnp.float32), preferred_element_type=jnp.float32
    )
    scores = jax.nn.softmax(logits, axis=-1) if c.score_func == "softmax" else jax.nn.sigmoid(logits)
    sel_bias = bias if c.use_expert_bias else None
    if forced_idx is None:
        idx = select_experts(jax.lax.stop_gradient(scores), sel_bias, c)
    else:
        idx = forced_idx.astype(jnp.int32)
    weights = gate_weights(scores, idx, c)
    return RouterOut(logits, scores, idx, weights)


class Router(Weight):
    """The router weight ``[D, E]`` (HF ``gate.weight`` is ``[E, D]``); Muon treats it as a
    matrix. ``router(x, bias, moe_cfg, forced_idx)`` is :func:`route` with this weight."""

    hf_transpose = True
    keep_fp32 = True  # stored fp32 whatever the weights' dtype (as HF; conversions read this)

    def __call__(self, x, bias, moe_cfg: MoEConfig, forced_idx=None) -> RouterOut:
        return route(x, self.get_value(), bias, moe_cfg, forced_idx)
