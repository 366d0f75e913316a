"""Fault injection: prove that the parity suite fails, and fails at the right place.

Each :class:`Fault` breaks the *torch_ref* side only, without touching library files -- through
a config copy given to torch_ref, a monkeypatch active while torch_ref runs, or an edit of the
loaded weights -- and names the probe(s) where the suite's ``first_divergence`` must point:

=======================  ==================================================  =======================
fault                    how                                                 expected first divergence
=======================  ==================================================  =======================
rmsnorm-eps              torch cfg ``model.rms_norm_eps`` 1e-6 -> 1e-5         ``attn_out[0]``
rope-layout              torch cfg ``model.rope_layout`` half -> interleaved   ``attn_out[0]``
softmax-after-topk       softmax over the k selected logits instead of over    ``router_weights[0]`` or
                         all experts (tiny, ``norm_topk_prob=false``)          ``moe_out[0]``
expert-weight            +1e-3 on every entry of the most-loaded expert's      ``moe_out[last layer]``
                         down projection in the last MoE layer
missing-route-scale      torch cfg ``moe.route_scale`` 2.5 -> 1 (tiny-mla)     ``router_weights[1]`` or
                                                                             ``moe_out[1]``
=======================  ==================================================  =======================

Plus a ``baseline`` (no fault) per configuration, which must pass: a suite that always fails
would otherwise "catch" everything. The self-test runs the forward-pass checks only (routing,
probes, losses): that is where a divergence is localised; the jax side is computed once per
configuration and shared by its faults.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

from parity.runner import RunOptions, run_suite
from parity.tolerances import DEFAULT_INIT_SCALE


def _same(cfg):
    return cfg


def _no_patch():
    return contextlib.nullcontext()


def _no_edit(model, info):
    return None


@dataclass
class Fault:
    name: str
    preset: str
    overrides: list
    expected: tuple  # acceptable first-divergence check names; () = must pass (baseline)
    how: str
    config_edit: Callable = _same  # (cfg copy) -> None, edits the torch side's config
    patcher: Callable = _no_patch  # () -> context manager active while torch_ref runs
    weight_edit: Callable = _no_edit  # (torch model, {"counts": jax counts [Lm, E]}) -> None
    extra: dict = field(default_factory=dict)

    # -- the hooks parity.sides.TorchSide calls ---------------------------------------------
    def torch_config(self, cfg):
        cfg = copy.deepcopy(cfg)
        self.config_edit(cfg)
        return cfg

    def patch(self):
        return self.patcher()

    def edit_weights(self, model, info):
        self.weight_edit(model, info)


def _set(section: str, key: str, value):
    def edit(cfg):
        setattr(getattr(cfg, section), key, value)

    return edit


@contextlib.contextmanager
def _softmax_after_topk():
    """Gate weights = softmax over the k selected router logits. Since
    ``softmax(log p)[idx] = p[idx] / sum p[idx]``, this is the renormalised top-k probability: the
    same experts, different weights when the preset does not renormalise."""
    import torch_ref.router as router

    original = router.gate_weights

    def wrong(scores, idx, e):
        w = scores.gather(1, idx)
        return w / w.sum(-1, keepdim=True) * e.route_scale

    router.gate_weights = wrong
    try:
        yield
    finally:
        router.gate_weights = original


def _bump_expert(delta: float):
    """+delta on every entry of one expert's down projection: the last MoE layer, the expert the
    jax side sent most tokens to (so the change surely reaches the output)."""

    def edit(model, info):
        import torch

        block = model.moe_blocks()[-1]
        counts = info["counts"][-1]
        ex = int(counts.argmax())
        mlp = block.experts[ex]
        with torch.no_grad():
            getattr(mlp, mlp.names[2]).weight.add_(delta)

    return edit


def default_faults() -> list[Fault]:
    """The faults of ``python -m parity selftest`` (and tests/test_parity.py)."""
    return [
        Fault("baseline (tiny-mla)", "tiny-mla", [], (), "no fault"),
        Fault("baseline (tiny)", "tiny", [], (), "no fault"),
        Fault("baseline (tiny, no renorm)", "tiny", ["moe.norm_topk_prob=false"], (), "no fault"),
        Fault("rmsnorm-eps", "tiny-mla", [], ("attn_out[0]",),
              "torch_ref model.rms_norm_eps 1e-6 -> 1e-5", config_edit=_set("model", "rms_norm_eps", 1e-5)),
        Fault("rope-layout", "tiny", [], ("attn_out[0]",),
              "torch_ref model.rope_layout half -> interleaved",
              config_edit=_set("model", "rope_layout", "interleaved")),
        Fault("softmax-after-topk", "tiny", ["moe.norm_topk_prob=false"], ("router_weights[0]", "moe_out[0]"),
              "torch_ref gate weights = softmax over the top-k logits", patcher=_softmax_after_topk),
        Fault("expert-weight", "tiny-mla", [], ("moe_out[2]",),
              "torch_ref +1e-3 on one expert's down_proj (last MoE layer)", weight_edit=_bump_expert(1e-3)),
        Fault("missing-route-scale", "tiny-mla", [], ("router_weights[1]", "moe_out[1]"),
              "torch_ref moe.route_scale 2.5 -> 1", config_edit=_set("moe", "route_scale", 1.0)),
    ]


def selftest(profile: str = "fast", faults: list[Fault] | None = None, seed: int = 0, log=print,
             jax_cache: dict | None = None, init_scale: float = DEFAULT_INIT_SCALE) -> tuple[bool, list[dict]]:
    """Run every fault; -> (all caught, localised and baselines passed, rows). ``jax_cache``
    shares jax-side results with other runs of the same configurations."""
    faults = default_faults() if faults is None else faults
    cache: dict = {} if jax_cache is None else jax_cache
    rows = []
    for f in faults:
        opts = RunOptions(preset=f.preset, overrides=list(f.overrides), profile=profile, seed=seed, steps=0,
                          name=f.name, init_scale=init_scale)
        rep = run_suite(opts, fault=None if not f.expected else f, jax_cache=cache, with_grads=False,
                        with_steps=False)
        fd = rep["first_divergence"]
        got = fd["name"] if fd else None
        if f.expected:
            caught = not rep["passed"]
            ok = caught and got in f.expected
        else:
            caught = None
            ok = rep["passed"]
        rows.append({"fault": f.name, "how": f.how, "caught": caught, "first_divergence": got,
                     "expected": " or ".join(f.expected) if f.expected else "(passes)", "ok": ok,
                     "failed_checks": rep["n_failed"]})
        if log:
            log(f"  {f.name}: {'ok' if ok else 'NOT OK'} (first divergence {got})")
    return all(r["ok"] for r in rows), rows


__all__ = ["Fault", "default_faults", "selftest"]
