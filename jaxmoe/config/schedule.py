"""The learning rate each ``optim.schedule`` gives, as a function of the 0-based update index:
one definition, evaluated with numpy (the ``dcp:`` sink's next lr) or with ``jax.numpy`` inside
the train step (:func:`jaxmoe.train.optim.lr_schedule`). Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from jaxmoe.config.schema import OptimConfig


def lr_schedule(ocfg: OptimConfig, steps: int, base_lr: float, xp=np) -> Callable[[Any], Any]:
    """The learning rate as a function of the 0-based update index ``step``.

    With ``W = ocfg.warmup_steps``, ``N = steps`` (``train.steps``), ``lo = base_lr * ocfg.min_lr_ratio``::

        step < W:            lr = base_lr * (step + 1) / W                (linear warmup)
        otherwise:           p  = clip((step - s0) / max(1, N - 1 - s0), 0, 1)
          cosine:            lr = lo + (base_lr - lo) * 0.5 * (1 + cos(pi * p))      s0 = W
          linear:            lr = base_lr + (lo - base_lr) * p                       s0 = W
          wsd:               lr = base_lr + (lo - base_lr) * p,
                             s0 = max(W, N - 1 - floor(wsd_decay_frac * N))
                             (stable at base_lr, then a linear decay over the last
                              floor(wsd_decay_frac * N) steps)
          constant:          lr = base_lr

    So every decaying schedule reaches ``lo`` exactly at ``step = N - 1`` (and stays there after).

    ``titan_wsd`` is torchtitan 0.3.0's ``LRSchedulersContainer`` rule (see :func:`titan_wsd_factor`),
    a different schedule from ``wsd`` (kept both: jaxmoe's ``wsd`` ends at ``lo`` on the last step,
    torchtitan's one virtual step later; its decay length rounds, jaxmoe's floors).
    ``step`` may be a Python int or an integer array of ``xp`` (numpy, or ``jax.numpy`` for a traced
    step: :func:`jaxmoe.train.optim.lr_schedule`); the result is a float32 array of ``xp``.
    """
    if ocfg.schedule == "titan_wsd":
        return _titan_wsd(ocfg, steps, base_lr, xp)
    warmup = int(ocfg.warmup_steps)
    n = int(steps)
    base = float(base_lr)
    lo = base * float(ocfg.min_lr_ratio)
    kind = ocfg.schedule
    if kind == "wsd":
        s0 = max(warmup, n - 1 - int(math.floor(ocfg.wsd_decay_frac * n)))
    else:
        s0 = warmup
    span = max(1, n - 1 - s0)

    def schedule(step):
        step = xp.asarray(step, xp.float32)
        p = xp.clip((step - s0) / span, 0.0, 1.0)
        if kind == "cosine":
            after = lo + (base - lo) * 0.5 * (1.0 + xp.cos(xp.pi * p))
        elif kind in ("linear", "wsd"):
            after = base + (lo - base) * p
        elif kind == "constant":
            after = xp.full_like(p, base)
        else:
            raise ValueError(f"optim.schedule={kind!r} is not one of cosine, linear, wsd, constant")
        if warmup > 0:
            return xp.where(step < warmup, base * (step + 1.0) / warmup, after)
        return after

    return schedule


def titan_wsd_plan(ocfg: OptimConfig, steps: int) -> tuple[int, int, int]:
    """``(warmup, stable, decay)`` step counts of torchtitan's warmup-stable-decay for
    ``N = steps`` (its ``training_steps``): warmup ``min(warmup_steps, N)``; decay
    ``round(N * titan_decay_ratio)`` (Python's round), cut to ``N - warmup``; stable
    ``N + 1 - warmup - decay`` (torchtitan's "virtual last step", so the lr never reaches 0)."""
    n = int(steps)
    warmup = min(int(ocfg.warmup_steps), n)
    decay = round(n * float(ocfg.titan_decay_ratio))
    if warmup + decay > n:
        decay = n - warmup
    return warmup, n + 1 - warmup - decay, decay


def _titan_wsd(ocfg: OptimConfig, steps: int, base_lr: float, xp) -> Callable[[Any], Any]:
    """torchtitan 0.3.0 ``LRSchedulersContainer`` (``linear_warmup_stable_decay``), as an ``xp``
    function of the 0-based update index ``s`` (``LambdaLR``'s ``last_epoch`` when its optimizer
    makes update ``s``); with ``(W, S, D) = titan_wsd_plan(ocfg, steps)`` and ``r = min_lr_ratio``
    (torchtitan's ``min_lr_factor``)::

        s < W:          factor = (s + 1) / W
        s < W + S:      factor = 1
        otherwise:      p = (s + 1 - W - S) / D,  factor = r + (1 - r) * f(p)
                        f = 1 - p (linear) | 1 - sqrt(p) (sqrt) | (1 + cos(pi p)) / 2 (cosine)

    lr = base_lr * factor. Past ``N`` steps (torchtitan never gets there) ``p`` is held at 1."""
    warmup, stable, decay = titan_wsd_plan(ocfg, steps)
    r = float(ocfg.min_lr_ratio)
    kind = ocfg.titan_decay_type
    if kind not in ("linear", "sqrt", "cosine"):
        raise ValueError(f"optim.titan_decay_type={kind!r} is not one of linear, sqrt, cosine")
    base = float(base_lr)

    def schedule(step):
        s = xp.asarray(step, xp.float32)
        p = xp.clip((s + 1.0 - warmup - stable) / max(decay, 1), 0.0, 1.0)
        if kind == "linear":
            adj = 1.0 - p
        elif kind == "sqrt":
            adj = 1.0 - xp.sqrt(p)
        else:
            adj = 0.5 * (1.0 + xp.cos(xp.pi * p))
        factor = xp.where(s < warmup + stable, 1.0, r + (1.0 - r) * adj)
        if warmup > 0:
            factor = xp.where(s < warmup, (s + 1.0) / warmup, factor)
        return base * factor

    return schedule


__all__ = ["lr_schedule", "titan_wsd_plan"]
