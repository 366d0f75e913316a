"""The SwiGLU MLP module: the dense FFN of the first layers (``dense/mlp``) and the fused shared
experts of MoE layers (``moe/shared``)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxmoe.model.params import Linear, builds, normal, stack_axes


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` with ``gate_proj``/``up_proj [D, F]``, ``down_proj [F, D]``
    (each with the leading ``stack`` dims of a layer stack)."""

    @builds
    def __init__(self, d_model: int, ffn_dim: int, std: float, *, stack: tuple = (), rngs: nnx.Rngs):
        ax = lambda *a: stack_axes(stack, a)  # noqa: E731
        self.gate_proj = Linear.declare(stack + (d_model, ffn_dim), ax("embed", "mlp"), normal(std))
        self.up_proj = Linear.declare(stack + (d_model, ffn_dim), ax("embed", "mlp"), normal(std))
        self.down_proj = Linear.declare(stack + (ffn_dim, d_model), ax("mlp", "embed"), normal(std))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
