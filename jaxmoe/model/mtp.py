"""Multi-token prediction (MTP): DeepSeek-V3's definition (arXiv 2412.19437, section 2.2).

``model.mtp_layers = N`` adds N sequential depths after the main layers. Depth ``k`` (1..N) at
position ``i``:

* ``h_k = eh_proj(concat[enorm(embed(token[i + k])), hnorm(h_{k-1}[i])])`` -- ``h_0`` is the last
  main layer's output *before* the final norm;
* then one decoder layer (an MoE layer when the model has MoE layers, as DeepSeek-V3's MTP layer
  is; else a dense one), then its own final norm (HF ``shared_head.norm``, here ``mtp/norm``);
* then the model's shared output head (the embedding and the head are shared, not copied).

Its logits predict token ``i + k + 1`` (the training targets shifted left by ``k``): the loss is
in :func:`jaxmoe.train.losses.mtp_cross_entropy`. Positions whose shifted token lies past the end
of the row (or in another packed document) are *invalid*: their input token is 0 and their
``h_{k-1}`` is zeroed before ``hnorm`` (torchtitan 0.3's ``roll_mtp_sequence`` convention), and
their targets are masked.

The depths are one stacked layer module (``stack=(N,)``, parameters ``mtp/*`` with a leading
``layers`` axis) scanned like the main stacks; HF stores depth ``k`` as layer ``L + k - 1``.
The MTP layer's routing is returned apart (``aux["mtp_routing"]``): it adds to no router loss and
its expert bias (if any) is not updated (the main layers' bias rule reads the main record only).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxmoe.config import Config
from jaxmoe.model.params import Linear, RMSNorm, normal, ones, stack_axes


def shifted(tokens: jax.Array, k: int, segment_ids: jax.Array | None = None):
    """``(tokens shifted left by k, valid [B, S] bool)``: position ``i`` holds ``tokens[i + k]``
    where ``i + k < S`` (and, with packed documents, in the same document), else 0."""
    b, s = tokens.shape
    idx = jnp.arange(s)
    valid = jnp.broadcast_to(idx + k < s, (b, s))
    src = jnp.minimum(idx + k, s - 1)
    if segment_ids is not None:
        valid = valid & (segment_ids[:, src] == segment_ids)
    return jnp.where(valid, tokens[:, src], 0).astype(tokens.dtype), valid


class MTPFusion:
    """The MTP parts of a depth's layer (a mixin of the decoder-layer classes): ``enorm``,
    ``hnorm``, ``eh_proj [2D, D]`` and the depth's final ``norm``."""

    def _init_mtp(self, cfg: Config, stack: tuple) -> None:
        m = cfg.model
        norm = stack_axes(stack, ("norm",))
        self.enorm = RMSNorm.declare(stack + (m.d_model,), norm, ones(), eps=m.rms_norm_eps)
        self.hnorm = RMSNorm.declare(stack + (m.d_model,), norm, ones(), eps=m.rms_norm_eps)
        self.eh_proj = Linear.declare(stack + (2 * m.d_model, m.d_model), stack_axes(stack, ("mlp", "embed")),
                                      normal(m.init_std))
        self.norm = RMSNorm.declare(stack + (m.d_model,), norm, ones(), eps=m.rms_norm_eps)

    def fuse(self, emb: jax.Array, h: jax.Array, valid: jax.Array) -> jax.Array:
        """``eh_proj(concat[enorm(emb), hnorm(h * valid)])``."""
        h = h * valid[..., None].astype(h.dtype)
        return self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1))


def run_mtp(layers, embed: jax.Array, tokens: jax.Array, h0: jax.Array, cos, sin,
            segment_ids=None, wrap: Callable = lambda f: f):
    """All depths of the stacked MTP layer module ``layers`` (split/merged as the main stacks):
    ``-> (hidden [N, B, S, D] after each depth's norm, routing stacked [N, ...] or None)``.
    ``embed [V, D]`` is the shared embedding; ``wrap`` the remat wrapper of one layer."""
    from flax import nnx  # the module graph is split here, as the main layer scan does

    graphdef, state = nnx.split(layers)
    n = jax.tree.leaves(state)[0].shape[0]
    toks, valid = zip(*(shifted(tokens, k, segment_ids) for k in range(1, n + 1)))

    def body(h, xs):
        layer_state, tok, ok = xs
        layer = nnx.merge(graphdef, layer_state)
        x = layer.fuse(embed[tok].astype(h.dtype), h, ok)
        x, _, _, routing = layer(x, cos, sin, None, segment_ids)
        return x, {"hidden": layer.norm(x), **({"routing": routing} if routing is not None else {})}

    _, ys = jax.lax.scan(wrap(body), h0, (state, jnp.stack(toks), jnp.stack(valid)))
    return ys["hidden"], ys.get("routing")


__all__ = ["MTPFusion", "run_mtp", "shifted"]
