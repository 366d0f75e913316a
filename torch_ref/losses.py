"""Losses of the PyTorch reference (docs/LAYOUT.md "Losses"), all in fp32.

* ``ce``: cross-entropy summed over valid tokens / the global number of valid tokens ``n_valid``.
* ``z_loss``: sum over valid tokens of ``logsumexp(logits)^2`` / ``n_valid``.
* per MoE layer, summed over layers, over every token position (padding included):
  ``lb = E * sum_e f_e * P_e`` (Switch, f = fraction of the T*k assignments to e, P = mean
  normalised router probability), ``seq_aux`` (DeepSeek-V3 sequence-wise balance) and
  ``router_z = mean_t logsumexp(router_logits)^2``.
* ``moe.lb_scope = "pooled"``: ``lb`` is instead transformers' Mixtral/Qwen3
  ``load_balancing_loss_func``: every MoE layer's top-k counts and probabilities pooled over
  (layer, token) rows before one product (balanced value = k), rows of attention padding
  (``attention_mask == 0`` / ``segment_ids == 0``) left out; without either every row counts.
* ``mtp_ce`` (``model.mtp_layers > 0``; DeepSeek-V3 multi-token prediction): depth ``k``'s logits
  against the targets shifted left by ``k`` (positions past the row or across a packed document
  invalid), each CE summed over its valid tokens / the main ``n_valid``, averaged over depths.
* ``total = ce + z_loss_coef*z_loss + lb_coef*lb + seq_aux_coef*seq_aux + router_z_coef*router_z``
  (``+ mtp_loss_coef*mtp_ce`` with MTP depths).

A batch is ``{"inputs": [B, S] int, "targets": [B, S] int, "mask": [B, S] (optional; 1 = valid)}``;
targets < 0 are also invalid (ignore index).

Expert-bias update (aux-loss-free balancing), after the optimizer step on the step's counts:
``delta = rate * sign(mean(c) - c); delta -= mean(delta); bias += delta``.
"""

from __future__ import annotations

import torch

from jaxmoe.config import Config
from jaxmoe.config.schema import MoEConfig
from torch_ref.layers import shift_left


def normalised_scores(scores: torch.Tensor, e: MoEConfig) -> torch.Tensor:
    """Router scores as a distribution over experts: softmax probs as they are, sigmoid scores
    divided by their sum over experts."""
    if e.score_func == "softmax":
        return scores
    return scores / scores.sum(-1, keepdim=True)


def load_balance_loss(scores: torch.Tensor, counts: torch.Tensor, e: MoEConfig) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` for one layer; ``scores [T, E]``, ``counts [E]``."""
    t = scores.shape[0]
    f = counts.float() / (t * e.top_k)
    p = normalised_scores(scores, e).mean(0)
    return e.n_experts * (f * p).sum()


def pooled_load_balance_loss(scores: torch.Tensor, idx: torch.Tensor, e: MoEConfig,
                             pad: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled balance loss over all MoE layers: ``scores [Lm, T, E]``, ``idx [Lm, T, k]``,
    ``pad [T]`` (1 = real token) or None. ``E * sum_e f_e * P_e`` with ``f_e`` = (weighted)
    assignments to ``e`` over all rows / number of rows and ``P_e`` = mean probability."""
    lm, t, n = scores.shape
    w = torch.ones(t) if pad is None else pad.reshape(t).float()
    rows = (lm * w.sum()).clamp(min=1e-20)
    onehot = torch.nn.functional.one_hot(idx.long(), n).float()  # [Lm, T, k, E]
    f = torch.einsum("ltke,t->e", onehot, w) / rows
    p = torch.einsum("lte,t->e", normalised_scores(scores.float(), e), w) / rows
    return n * (f * p).sum()


def padding_mask(batch: dict) -> torch.Tensor | None:
    """``[B, S]`` float, 1 = a real token: the batch's ``attention_mask`` or ``segment_ids > 0``;
    None without either (the targets ``mask`` is not attention padding)."""
    if batch.get("attention_mask") is not None:
        return (batch["attention_mask"] > 0).float()
    if batch.get("segment_ids") is not None:
        return (batch["segment_ids"] > 0).float()
    return None


def seq_aux_loss(scores: torch.Tensor, idx: torch.Tensor, e: MoEConfig, batch: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss for one layer, averaged over the ``batch`` sequences:
    per sequence ``sum_e (E / (k*S) * count_e) * mean_t(s'_{t,e})``."""
    t, n = scores.shape
    s = t // batch
    sn = normalised_scores(scores, e).view(batch, s, n)
    onehot = torch.nn.functional.one_hot(idx.reshape(batch, s * e.top_k), n).float()
    counts = onehot.sum(1)  # [B, E]
    f = counts * n / (e.top_k * s)
    return (f * sn.mean(1)).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def valid_mask(batch: dict) -> torch.Tensor:
    """bool ``[B, S]``: ``mask`` (if present) and ``targets >= 0``."""
    valid = batch["targets"] >= 0
    if batch.get("mask") is not None:
        valid = valid & (batch["mask"] > 0)
    return valid


def loss_terms(cfg: Config, logits: torch.Tensor, aux: dict, batch: dict, n_valid=None) -> dict:
    """The unweighted loss terms as fp32 tensors (differentiable)."""
    valid = valid_mask(batch)
    if n_valid is None:
        n_valid = valid.sum()
    n_valid = torch.clamp(torch.as_tensor(n_valid, dtype=torch.float32), min=1.0)
    logits = logits.float()
    targets = batch["targets"].long().clamp(min=0)
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(-1, targets[..., None])[..., 0]
    vf = valid.float()
    terms = {
        "ce": (nll * vf).sum() / n_valid,
        "z_loss": (lse.pow(2) * vf).sum() / n_valid,
    }
    if "mtp_logits" in aux:
        terms["mtp_ce"] = mtp_ce(aux["mtp_logits"], targets, valid, n_valid, batch.get("segment_ids"))
    for k in ("lb", "seq_aux", "router_z"):
        terms[k] = aux["losses"][k].float()
    r = aux["router"]
    if cfg.moe.lb_scope == "pooled" and r["scores"].shape[0] > 0:
        terms["lb"] = pooled_load_balance_loss(r["scores"], r["topk_idx"], cfg.moe, padding_mask(batch))
    return terms


def mtp_ce(mtp_logits, targets, valid, n_valid, segment_ids=None) -> torch.Tensor:
    """The MTP term (module doc) from ``mtp_logits [N, B, S, V]``."""
    total = torch.zeros((), dtype=torch.float32)
    for k, lg in enumerate(mtp_logits, 1):
        tgt, ok = shift_left(targets, k, segment_ids)
        v, _ = shift_left(valid, k, segment_ids)
        lg = lg.float()
        nll = torch.logsumexp(lg, dim=-1) - lg.gather(-1, tgt[..., None])[..., 0]
        total = total + (nll * (v & ok).float()).sum() / n_valid
    return total / len(mtp_logits)


def weighted_total(cfg: Config, terms: dict, aux_scale: float = 1.0) -> torch.Tensor:
    """``ce + z_loss_coef*z_loss + aux_scale * (lb, seq_aux, router_z weighted by their coefs)``.
    ``aux_scale = 1/micro_batches`` averages the per-micro-batch router losses over a step."""
    e = cfg.moe
    token_part = terms["ce"] + cfg.train.z_loss_coef * terms["z_loss"]
    if "mtp_ce" in terms:
        token_part = token_part + cfg.train.mtp_loss_coef * terms["mtp_ce"]
    router_part = e.lb_coef * terms["lb"] + e.seq_aux_coef * terms["seq_aux"] + e.router_z_coef * terms["router_z"]
    return token_part + aux_scale * router_part


def compute_loss(cfg: Config, logits: torch.Tensor, aux: dict, batch: dict, n_valid=None):
    """``(total, metrics)``: total is a differentiable fp32 scalar; metrics holds floats for
    ``loss, ce, z_loss, lb, seq_aux, router_z``. ``n_valid`` is the global valid-token count
    (defaults to this batch's)."""
    terms = loss_terms(cfg, logits, aux, batch, n_valid)
    total = weighted_total(cfg, terms)
    metrics = {k: float(v.detach()) for k, v in terms.items()}
    metrics["loss"] = float(total.detach())
    return total, metrics


def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float,
                       rule: str = "sign_centred") -> torch.Tensor:
    """Sign-rule update over the last (expert) axis: under-loaded experts (count below the mean)
    go up by ``rate``, over-loaded down, then (``rule="sign_centred"``, the default) the update is
    mean-centred; ``rule="sign"`` skips the centring. Returns the new bias."""
    c = counts.float()
    delta = rate * torch.sign(c.mean(-1, keepdim=True) - c)
    if rule == "sign_centred":
        delta = delta - delta.mean(-1, keepdim=True)
    elif rule != "sign":
        raise ValueError(f"moe.bias_update_rule={rule!r} is not one of sign_centred, sign")
    return bias + delta.to(bias.dtype)
