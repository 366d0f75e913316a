"""Training step of the PyTorch reference: optimizers, LR schedule, clipping, accumulation,
expert-bias update.

``make_optimizer(model, cfg)`` -> :class:`Optimizer` (AdamW alone, or Muon + AdamW),
``make_scheduler(opt, cfg)`` -> :class:`Scheduler`, ``train_step(model, opt, sched, batch, cfg)``
-> metrics dict. Read top to bottom: one step is

1. split the batch into ``cfg.train.micro_batches`` micro-batches (rows in order);
2. per micro-batch: forward, loss = ``ce + z_loss_coef*z_loss`` normalised by the *global* number
   of valid tokens plus the router losses divided by the number of micro-batches, backward
   (gradients add up, so the step's gradient is the full batch's for CE/z-loss);
3. global-norm clipping to ``cfg.optim.grad_clip`` (0 disables);
4. set this step's learning rates, optimizer step, zero grads, advance the schedule;
5. expert-bias update on the token counts summed over all micro-batches.
"""

from __future__ import annotations

import math

import torch

from jaxmoe.config import Config, ConfigError
from torch_ref.losses import loss_terms, update_expert_bias, valid_mask, weighted_total
from torch_ref.muon import Muon as RefMuon
from torch_ref.transformer import TorchTransformer

# --------------------------------------------------------------------------------------------
# Learning-rate schedule
# --------------------------------------------------------------------------------------------


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of the base learning rate at the 0-based update index ``step``.

    With ``W = warmup_steps``, ``N = steps``, ``r = min_lr_ratio``::

        step < W:   (step + 1) / W                                   (linear warmup from ~0)
        otherwise:  p = clip((step - s0) / max(1, N - 1 - s0), 0, 1)
          cosine:   r + (1 - r) * 0.5 * (1 + cos(pi * p))            s0 = W
          linear:   1 + (r - 1) * p                                  s0 = W
          wsd:      1 + (r - 1) * p       s0 = max(W, N - 1 - floor(wsd_decay_frac * N))
                    (stable at 1, then linear decay over the last floor(wsd_decay_frac * N) steps)
          constant: 1

    Every decaying schedule reaches ``r`` exactly at ``step = N - 1``. (Same formula as
    ``jaxmoe.train.optim.lr_schedule``.)
    """
    t = cfg.optim
    w, n, r = t.warmup_steps, cfg.train.steps, t.min_lr_ratio
    if t.schedule == "titan_wsd":
        return _titan_wsd_factor(t, n, step)
    if step < w:
        return (step + 1) / w
    s0 = max(w, n - 1 - math.floor(t.wsd_decay_frac * n)) if t.schedule == "wsd" else w
    p = min(max((step - s0) / max(1, n - 1 - s0), 0.0), 1.0)
    if t.schedule == "cosine":
        return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
    if t.schedule in ("linear", "wsd"):
        return 1 + (r - 1) * p
    if t.schedule == "constant":
        return 1.0
    raise ConfigError(f"optim.schedule={t.schedule!r} is not one of cosine, linear, wsd, constant")


def _titan_wsd_factor(t, n: int, step: int) -> float:
    """torchtitan 0.3.0's warmup-stable-decay factor (``LRSchedulersContainer``), written from its
    rule: warmup ``W = min(warmup_steps, N)``; decay ``D = round(N * titan_decay_ratio)`` cut to
    ``N - W``; stable ``S = N + 1 - W - D``; ``(s+1)/W`` in warmup, 1 while stable, then
    ``r + (1 - r) * f((s + 1 - W - S) / D)`` with ``f`` linear / sqrt / cosine (progress held at 1
    past ``N``)."""
    w = min(t.warmup_steps, n)
    d = round(n * t.titan_decay_ratio)
    d = n - w if w + d > n else d
    stable = n + 1 - w - d
    if step < w:
        return (step + 1) / w
    if step < w + stable:
        return 1.0
    p = min(1.0, (step + 1 - w - stable) / max(d, 1))
    f = {"linear": lambda: 1 - p, "sqrt": lambda: 1 - math.sqrt(p),
         "cosine": lambda: 0.5 * (1 + math.cos(math.pi * p))}[t.titan_decay_type]()
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * f


# --------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------


def param_kind(name: str, p: torch.Tensor) -> str:
    """``embedding`` | ``lm_head`` | ``vector`` (norms, biases) | ``matrix`` (everything else 2-D:
    attention, dense and expert weights, routers)."""
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    return "matrix" if p.ndim == 2 else "vector"


class Optimizer:
    """One or two torch optimizers stepped together. Each param group remembers its base
    learning rate in ``group["base_lr"]``; :class:`Scheduler` scales it."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)


def make_optimizer(model: TorchTransformer, cfg: Config) -> Optimizer:
    """AdamW (``cfg.optim.optimizer == "adamw"``) on everything, with weight decay on matrices and
    the lm_head, on norms/vectors only if ``decay_norms``, on embeddings only if
    ``decay_embeddings``. Or Muon (``torch.optim.Muon``) on every 2-D hidden matrix (attention,
    dense MLP, each expert, routers) with AdamW as above on embeddings, lm_head and vectors."""
    t = cfg.optim
    decay, no_decay, muon = [], [], []
    for name, p in model.named_parameters():
        kind = param_kind(name, p)
        if kind == "matrix" and t.optimizer == "muon":
            muon.append(p)
        elif kind in ("matrix", "lm_head"):
            decay.append(p)
        elif kind == "embedding":
            (decay if t.decay_embeddings else no_decay).append(p)
        else:
            (decay if t.decay_norms else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    for g in adamw.param_groups:
        g["base_lr"] = t.lr
    optimizers = [adamw]
    if muon:
        # bfloat16 NS: the stock torch.optim.Muon; float32 NS: torch_ref.muon.Muon, the same
        # algorithm with Newton-Schulz in fp32 (torch.optim.Muon's is bf16 unconditionally)
        if t.muon_ns_dtype == "bfloat16":
            cls, extra = torch.optim.Muon, {}
        else:
            cls, extra = RefMuon, {"ns_dtype": getattr(torch, t.muon_ns_dtype)}
        opt = cls(
            muon,
            lr=t.muon_lr,
            weight_decay=t.muon_weight_decay,
            momentum=t.muon_momentum,
            nesterov=t.muon_nesterov,
            ns_coefficients=tuple(t.muon_ns_coefficients),
            eps=t.muon_eps,
            ns_steps=t.muon_ns_steps,
            adjust_lr_fn=None if t.muon_adjust_lr == "none" else t.muon_adjust_lr,
            **extra,
        )
        for g in opt.param_groups:
            g["base_lr"] = t.muon_lr
            if t.muon_adjust_lr == "none":
                # torch.optim.Muon's constructor accepts only None/"original"/"match_rms_adamw"
                # (None meaning "original"); its lr adjustment returns the plain lr for any other
                # value, so "none" is set on the group after construction.
                g["adjust_lr_fn"] = "none"
        optimizers.append(opt)
    return Optimizer(optimizers)


class Scheduler:
    """Sets ``lr = base_lr * lr_factor(cfg, step)`` on every group; ``step`` counts updates."""

    def __init__(self, opt: Optimizer, cfg: Config):
        self.opt, self.cfg, self.step_count = opt, cfg, 0

    def apply(self) -> float:
        f = lr_factor(self.cfg, self.step_count)
        for g in self.opt.param_groups:
            g["lr"] = g["base_lr"] * f
        return f

    def step(self) -> None:
        self.step_count += 1


def make_scheduler(opt: Optimizer, cfg: Config) -> Scheduler:
    return Scheduler(opt, cfg)


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------


def split_micro_batches(batch: dict, n: int) -> list[dict]:
    """Micro-batch i takes rows ``i*B/n ... (i+1)*B/n - 1``."""
    size = batch["inputs"].shape[0] // n
    return [{k: (v[i * size : (i + 1) * size] if v is not None else None) for k, v in batch.items()} for i in range(n)]


def accumulate_gradients(model: TorchTransformer, batch: dict, cfg: Config) -> tuple[dict, torch.Tensor | None]:
    """Backward over the micro-batches; returns (metrics as floats, counts summed [Lm, E])."""
    n_micro = cfg.train.micro_batches
    n_valid = valid_mask(batch).sum().clamp(min=1)
    sums: dict[str, float] = {}
    counts = None
    for mb in split_micro_batches(batch, n_micro):
        logits, aux = model(mb["inputs"], segment_ids=mb.get("segment_ids"), positions=mb.get("positions"))
        terms = loss_terms(cfg, logits, aux, mb, n_valid=n_valid)
        objective = weighted_total(cfg, terms, aux_scale=1.0 / n_micro)
        objective.backward()
        for k, v in terms.items():  # ce / z_loss are global sums already; the rest are means
            scale = 1.0 if k in ("ce", "z_loss", "mtp_ce") else 1.0 / n_micro
            sums[k] = sums.get(k, 0.0) + float(v.detach()) * scale
        sums["loss"] = sums.get("loss", 0.0) + float(objective.detach())
        c = aux["counts"]
        counts = c if counts is None else counts + c
    return sums, counts


def train_step(model: TorchTransformer, opt: Optimizer, sched: Scheduler, batch: dict, cfg: Config) -> dict:
    """One optimizer update on ``batch`` ({inputs, targets, mask}); returns float metrics
    ``loss, ce, z_loss, lb, seq_aux, router_z, grad_norm, lr_factor``."""
    model.train()
    opt.zero_grad()
    metrics, counts = accumulate_gradients(model, batch, cfg)
    # An expert that received no token this step has no autograd gradient (p.grad is None), and
    # torch optimizers skip such parameters entirely (no momentum decay, no weight decay). The
    # contract is the stacked-expert one (jaxmoe, torchtitan's grouped experts): every trained
    # parameter gets a gradient, exactly zero for an unused expert, and the optimizer still steps it.
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    params = [p for p in model.parameters() if p.grad is not None]
    # clip_grad_norm_ scales by min(1, max_norm / (norm + 1e-6)); inf max_norm = measure only
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    metrics["grad_norm"] = float(norm)
    metrics["lr_factor"] = sched.apply()
    opt.step()
    opt.zero_grad()
    sched.step()
    if cfg.moe.use_expert_bias and counts is not None:
        with torch.no_grad():
            for bias, c in zip(model.expert_biases(), counts):
                bias.copy_(update_expert_bias(bias, c, cfg.moe.bias_update_rate, cfg.moe.bias_update_rule))
    return metrics


__all__ = [
    "Optimizer",
    "Scheduler",
    "lr_factor",
    "make_optimizer",
    "make_scheduler",
    "param_kind",
    "train_step",
]
