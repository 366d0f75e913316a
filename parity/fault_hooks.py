"""The hooks behind the self-test's backward, optimizer, balance and dispatch faults.

Each function returns a context manager that breaks one thing while it is active and restores it
on exit; nothing in jaxmoe/ or torch_ref/ is edited. jax-side hooks are active while jax
*traces* (parity.runner keeps what they change in the fault's own cache entry); torch-side ones
while torch_ref runs (``TorchSide.patched``).

* :func:`blocked_vjp_scaled` (jax, backward): the blocked expert path's backward, through its
  seam ``jaxmoe.model.blocked.transform_backward``, with its down-projection weight gradient
  times ``1 + eps``; the forward is untouched, so only ``grad[...]`` can see it.
* :func:`adamw_without_bias_correction` (torch, optimizer): torch_ref's AdamW replaced by one
  whose moments are not bias-corrected (``m / (1 - b1^t)``, ``v / (1 - b2^t)`` dropped).
* :func:`muon_transposed` (torch, optimizer): ``torch.optim.Muon`` adjusts the learning rate from
  the *transposed* shape (``(in, out)`` instead of ``(out, in)``): the orientation mistake a port
  between ``[in, out]`` and ``[out, in]`` storage makes.
* :func:`bias_update_not_centred` (torch, balance): the expert-bias sign update without its
  mean-centring.
* :func:`slot_swap` (jax, dispatch): in the all_to_all dispatcher, two tokens' first-choice
  results are swapped on the way back (each device's tokens 0 and 1), so each gets the other's
  expert output.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


# --------------------------------------------------------------------------------------------
# jax side
# --------------------------------------------------------------------------------------------


def blocked_vjp_scaled(eps: float = 1e-3):
    """The blocked path with ``d down_proj`` scaled by ``1 + eps`` in its custom VJP."""
    # late: jax (parity.faults is imported by the CLI before --mesh sets XLA_FLAGS)
    from jaxmoe.model.blocked import transform_backward

    return transform_backward(lambda g: {**g, "down_proj": g["down_proj"] * (1.0 + eps)})


def slot_swap():
    """The all_to_all dispatcher's combine reads token 0's first-choice result from token 1's
    slot and vice versa (``jaxmoe.parallel.expert_dispatch.combine`` on ``y_assign [T, k, D]`` with rows (0, 0)
    and (1, 0) swapped). A swap applied to the slot positions themselves would be invisible
    (send and return use the same slot), so the fault breaks the return path only."""
    from jaxmoe.parallel import expert_dispatch as dispatch

    original = dispatch.combine

    def swapped(y_assign, topk_weights):
        y = y_assign.at[0, 0].set(y_assign[1, 0]).at[1, 0].set(y_assign[0, 0])
        return original(y, topk_weights)

    return _patched(dispatch, "combine", swapped)


# --------------------------------------------------------------------------------------------
# torch side
# --------------------------------------------------------------------------------------------


def _adamw_no_bias_correction_class():
    import torch  # late: torch

    class AdamWNoBiasCorrection(torch.optim.Optimizer):
        """AdamW (decoupled decay, eps outside the root) with the bias correction left out."""

        def __init__(self, params, lr, betas, eps):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                b1, b2 = g["betas"]
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    st["m"].lerp_(p.grad, 1 - b1)
                    st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    p.addcdiv_(st["m"], st["v"].sqrt().add_(g["eps"]), value=-g["lr"])

    return AdamWNoBiasCorrection


def adamw_without_bias_correction():
    """torch_ref's ``make_optimizer`` with its AdamW swapped for one without bias correction
    (same groups, learning rates, decay)."""
    import torch  # late: torch

    import torch_ref.train as train

    original = train.make_optimizer
    cls = _adamw_no_bias_correction_class()

    def make(model, cfg):
        opt = original(model, cfg)
        for i, o in enumerate(opt.optimizers):
            if isinstance(o, torch.optim.AdamW):
                d = o.defaults
                groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "base_lr": g["base_lr"]}
                          for g in o.param_groups]
                opt.optimizers[i] = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"])
        return opt

    return _patched(train, "make_optimizer", make)


def muon_transposed():
    """``torch.optim.Muon``'s learning-rate adjustment from the transposed parameter shape."""
    import torch.optim._muon as muon  # late: torch (the module torch.optim.Muon's step calls into)

    original = muon._adjust_lr

    def adjust(lr, adjust_lr_fn, param_shape):
        return original(lr, adjust_lr_fn, tuple(param_shape)[::-1])

    return _patched(muon, "_adjust_lr", adjust)


def bias_update_not_centred():
    """``torch_ref.train.update_expert_bias`` without the mean-centring of the sign update."""
    import torch  # late: torch

    import torch_ref.train as train

    def update(bias, counts, rate, rule="sign_centred"):
        del rule  # the fault: never centred
        c = counts.float()
        return bias + (rate * torch.sign(c.mean(-1, keepdim=True) - c)).to(bias.dtype)

    return _patched(train, "update_expert_bias", update)


__all__ = ["adamw_without_bias_correction", "bias_update_not_centred", "blocked_vjp_scaled", "muon_transposed",
           "slot_swap"]
