"""Losses and the expert-bias update (docs/LAYOUT.md "Losses"). Everything is fp32.

Computed from the model's outputs -- the logits and the routing record ``aux`` that
:func:`jaxmoe.model.transformer.apply_model` returns -- never inside the model:

* ``cross_entropy``: summed over valid tokens / number of valid tokens (global count when the
  caller passes ``n_valid``), plus the output-logit z-loss ``logsumexp^2`` with the same reduction.
* Router losses per MoE layer, summed over layers (:func:`router_losses`): Switch load balance,
  DeepSeek-V3 sequence-wise balance, router z-loss. With ``moe.lb_scope = "pooled"`` the load
  balance is instead transformers' Mixtral/Qwen3 form (:func:`pooled_load_balance_loss`): all MoE
  layers pooled before one product, attention padding excluded (:func:`padding_mask`).
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


def update_expert_bias(bias, counts, rate):
    """``delta = rate * sign(mean(c) - c)``, ``delta -= mean(delta)``, ``bias + delta``.

    Works on ``[E]`` or stacked ``[Lm, E]`` (means over the expert axis). ``counts`` are the
    assignments per expert summed over the whole step.
    """
    c = counts.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
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
    cross-entropy and z-loss over ``batch``'s valid tokens, router losses over every position
    (the pooled balance loss: every non-padding position), weighted by :func:`weigh_terms`."""
    ce, z = cross_entropy(logits, batch["targets"], batch["mask"], n_valid)
    b, s = batch["targets"].shape
    rl = router_losses(cfg, aux["router"], b, s, padding_mask(batch))
    return weigh_terms(cfg, ce, z, rl)
