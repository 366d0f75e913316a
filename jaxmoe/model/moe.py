"""The MoE feed-forward block: router -> experts (dispatch + compute + combine) -> + shared experts.

``moe_ffn(p, x, bias, cfg, ...)`` works on one layer's parameter dict ``p`` (the ``moe/`` sub-dict of
docs/LAYOUT.md for a single layer: ``router``, ``experts``, optionally ``shared``) and returns the
FFN output plus the routing record used for losses, metrics and parity.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxmoe.config import Config
from jaxmoe.model.experts import expert_ffn
from jaxmoe.model.layers import swiglu
from jaxmoe.model.router import RouterOut, route


def moe_ffn(
    p: dict,
    x: jax.Array,
    bias: jax.Array | None,
    cfg: Config,
    *,
    forced_idx: jax.Array | None = None,
    dispatch: Callable | None = None,
) -> tuple[jax.Array, RouterOut, dict]:
    """MoE FFN of ``x [B, S, D]`` (compute dtype) -> ``(y [B, S, D], RouterOut, stats)``.

    Tokens are flattened row-major to ``T = B*S``. The router runs in fp32; ``dispatch`` (default
    :func:`jaxmoe.model.experts.expert_ffn`) moves tokens to experts, runs them and combines in
    fp32. Shared experts (one fused SwiGLU) see every token and are added to the routed output.
    """
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    r = route(xt, p["router"], bias, cfg.moe, forced_idx)
    ffn = dispatch if dispatch is not None else expert_ffn
    y, stats = ffn(xt, r.topk_idx, r.topk_weights, p["experts"], cfg.moe)
    if "shared" in p:
        sh = p["shared"]
        y = y + swiglu(xt, sh["gate_proj"], sh["up_proj"], sh["down_proj"])
    return y.reshape(b, s, d), r, stats
