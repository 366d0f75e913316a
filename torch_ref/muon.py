"""Muon for the reference with Newton–Schulz in a chosen dtype (``optim.muon_ns_dtype``).

``torch.optim.Muon`` (torch 2.13) runs Newton–Schulz in bfloat16 unconditionally, so parity with
it rests on bf16 rounding: each update agrees with jaxmoe's only to ~4e-2, and a 20-step run's
agreement depends on bit-level details. :class:`Muon` is the same algorithm with the NS dtype a
parameter: ``bfloat16`` reproduces ``torch.optim.Muon`` bit for bit (tests/test_torch_ref.py
checks it), ``float32`` is the fp32 reference the ``float32-muon`` parity profile compares with.

Per matrix parameter ``p`` with gradient ``g`` (torch's ``_single_tensor_muon``, same order of
operations)::

    buf.lerp_(g, 1 - momentum);  u = g.lerp(buf, momentum) if nesterov else buf
    O = newton_schulz(u)                        (in ns_dtype)
    p *= 1 - lr * weight_decay;  p -= adjusted_lr * O

``adjusted_lr`` is ``torch.optim._muon._adjust_lr`` (looked up at each step, so the parity
fault that patches it reaches this class too): "original" ``lr * sqrt(max(1, rows/cols))``,
"match_rms_adamw" ``lr * 0.2 * sqrt(max(rows, cols))``, anything else ``lr``.
"""

from __future__ import annotations

import torch
import torch.optim._muon as torch_muon


def newton_schulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` with ``grad.to(dtype)`` where torch has
    ``grad.bfloat16()``: cast; work on the transpose of a tall matrix; divide by
    ``max(frobenius norm, eps)``; ``ns_steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X``
    (two ``addmm``); transpose back. Returns a tensor of ``dtype``."""
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update with Newton–Schulz in ``ns_dtype`` (see the module doc)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=(3.4445, -4.775, 2.0315), eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("torch_ref Muon takes no closure")
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.ndim != 2:
                    raise ValueError("Muon: parameter gradient must be a 2D matrix")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       group["ns_dtype"])
                adjusted = torch_muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-adjusted)
        return None


__all__ = ["Muon", "newton_schulz"]
