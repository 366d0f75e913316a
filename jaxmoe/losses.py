"""Losses and the expert-bias update (docs/LAYOUT.md "Losses"). Everything is fp32.

Computed from the model's outputs -- the logits and the routing record ``aux`` that
:func:`jaxmoe.model.transformer.apply_model` returns -- never inside the model:

* ``cross_entropy``: summed over valid tokens / number of valid tokens (global count when the
  caller passes ``n_valid``), plus the output-logit z-loss ``logsumexp^2`` with the same reduction.
  ``chunked_cross_entropy``: the same two terms from the final hidden states and the LM head,
  ``chunk_tokens`` tokens at a time (forward and backward), so the ``[T, V]`` fp32 logits are
  never held whole (``train.ce_chunk_tokens``).
* Router losses per MoE layer, summed over layers (:func:`router_losses`): Switch load balance,
  DeepSeek-V3 sequence-wise balance, router z-loss.
* ``update_expert_bias``: aux-loss-free sign rule, mean-centred.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, mask, n_valid=None):
    """Returns ``(ce, z)``: ``sum(mask * -log p[target]) / n`` and ``sum(mask * lse^2) / n``.

    ``logits [B, S, V]``, ``targets [B, S]`` int, ``mask [B, S]`` (1 = valid); ``n`` = ``n_valid``
    (e.g. the global count across micro-batches/devices) or ``mask.sum()``.
    """
    logits = logits.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    n = mask.sum() if n_valid is None else jnp.asarray(n_valid, jnp.float32)
    n = jnp.maximum(n, 1.0)
    ce = jnp.sum((lse - tgt) * mask) / n
    z = jnp.sum(lse * lse * mask) / n
    return ce, z


def _ce_chunk_fwd(xc, head, tc):
    """One chunk: ``logits [c, V]`` fp32 (as the LM head computes them), their logsumexp and the
    target logits."""
    logits = jnp.dot(xc, head, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
    return logits, lse, tgt


@jax.custom_vjp
def _chunked_ce(x, head, targets, mask, n):
    return _chunked_ce_fwd(x, head, targets, mask, n)[0]


def _chunked_ce_fwd(x, head, targets, mask, n):
    """``x [N, c, D]``, ``targets``/``mask [N, c]``: a scan over the N chunks; keeps only the
    per-token logsumexp ``[N, c]`` for the backward."""

    def body(carry, xs):
        xc, tc, mc = xs
        _, lse, tgt = _ce_chunk_fwd(xc, head, tc)
        ce, z = carry
        return (ce + jnp.sum((lse - tgt) * mc), z + jnp.sum(lse * lse * mc)), lse

    zero = jnp.zeros((), jnp.float32)
    (ce, z), lse = jax.lax.scan(body, (zero, zero), (x, targets, mask))
    return (ce / n, z / n), (x, head, targets, mask, n, lse)


def _chunked_ce_bwd(res, g):
    """Per chunk, recompute the logits: ``d/dlogits = (g_ce + 2 g_z lse) * p * m/n - g_ce *
    onehot(target) * m/n``; ``dx`` per chunk, ``dhead`` accumulated in fp32."""
    x, head, targets, mask, n, lse_all = res
    g_ce, g_z = g
    dt = x.dtype
    f32 = jnp.float32
    vocab = head.shape[1]

    def body(dhead, xs):
        xc, tc, mc, lse = xs
        logits = jnp.dot(xc, head, preferred_element_type=f32)
        p = jnp.exp(logits - lse[:, None])
        coef = mc / n
        is_tgt = jnp.arange(vocab, dtype=tc.dtype)[None, :] == tc[:, None]
        dlogits = ((g_ce + 2.0 * g_z * lse) * coef)[:, None] * p - jnp.where(is_tgt, (g_ce * coef)[:, None], 0.0)
        dlogits = dlogits.astype(dt)
        dxc = jnp.dot(dlogits, head.T, preferred_element_type=f32).astype(dt)
        dhead = dhead + jnp.dot(xc.T, dlogits, preferred_element_type=f32)
        return dhead, dxc

    dhead, dx = jax.lax.scan(body, jnp.zeros(head.shape, f32), (x, targets, mask, lse_all))
    return dx, dhead.astype(head.dtype), None, None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def chunked_cross_entropy(hidden, head, targets, mask, n_valid=None, chunk_tokens: int = 1024):
    """:func:`cross_entropy` of ``logits = hidden @ head`` without holding the ``[T, V]`` logits.

    ``hidden [B, S, D]`` (the final-normed hidden states, compute dtype), ``head [D, V]`` (the LM
    head in the compute dtype; the tied embedding transposed), ``targets``/``mask [B, S]``. The
    ``T = B*S`` tokens are taken ``chunk_tokens`` at a time (the last chunk zero-padded, masked
    out): the forward keeps only each token's logsumexp, the backward (a custom VJP) recomputes
    each chunk's logits and returns ``d hidden`` per chunk and ``d head`` summed over chunks in
    fp32. Peak logits memory ``chunk_tokens x V`` fp32 instead of ``T x V``. Returns ``(ce, z)``
    with :func:`cross_entropy`'s reduction.
    """
    b, s, d = hidden.shape
    t = b * s
    c = max(1, min(int(chunk_tokens), t))
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    x = hidden.reshape(t, d)
    tg = targets.reshape(t).astype(jnp.int32)
    m = mask.reshape(t).astype(jnp.float32)
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        tg = jnp.pad(tg, (0, pad))
        m = jnp.pad(m, (0, pad))
    n = mask.astype(jnp.float32).sum() if n_valid is None else jnp.asarray(n_valid, jnp.float32)
    n = jax.lax.stop_gradient(jnp.maximum(n, 1.0))
    return _chunked_ce(x.reshape(n_chunks, c, d), head, tg.reshape(n_chunks, c), m.reshape(n_chunks, c), n)


def normalise_scores(scores):
    """Scores divided by their sum over experts (softmax probs are already normalised)."""
    scores = scores.astype(jnp.float32)
    return scores / jnp.sum(scores, axis=-1, keepdims=True)


def load_balance_loss(probs, topk_idx, n_experts):
    """Switch/GShard balance ``E * sum_e f_e * P_e`` over all T tokens of one layer.

    ``f_e`` = fraction of the T*k assignments routed to ``e`` (no gradient), ``P_e`` = mean over
    tokens of the normalised probability ``probs [T, E]``.
    """
    t, k = topk_idx.shape
    counts = jnp.zeros((n_experts,), jnp.float32).at[topk_idx.reshape(-1)].add(1.0)
    f = counts / (t * k)
    p_mean = jnp.mean(probs.astype(jnp.float32), axis=0)
    return n_experts * jnp.sum(f * p_mean)


def seq_aux_loss(scores_normalised, topk_idx, batch, seq, n_experts, top_k):
    """DeepSeek-V3 sequence-wise balance: per sequence ``sum_e (E/(k*S) * count_e) * mean_t s'_e``,
    averaged over the ``batch`` sequences. Tokens are ``T = batch * seq`` row-major."""
    s = scores_normalised.astype(jnp.float32).reshape(batch, seq, n_experts)
    idx = topk_idx.reshape(batch, seq * top_k)
    counts = jax.vmap(lambda i: jnp.zeros((n_experts,), jnp.float32).at[i].add(1.0))(idx)
    f = counts * (n_experts / (top_k * seq))
    return jnp.mean(jnp.sum(f * jnp.mean(s, axis=1), axis=-1))


def router_z_loss(logits):
    """``mean_t logsumexp(router_logits_t)^2`` for one layer's ``logits [T, E]``."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(lse * lse)


def update_expert_bias(bias, counts, rate):
    """``delta = rate * sign(mean(c) - c)``, ``delta -= mean(delta)``, ``bias + delta``.

    Works on ``[E]`` or stacked ``[Lm, E]`` (means over the expert axis). ``counts`` are the
    assignments per expert summed over the whole step.
    """
    c = counts.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
    delta = delta - jnp.mean(delta, axis=-1, keepdims=True)
    return (bias + delta).astype(bias.dtype)


def router_losses(cfg, router: dict, batch: int, seq: int) -> dict:
    """Per-layer router losses summed over the stacked MoE layers (leading axis ``Lm``) of the
    routing record ``router`` (``logits``, ``scores``, ``topk_idx``); tokens ``T = batch*seq``."""
    e, k = cfg.moe.n_experts, cfg.moe.top_k
    router_logits, router_scores, topk_idx = router["logits"], router["scores"], router["topk_idx"]
    if router_logits.shape[0] == 0:
        zero = jnp.zeros((), jnp.float32)
        return {"lb": zero, "seq_aux": zero, "router_z": zero}

    def one(lg, sc, idx):
        sn = normalise_scores(sc)
        return (
            load_balance_loss(sn, idx, e),
            seq_aux_loss(sn, idx, batch, seq, e, k),
            router_z_loss(lg),
        )

    lb, sa, rz = jax.vmap(one)(router_logits, router_scores, topk_idx)
    return {"lb": lb.sum(), "seq_aux": sa.sum(), "router_z": rz.sum()}


def weigh_terms(cfg, ce, z, rl: dict):
    """``total = ce + z_loss_coef*z + lb_coef*lb + seq_aux_coef*seq_aux + router_z_coef*router_z``
    and the metrics ``{"loss", "ce", "z_loss", "lb", "seq_aux", "router_z"}`` (unweighted terms)."""
    m = cfg.moe
    total = (
        ce
        + cfg.train.z_loss_coef * z
        + m.lb_coef * rl["lb"]
        + m.seq_aux_coef * rl["seq_aux"]
        + m.router_z_coef * rl["router_z"]
    )
    metrics = {"loss": total, "ce": ce, "z_loss": z, "lb": rl["lb"], "seq_aux": rl["seq_aux"],
               "router_z": rl["router_z"]}
    return total, metrics


def compute_loss(cfg, logits, aux, batch, n_valid=None):
    """Total loss and fp32 metrics from the model outputs (logits and routing record ``aux``):
    cross-entropy and z-loss over ``batch``'s valid tokens, router losses over every position,
    weighted by :func:`weigh_terms`."""
    ce, z = cross_entropy(logits, batch["targets"], batch["mask"], n_valid)
    b, s = batch["targets"].shape
    return weigh_terms(cfg, ce, z, router_losses(cfg, aux["router"], b, s))
