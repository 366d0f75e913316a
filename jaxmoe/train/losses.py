"""Losses and the expert-bias update (docs/LAYOUT.md "Losses"). Everything is fp32.

Computed from the model's outputs -- the logits and the routing record ``aux`` that
:func:`jaxmoe.model.transformer.apply_model` returns -- never inside the model:

* ``cross_entropy``: summed over valid tokens / number of valid tokens (global count when the
  caller passes ``n_valid``), plus the output-logit z-loss ``logsumexp^2`` with the same reduction.
  ``chunked_cross_entropy``: ``ce + z_coef * z`` from the final hidden states and the LM head,
  ``chunk_tokens`` tokens at a time with the gradients computed in the same pass, so the
  ``[T, V]`` fp32 logits are never held whole (``compute.ce_chunk_tokens``).
* Router losses per MoE layer, summed over layers (:func:`router_losses`): Switch load balance,
  DeepSeek-V3 sequence-wise balance, router z-loss. With ``moe.lb_scope = "pooled"`` the load
  balance is instead transformers' Mixtral/Qwen3 form (:func:`pooled_load_balance_loss`): all MoE
  layers pooled before one product, attention padding excluded (:func:`padding_mask`).
* ``update_expert_bias``: aux-loss-free sign rule, mean-centred.
* ``mtp_cross_entropy``: the multi-token-prediction loss (DeepSeek-V3 sec. 2.2,
  :mod:`jaxmoe.model.mtp`): depth ``k``'s CE on the targets shifted left by ``k`` (token
  ``i + k + 1``; positions past the row or across a packed document masked), each summed over
  its valid tokens and divided by the *main* valid-token count, then averaged over the depths:
  ``total += train.mtp_loss_coef * mtp_ce`` (torchtitan 0.3's ``MTPLoss`` reduction).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.model.mtp import shifted


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


def _ce_chunk(xc, head, tc, mc, n, z_coef, with_grads):
    """One chunk of ``c`` tokens: its CE and z sums, and with ``with_grads`` the gradients of
    ``(ce + z_coef * z)`` (both divided by ``n``) w.r.t. the chunk's hidden rows and the head."""
    f32 = jnp.float32
    logits = jnp.dot(xc, head, preferred_element_type=f32)  # [c, V], as the LM head computes them
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
    sums = (jnp.sum((lse - tgt) * mc), jnp.sum(lse * lse * mc))
    if not with_grads:
        return sums, None
    # d/dlogits of sum(m (lse - tgt))/n + z_coef sum(m lse^2)/n = (1 + 2 z_coef lse) p m/n - onehot m/n
    coef = mc / n
    p = jnp.exp(logits - lse[:, None])
    is_tgt = jnp.arange(head.shape[1], dtype=tc.dtype)[None, :] == tc[:, None]
    dlogits = ((1.0 + 2.0 * z_coef * lse) * coef)[:, None] * p - jnp.where(is_tgt, coef[:, None], 0.0)
    dlogits = dlogits.astype(xc.dtype)
    dxc = jnp.dot(dlogits, head.T, preferred_element_type=f32).astype(xc.dtype)
    dhead = jnp.dot(xc.T, dlogits, preferred_element_type=f32)
    return sums, (dxc, dhead)


def _ce_scan(x, head, targets, mask, n, z_coef, with_grads):
    """Scan over the chunks of ``x [N, c, D]``: ``(ce, z)`` (divided by ``n``) and with
    ``with_grads`` the gradients ``dx [N, c, D]`` (x.dtype) and ``dhead`` (fp32, summed)."""
    zero = jnp.zeros((), jnp.float32)

    def body(carry, xs):
        (sums, dhead), (xc, tc, mc) = carry, xs
        (ce, z), grads = _ce_chunk(xc, head, tc, mc, n, z_coef, with_grads)
        sums = (sums[0] + ce, sums[1] + z)
        if not with_grads:
            return (sums, dhead), None
        return (sums, dhead + grads[1]), grads[0]

    dhead0 = jnp.zeros(head.shape, jnp.float32) if with_grads else zero
    ((ce, z), dhead), dx = jax.lax.scan(body, ((zero, zero), dhead0), (x, targets, mask))
    return (ce / n, z / n), dx, dhead


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_ce(x, head, targets, mask, n, z_coef):
    (ce, z), _, _ = _ce_scan(x, head, targets, mask, n, z_coef, False)
    return ce + z_coef * z, (ce, z)


def _fused_ce_fwd(x, head, targets, mask, n, z_coef):
    (ce, z), dx, dhead = _ce_scan(x, head, targets, mask, n, z_coef, True)
    return (ce + z_coef * z, (ce, z)), (dx, dhead, jnp.zeros((), head.dtype))  # last: head's dtype


def _fused_ce_bwd(z_coef, res, g):
    dx, dhead, head_like = res
    g_loss = g[0]  # the metrics (ce, z) carry no gradient
    return ((dx.astype(jnp.float32) * g_loss).astype(dx.dtype), (dhead * g_loss).astype(head_like.dtype),
            None, None, None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def chunked_cross_entropy(hidden, head, targets, mask, n_valid=None, chunk_tokens: int = 1024,
                          z_coef: float = 0.0):
    """``ce + z_coef * z`` of ``logits = hidden @ head`` without holding the ``[T, V]`` logits.

    ``hidden [B, S, D]`` (the final-normed hidden states, compute dtype), ``head [D, V]`` (the LM
    head in the compute dtype; the tied embedding transposed), ``targets``/``mask [B, S]``.
    Returns ``(loss, ce, z)``: ``ce`` and ``z`` as :func:`cross_entropy` reduces them (metrics,
    no gradient) and ``loss = ce + z_coef * z``, the one differentiable output.

    The ``T = B*S`` tokens are taken ``chunk_tokens`` at a time (the last chunk zero-padded and
    masked out). When differentiated, the forward pass computes each chunk's logits once and, with
    the loss's weights known (``z_coef``), its gradients right away: ``d hidden`` per chunk and
    ``d head`` summed in fp32; the backward only scales them by the incoming cotangent. So the
    head's matmuls are the whole-logits path's three (no recompute), and the logits held at any
    time are one chunk's, ``chunk_tokens x V`` fp32, instead of ``T x V`` (plus ``T x V`` of
    their gradient). Held from the forward to the backward: ``d hidden`` (the size of ``hidden``)
    and ``d head`` (fp32, the size of the head).
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
    loss, (ce, z) = _fused_ce(x.reshape(n_chunks, c, d), head, tg.reshape(n_chunks, c), m.reshape(n_chunks, c),
                              n, float(z_coef))
    return loss, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)


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


def pooled_load_balance_loss(probs, topk_idx, n_experts, weights=None):
    """transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE; checked in 5.25's source).

    ``probs [Lm, T, E]`` (normalised router probabilities), ``topk_idx [Lm, T, k]``, ``weights
    [T]`` (1 = a real token, 0 = attention padding; None = every token). Every layer's rows are
    pooled: ``f_e = sum_{l,t} w_t [e in topk_{l,t}] / (Lm sum_t w_t)`` (sums to k, no division by
    k), ``P_e = sum_{l,t} w_t p_{l,t,e} / (Lm sum_t w_t)``, loss ``E * sum_e f_e P_e`` (balanced
    value = k, whatever the number of layers). ``f`` carries no gradient (counts).
    """
    lm, t, k = topk_idx.shape
    w = jnp.ones((t,), jnp.float32) if weights is None else weights.reshape(t).astype(jnp.float32)
    wk = jnp.broadcast_to(w[None, :, None], (lm, t, k)).reshape(-1)
    counts = jnp.zeros((n_experts,), jnp.float32).at[topk_idx.reshape(-1)].add(wk)
    rows = jnp.maximum(lm * jnp.sum(w), 1e-20)  # HF divides by the masked row count as is
    p_sum = jnp.einsum("lte,t->e", probs.astype(jnp.float32), w)
    return n_experts * jnp.sum((counts / rows) * (p_sum / rows))


def padding_mask(batch: dict):
    """``[B, S]`` fp32, 1 = a real token, from the batch's ``attention_mask`` (HF: 1 = attend) or
    ``segment_ids`` (0 = padding); None when it has neither (then every position counts, as HF
    does without an attention mask). The targets ``mask`` never enters: HF's balance loss only
    excludes attention padding."""
    if batch.get("attention_mask") is not None:
        return (batch["attention_mask"] > 0).astype(jnp.float32)
    if batch.get("segment_ids") is not None:
        return (batch["segment_ids"] > 0).astype(jnp.float32)
    return None


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


def update_expert_bias(bias, counts, rate, rule: str = "sign_centred"):
    """``delta = rate * sign(mean(c) - c)``, ``delta -= mean(delta)``, ``bias + delta``.

    Works on ``[E]`` or stacked ``[Lm, E]`` (means over the expert axis). ``counts`` are the
    assignments per expert summed over the whole step. ``rule`` (``moe.bias_update_rule``):
    "sign_centred" as above (torchtitan's optimizer pre-hook computes the same numbers: it runs
    before the parameter update but the bias takes no gradient, so before/after is the same);
    "sign" leaves out the centring (the rule as arXiv 2408.15664 writes it).
    """
    if rule not in ("sign_centred", "sign"):
        raise ValueError(f"moe.bias_update_rule={rule!r} is not one of sign_centred, sign")
    c = counts.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
    if rule == "sign_centred":
        delta = delta - jnp.mean(delta, axis=-1, keepdims=True)
    return (bias + delta).astype(bias.dtype)


def router_losses(cfg, router: dict, batch: int, seq: int, pad_mask=None) -> dict:
    """Per-layer router losses summed over the stacked MoE layers (leading axis ``Lm``) of the
    routing record ``router`` (``logits``, ``scores``, ``topk_idx``); tokens ``T = batch*seq``.
    With ``moe.lb_scope == "pooled"`` ``lb`` is :func:`pooled_load_balance_loss` over all layers,
    excluding positions where ``pad_mask [B, S]`` (see :func:`padding_mask`) is 0."""
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
    lb = lb.sum()
    if cfg.moe.lb_scope == "pooled":
        probs = jax.vmap(normalise_scores)(router_scores)
        lb = pooled_load_balance_loss(probs, topk_idx, e, pad_mask)
    return {"lb": lb, "seq_aux": sa.sum(), "router_z": rz.sum()}


def mtp_targets(batch: dict, k: int):
    """``(targets, mask)`` of MTP depth ``k``: ``batch``'s shifted left by ``k``, the mask 0 where
    the shifted position is past the row (or, with ``segment_ids``, in another document)."""
    seg = batch.get("segment_ids")
    tgt, valid = shifted(batch["targets"], k, seg)
    m, _ = shifted(batch["mask"], k, seg)
    return tgt, jnp.where(valid, m, 0)


def mtp_cross_entropy(cfg, aux: dict, batch: dict, n_valid=None, head=None, chunk_tokens: int = 0):
    """``mtp_ce``: the mean over depths of each depth's CE sum / the main valid count (module doc),
    from ``aux["mtp_logits"] [N, B, S, V]`` or, with ``head``, ``aux["mtp_hidden"] [N, B, S, D]``
    (chunked with the head, as the main CE). None when the model has no MTP depths."""
    n_depths = cfg.model.mtp_layers
    if n_depths == 0:
        return None
    n = batch["mask"].astype(jnp.float32).sum() if n_valid is None else n_valid
    total = jnp.zeros((), jnp.float32)
    for k in range(1, n_depths + 1):
        tgt, mask = mtp_targets(batch, k)
        if head is None:
            total = total + cross_entropy(aux["mtp_logits"][k - 1], tgt, mask, n)[0]
        else:
            total = total + chunked_cross_entropy(aux["mtp_hidden"][k - 1], head, tgt, mask, n, chunk_tokens)[0]
    return total / n_depths


def weigh_terms(cfg, ce, z, rl: dict, mtp=None):
    """``total = ce + z_loss_coef*z + lb_coef*lb + seq_aux_coef*seq_aux + router_z_coef*router_z``
    (``+ mtp_loss_coef * mtp`` with MTP depths) and the metrics ``{"loss", "ce", "z_loss", "lb",
    "seq_aux", "router_z"}`` (unweighted terms; ``mtp_ce`` with MTP depths)."""
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
    if mtp is not None:
        total = total + cfg.train.mtp_loss_coef * mtp
        metrics.update(loss=total, mtp_ce=mtp)
    return total, metrics


def compute_loss(cfg, logits, aux, batch, n_valid=None):
    """Total loss and fp32 metrics from the model outputs (logits and routing record ``aux``):
    cross-entropy and z-loss over ``batch``'s valid tokens, router losses over every position
    (the pooled balance loss: every non-padding position), weighted by :func:`weigh_terms`."""
    ce, z = cross_entropy(logits, batch["targets"], batch["mask"], n_valid)
    b, s = batch["targets"].shape
    rl = router_losses(cfg, aux["router"], b, s, padding_mask(batch))
    return weigh_terms(cfg, ce, z, rl, mtp_cross_entropy(cfg, aux, batch, n_valid))
