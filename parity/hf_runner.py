"""``python -m parity run --reference hf``: jaxmoe against transformers on the same weights.

One run (:func:`run_hf_suite`), same structure and report as :func:`parity.runner.run_suite`:
config and weights as there (``--init-scale``), the HF model from those weights
(:class:`parity.hf_side.HFSide`), then routing, gate weights, logits and KL (transformers has no
activation probes), the losses, every gradient by HF name and, with ``--steps N``, N AdamW steps
on both sides (first update, loss curve, every parameter, the expert bias). The objective on both
sides is ``ce + z_loss_coef * z_loss`` plus, under ``moe.lb_scope = "pooled"``, ``lb_coef`` times
the load-balance loss (HF's ``aux_loss``); see parity.hf_side for why seq-aux and router-z are
left out. HF's ``aux_loss`` is reported as a figure when the scopes differ.
"""

from __future__ import annotations

import copy
import time

from parity.checks import (
    Checks,
    compare_forward,
    compare_losses,
    compare_named,
    compare_routing,
    compare_steps,
    first_divergence,
)
from parity.hf_side import HFSide, lb_pooled
from parity.report import assemble
from parity.sides import JaxSide, init_weights, make_batches, setup_numerics, to_hf, to_numpy
from parity.tolerances import tolerances_for


def hf_objective_config(cfg):
    """``cfg`` with the loss terms transformers does not compute set to zero (see module doc)."""
    cfg = copy.deepcopy(cfg)
    cfg.moe.seq_aux_coef = 0.0
    cfg.moe.router_z_coef = 0.0
    if not lb_pooled(cfg):
        cfg.moe.lb_coef = 0.0
    return cfg


def run_hf_suite(opts, cfg, n_steps: int) -> dict:
    """Compare jaxmoe with transformers (``cfg`` from parity.runner.build_config)."""
    from jaxmoe.errors import UserError

    if opts.mesh or opts.force_routing:
        raise UserError("--reference hf runs on one device with natural routing: drop --mesh / --force-routing")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cfg = hf_objective_config(cfg)
    tol = tolerances_for(cfg.compute.dtype, cfg.optim.optimizer)
    setup_numerics()
    params, buffers = init_weights(cfg, opts.seed, opts.randomize_bias, opts.init_scale)
    hf = to_hf(cfg, params, buffers)
    grad_names = list(to_hf(cfg, params, with_buffers=False))
    bias = to_numpy(buffers["moe"]["expert_bias"]) if buffers.get("moe", {}).get("expert_bias") is not None else None
    batches = make_batches(cfg, max(1, n_steps), opts.seed)
    hs = HFSide(cfg, hf, grad_names)
    js = JaxSide(cfg, params, buffers)
    timings["setup"] = time.perf_counter() - t0

    t = time.perf_counter()
    jf = js.forward(batches[0])
    hfw = hs.forward(batches[0])
    timings["forward"] = time.perf_counter() - t
    checks = Checks()
    routing = compare_routing(cfg, jf["aux"], hfw["aux"], bias, tol, checks)
    layer_errors = compare_forward(cfg, jf, hfw, tol, checks)
    keys = ["ce", "z_loss"] + (["lb"] if lb_pooled(cfg) else []) + ["loss"]
    compare_losses(jf["losses"], hfw["losses"], tol, checks, keys=keys, figures=() if lb_pooled(cfg) else ("lb",))

    t = time.perf_counter()
    jg = js.grads(batches[0])
    hg = hs.grads(batches[0])
    timings["grads"] = time.perf_counter() - t
    grad_worst = compare_named("grad", jg, hg, tol.grad_rel_l2, checks, "backward")

    curves = None
    if n_steps > 0:
        t = time.perf_counter()
        jt = js.train(batches[:n_steps])
        ht = hs.train(batches[:n_steps])
        timings["steps"] = time.perf_counter() - t
        curves = {"jax": jt["losses"], "torch": ht["losses"]}
        compare_steps(cfg, jt, ht, bias, n_steps, tol, checks, params0=hf)

    items = checks.items
    return assemble(
        opts.label if opts.label.endswith("-hf") else opts.label + "-hf", items,
        first_divergence=first_divergence(items), routing=routing,
        comparison_routing="natural (transformers cannot replay a routing)", curves=curves,
        layer_errors=layer_errors, grad_worst=grad_worst, tol=tol, opts=opts, n_steps=n_steps, cfg=cfg,
        timings=timings, t0=t0, reference="hf", hf_aux_loss=hfw["losses"].get("lb"), lb_compared=lb_pooled(cfg))


__all__ = ["hf_objective_config", "run_hf_suite"]
