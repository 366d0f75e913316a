"""Decoding with a KV cache: prefill a batch of prompts, then one token per step.

The model's own modules (embedding, norms, projections, MoE blocks, LM head) are reused as they
are; only attention is re-expressed against a cache of fixed length ``C`` (:func:`init_cache`):

* GQA / MHA caches the RoPE'd keys and the values per KV head: ``k, v [L, B, C, KV, hd]``.
* MLA caches DeepSeek-V3's inference form: the normed compressed latent ``ckv [L, B, C, kv_lora]``
  and the RoPE'd shared key ``krope [L, B, C, rope]``. ``kv_b_proj`` is absorbed: the query's nope
  part is taken into the latent space (``q_lat = q_nope W_uk``), scores are ``q_lat . ckv +
  q_rope . krope``, the output is ``(probs . ckv) W_uv``; no per-head key or value is rebuilt.

Rows hold prompts of different lengths **left-padded** to one length ``P``: row ``b`` has
``pad[b]`` padding slots first. Slot ``j`` of the cache is written at step ``j`` for every row;
a query at slot ``i`` sees slot ``j`` iff ``j <= i`` and ``j >= pad[b]`` (or ``j == i``, so a
padding query's softmax is never empty); RoPE positions are ``slot - pad[b]``, so each prompt sees
exactly the positions it has alone. The expert FFN treats every token independently (dropless
capacity), so padding does not change a real token's output.

:class:`Decoder` jits the prefill once per ``(B, P, C)`` and the step once per ``(B, C)``:
callers round ``P`` and ``C`` up to length buckets (:func:`bucket`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model.attention import GQAttention, MLAttention
from jaxmoe.model.layers import rope_tables
from jaxmoe.model.transformer import DTYPES, LAYER_STACKS, Model, Transformer


def bucket(n: int, minimum: int = 16) -> int:
    """The length bucket of ``n``: the next power of two, at least ``minimum``."""
    b = minimum
    while b < n:
        b *= 2
    return b


def init_cache(cfg: Config, batch: int, length: int) -> dict:
    """Zero caches of ``length`` slots per layer stack (``dense``, ``moe``; see the module doc)."""
    m = cfg.model
    dtype = DTYPES[cfg.compute.dtype]
    out = {}
    for name, _first, n in LAYER_STACKS(cfg):
        if m.attention == "mla":
            out[name] = {"ckv": jnp.zeros((n, batch, length, m.kv_lora_rank), dtype),
                         "krope": jnp.zeros((n, batch, length, m.qk_rope_head_dim), dtype)}
        else:
            shape = (n, batch, length, m.n_kv_heads, m.head_dim)
            out[name] = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    return out


def _write(cache: jax.Array, new: jax.Array, start) -> jax.Array:
    """``new [B, T, ...]`` into ``cache [B, C, ...]`` at slots ``start .. start+T-1``."""
    idx = (0, start) + (0,) * (cache.ndim - 2)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), idx)


def _softmax(scores, mask, dtype):
    scores = jnp.where(mask, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def gqa_step(attn: GQAttention, x, cos, sin, cache: dict, start, mask):
    """GQA on ``x [B, T, D]`` written at slots ``start..``; ``mask [B, T, C]`` -> (out, cache)."""
    b, t, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x, cos, sin)
    cache = {"k": _write(cache["k"], k, start), "v": _write(cache["v"], v, start)}
    q5 = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q5, cache["k"], preferred_element_type=jnp.float32) * hd**-0.5
    probs = _softmax(scores, mask[:, None, None], cache["v"].dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, cache["v"], preferred_element_type=jnp.float32)
    return attn.o_proj(out.astype(x.dtype).reshape(b, t, h * hd)), cache


def mla_step(attn: MLAttention, x, cos, sin, cache: dict, start, mask):
    """MLA in the absorbed form (module doc) on ``x [B, T, D]`` -> (out, cache)."""
    b, t, _ = x.shape
    h, nope, vd, c = attn.n_heads, attn.nope, attn.v_dim, attn.kv_lora_rank
    q_nope, q_rope, ckv, k_rope = attn.latent(x, cos, sin)
    cache = {"ckv": _write(cache["ckv"], ckv, start), "krope": _write(cache["krope"], k_rope, start)}
    w = attn.kv_b_proj.get_value().astype(x.dtype).reshape(c, h, nope + vd)
    w_uk, w_uv = w[..., :nope], w[..., nope:]
    f32 = jnp.float32
    q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w_uk, preferred_element_type=f32).astype(x.dtype)
    scores = (jnp.einsum("bthc,bsc->bhts", q_lat, cache["ckv"], preferred_element_type=f32)
              + jnp.einsum("bthr,bsr->bhts", q_rope, cache["krope"], preferred_element_type=f32)) * attn.scale
    probs = _softmax(scores, mask[:, None], x.dtype)
    o_lat = jnp.einsum("bhts,bsc->bthc", probs, cache["ckv"], preferred_element_type=f32).astype(x.dtype)
    out = jnp.einsum("bthc,chv->bthv", o_lat, w_uv, preferred_element_type=f32).astype(x.dtype)
    return attn.o_proj(out.reshape(b, t, h * vd)), cache


ATTENTION_STEP = {GQAttention: gqa_step, MLAttention: mla_step}


def _run_stack(layers: nnx.Module, x, cos, sin, cache: dict, start, mask):
    """The stacked layers over ``x`` with their caches (scanned like the full forward)."""
    graphdef, state = nnx.split(layers)

    def body(x, xs):
        layer_state, c = xs
        layer = nnx.merge(graphdef, layer_state)
        a, c = ATTENTION_STEP[type(layer.attn)](layer.attn, layer.attn_norm(x), cos, sin, c, start, mask)
        x = x + a
        f, routing = layer.ffn(layer.ffn_norm(x))
        return x + f, (c, None if routing is None else routing["counts"])

    return jax.lax.scan(body, x, (state, cache))


def forward_cached(model: Transformer, tokens, cache: dict, start, pad):
    """``tokens [B, T]`` at cache slots ``start .. start+T-1`` of rows left-padded by ``pad [B]``
    -> ``(logits [B, T, V] fp32, cache)`` (the module doc: masks and positions)."""
    cfg = model.cfg
    dtype = DTYPES[cfg.compute.dtype]
    b, t = tokens.shape
    length = jax.tree.leaves(cache)[0].shape[2]
    slot = start + jnp.arange(t)
    positions = jnp.maximum(slot[None, :] - pad[:, None], 0)
    cos, sin = rope_tables(cfg.model, t, positions)
    keys = jnp.arange(length)
    mask = (keys[None, None, :] <= slot[None, :, None]) & (
        (keys[None, None, :] >= pad[:, None, None]) | (keys[None, None, :] == slot[None, :, None]))
    x = model.embed(tokens).astype(dtype)
    new = {}
    for name, _first, _n in LAYER_STACKS(cfg):
        x, (new[name], _counts) = _run_stack(getattr(model, name), x, cos, sin, cache[name], start, mask)
    x = model.final_norm(x)
    logits = jnp.einsum("btd,dv->btv", x, model.head(), preferred_element_type=jnp.float32)
    return logits, new


def sample(logits, key, *, greedy: bool, temperature=1.0, top_p=1.0, top_k: int = 0):
    """Next tokens of ``logits [B, V]`` and their log-probabilities under the model
    (``log_softmax`` of the raw logits): argmax when ``greedy``, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (0: all) and then to the
    smallest set whose probability reaches ``top_p`` (the most likely token always kept)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        z = logits.astype(jnp.float32) / temperature
        if top_k > 0:
            kth = jax.lax.top_k(z, top_k)[0][..., -1:]
            z = jnp.where(z < kth, -jnp.inf, z)
        desc = jnp.sort(z, axis=-1)[..., ::-1]
        p = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass of the more likely tokens
        n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
        cut = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        z = jnp.where(z < cut, -jnp.inf, z)
        tok = jax.random.categorical(key, z, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


class Decoder:
    """Prefill and step of ``cfg``'s model on split state, each jitted once per shape bucket."""

    def __init__(self, cfg: Config, dispatch=None):
        self.model = Model(cfg, dispatch)
        self.cfg = self.model.cfg
        self.prefill = jax.jit(self._prefill, static_argnames=("greedy", "top_k"))
        self.step = jax.jit(self._step, static_argnames=("greedy", "top_k"), donate_argnames=("cache",))
        # ``(params, buffers, tokens, pad, cache, start) -> (logits, cache)``: forward_cached itself
        self.logits = jax.jit(self._logits)

    def _prefill(self, params, buffers, tokens, pad, cache, key, temperature, top_p, *, greedy, top_k):
        logits, cache = forward_cached(self.model.merge(params, buffers), tokens, cache, 0, pad)
        tok, lp = sample(logits[:, -1], key, greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k)
        return tok, lp, cache

    def _step(self, params, buffers, token, start, pad, cache, key, temperature, top_p, *, greedy, top_k):
        logits, cache = forward_cached(self.model.merge(params, buffers), token[:, None], cache, start, pad)
        tok, lp = sample(logits[:, 0], key, greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k)
        return tok, lp, cache

    def _logits(self, params, buffers, tokens, pad, cache, start):
        return forward_cached(self.model.merge(params, buffers), tokens, cache, start, pad)

    def generate(self, params, buffers, prompts: list, max_new: int, *, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0):
        """``prompts`` (int token lists, lengths may differ) -> ``(tokens [B, N], logprobs [B, N])``
        as numpy: ``N = max_new`` new tokens per prompt (module doc; sampling as :func:`sample`,
        step ``i`` drawing with ``fold_in(key(seed), i)``)."""
        lens = np.array([len(p) for p in prompts])
        p_len = bucket(int(lens.max()))
        length = bucket(p_len + max_new)
        pad = p_len - lens
        tokens = np.zeros((len(prompts), p_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, pad[i]:] = p
        pad = jnp.asarray(pad, jnp.int32)
        cache = init_cache(self.cfg, len(prompts), length)
        key = jax.random.key(seed)
        kw = dict(greedy=greedy, top_k=int(top_k))
        args = (jnp.float32(temperature), jnp.float32(top_p))
        tok, lp, cache = self.prefill(params, buffers, jnp.asarray(tokens), pad, cache,
                                      jax.random.fold_in(key, 0), *args, **kw)
        toks, lps = [tok], [lp]
        for i in range(1, max_new):
            tok, lp, cache = self.step(params, buffers, tok, jnp.int32(p_len + i - 1), pad, cache,
                                       jax.random.fold_in(key, i), *args, **kw)
            toks.append(tok)
            lps.append(lp)
        return np.asarray(jnp.stack(toks, 1)), np.asarray(jnp.stack(lps, 1), np.float32)


__all__ = ["ATTENTION_STEP", "Decoder", "bucket", "forward_cached", "gqa_step", "init_cache", "mla_step",
           "sample"]
