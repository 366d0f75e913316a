"""Fault injection: prove that the parity suite fails, and fails at the right place.

Each :class:`Fault` breaks one side without touching library files -- a config copy given to
torch_ref, a monkeypatch active while torch_ref runs or a hook active while jax traces (parity.fault_hooks),
or an edit of the loaded weights -- and names the check(s) where the suite's
``first_divergence`` must point (the forward faults; the backward, optimizer, balance and
dispatch faults are in :func:`default_faults` and parity.fault_hooks):

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
would otherwise "catch" everything. Each fault's ``stage`` says what runs (:data:`STAGES`:
forward checks; + gradients; + one optimizer step; a mesh in a subprocess); the jax side is
computed once per configuration and shared by its faults. Each row reports the margin: the
observed error at the first divergence over its tolerance (a baseline: its worst check).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from parity import fault_hooks as hooks
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
    # what the self-test runs: "forward" (routing, probes, losses), "backward" (+ gradients),
    # "steps" (+ one optimizer step), "mesh" (forward on a device mesh, in a subprocess)
    stage: str = "forward"
    optimizer: str | None = None  # RunOptions.optimizer
    mesh: str | None = None  # RunOptions.mesh (stage "mesh")
    jax_patcher: Callable | None = None  # () -> context manager active while jax traces
    jax_forward: bool = False  # does jax_patcher change the forward? (else the forward is shared)
    # --reference torchtitan: the flavor and its --titan-set edits; the fault is then on the jaxmoe
    # side (``overrides``: a jaxmoe option away from torchtitan's rule), torchtitan runs unchanged
    titan: str | None = None
    titan_overrides: tuple = ()

    @property
    def jax_key(self):
        """Cache key of what this fault's jax-side patch changes (None: the jax side is intact)."""
        return None if self.jax_patcher is None else f"fault:{self.name}"

    def jax_patch(self):
        return self.jax_patcher()

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
    """The faults of ``python -m parity selftest`` (and tests/test_parity.py). ``expected`` holds
    check names or ``fnmatch`` patterns."""
    mla_all = dict(stage="all")  # gradients and one optimizer step, besides the forward
    return [
        Fault("baseline (tiny-mla)", "tiny-mla", [], (), "no fault", **mla_all),
        Fault("baseline (tiny)", "tiny", [], (), "no fault"),
        Fault("baseline (tiny, no renorm)", "tiny", ["moe.norm_topk_prob=false"], (), "no fault"),
        Fault("baseline (tiny-mla, muon)", "tiny-mla", [], (), "no fault", stage="steps", optimizer="muon"),
        # forward
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
        # backward: forward unchanged, the expert weight gradients of the first MoE layer wrong
        Fault("blocked-vjp-backward", "tiny-mla", [], ("grad:model.layers.1.mlp.experts.*.down_proj.weight",),
              "jaxmoe blocked-path custom VJP: d down_proj x (1 + 1e-3)", stage="backward",
              jax_patcher=lambda: hooks.blocked_vjp_scaled(1e-3)),
        # optimizer: the first update of the first tensor the mistake touches
        Fault("adamw-no-bias-correction", "tiny-mla", [], ("update[1]:model.embed_tokens.weight",),
              "torch_ref AdamW without bias correction", stage="steps",
              patcher=hooks.adamw_without_bias_correction),
        Fault("decay-on-norms", "tiny-mla", [], ("update[1]:model.layers.0.self_attn.q_a_layernorm.weight",),
              "torch_ref weight decay on norm scales (optim.decay_norms true)", stage="steps",
              config_edit=_set("optim", "decay_norms", True)),
        Fault("muon-transposed", "tiny-mla", [], ("update[1]:model.layers.0.self_attn.q_a_proj.weight",),
              "torch.optim.Muon lr adjustment from the transposed shape", stage="steps", optimizer="muon",
              patcher=hooks.muon_transposed),
        # balance: the expert bias after the first update
        Fault("bias-not-centred", "tiny-mla", [], ("expert_bias[1]",),
              "torch_ref expert-bias sign update without mean-centring", stage="steps",
              patcher=hooks.bias_update_not_centred),
        # dispatch under a mesh (a subprocess with 8 fake CPU devices)
        Fault("baseline (tiny-mla, mesh)", "tiny-mla", list(MESH_OVERRIDES), (), "no fault", stage="mesh",
              mesh=MESH),
        Fault("dispatch-slot-swap", "tiny-mla", list(MESH_OVERRIDES), ("moe_out[1]",),
              "jaxmoe all_to_all dispatch: two tokens' slots of one expert swapped", stage="mesh", mesh=MESH,
              jax_patcher=hooks.slot_swap, jax_forward=True),
    ] + titan_faults()


# deepseek_v3/debugmodel with torchtitan's router in DeepSeek-V3 mode (sigmoid, groups, the bias hook)
TITAN = "deepseek_v3/debugmodel"
TITAN_SIGMOID = ("moe.router.score_func=sigmoid", "moe.router.num_expert_groups=4",
                 "moe.router.num_limited_groups=2", "moe.router.route_norm=true", "moe.router.route_scale=2.5")


def titan_faults() -> list[Fault]:
    """Faults localised against torchtitan's own trainer pieces (one step of
    ``--reference torchtitan``): jaxmoe set away from torchtitan's rule. Only when torchtitan
    imports (the ``[titan]`` extra); otherwise the self-test runs without them."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return []
    kw = dict(stage="steps", titan=TITAN, titan_overrides=TITAN_SIGMOID)
    return [
        Fault("baseline (torchtitan)", "", [], (), "no fault", **kw),
        Fault("titan: bias-not-centred", "", ["moe.bias_update_rule=sign"], ("expert_bias[1]",),
              "jaxmoe expert-bias update without mean-centring against torchtitan's pre-hook", **kw),
        Fault("titan: no-decay-on-norms", "", ["optim.decay_norms=false"],
              ("update[1]:layers.0.attention_norm.weight",),
              "jaxmoe AdamW without decay on norm scales against torchtitan's decay on all", **kw),
    ]


MESH = "expert=4,fsdp=2"
MESH_OVERRIDES = ("mesh.dispatcher=all_to_all",)
# what each stage runs: (gradients, optimizer steps)
STAGES = {"forward": (False, 0), "backward": (True, 0), "steps": (False, 1), "all": (True, 1), "mesh": (False, 0)}


def name_matches(name: str | None, expected: tuple) -> bool:
    """``name`` equals one of ``expected`` or matches it as a pattern whose only wildcard is
    ``*`` (the brackets of ``moe_out[1]`` are literal, not a glob character class)."""
    return name is not None and any(name == pat or fnmatch.fnmatchcase(name, pat.replace("[", "[[]"))
                                    for pat in expected)


def run_fault(f: Fault, profile: str, seed: int, init_scale: float, cache: dict) -> dict:
    """One fault (or baseline) in this process -> its self-test row."""
    grads, steps = STAGES[f.stage]
    t0 = time.perf_counter()
    if f.titan:
        from parity.titan_runner import TITAN_INIT_SCALE  # late: the torchtitan side is optional

        opts = RunOptions(reference="torchtitan", titan=f.titan, titan_overrides=list(f.titan_overrides),
                          overrides=list(f.overrides), profile=profile, seed=seed, steps=steps, name=f.name,
                          init_scale=TITAN_INIT_SCALE)
        rep = run_suite(opts, with_steps=steps > 0, log=None)
    else:
        opts = RunOptions(preset=f.preset, overrides=list(f.overrides), profile=profile, seed=seed, steps=steps,
                          name=f.name, init_scale=init_scale, optimizer=f.optimizer, mesh=f.mesh)
        rep = run_suite(opts, fault=None if not f.expected else f, jax_cache=cache, with_grads=grads,
                        with_steps=steps > 0, log=None)
    fd = rep["first_divergence"]
    got = fd["name"] if fd else None
    if f.expected:
        caught = not rep["passed"]
        ok = caught and name_matches(got, f.expected)
        margin = fd["value"] / fd["tolerance"] if fd and fd.get("tolerance") else None
    else:
        caught, ok = None, rep["passed"]
        # a baseline's margin: its worst check (observed / tolerance, < 1 when it passes)
        ratios = [c["value"] / c["tolerance"] for c in rep["checks"] if c["tolerance"]]
        margin = max(ratios) if ratios else None
    return {"fault": f.name, "how": f.how, "caught": caught, "first_divergence": got,
            "expected": " or ".join(f.expected) if f.expected else "(passes)", "ok": ok,
            "failed_checks": rep["n_failed"], "margin": margin, "stage": f.stage,
            "seconds": round(time.perf_counter() - t0, 1)}


def _run_mesh_faults(faults: list[Fault], profile: str, seed: int, init_scale: float) -> list[dict]:
    """The mesh faults in a subprocess: XLA_FLAGS must hold the fake device count before jax is
    imported, and this process may have started jax with one device already."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    arg = json.dumps({"names": [f.name for f in faults], "profile": profile, "seed": seed,
                      "init_scale": init_scale})
    proc = subprocess.run([sys.executable, "-m", "parity.faults", arg], env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_ROWS)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return [{"fault": f.name, "how": f.how, "caught": False if f.expected else None, "first_divergence": None,
                 "expected": " or ".join(f.expected) if f.expected else "(passes)", "ok": False,
                 "failed_checks": None, "margin": None, "stage": f.stage,
                 "error": " | ".join(tail)} for f in faults]
    return json.loads(lines[-1][len(_ROWS):])


_ROWS = "SELFTEST-ROWS "


def selftest(profile: str = "fast", faults: list[Fault] | None = None, seed: int = 0, log=print,
             jax_cache: dict | None = None, init_scale: float = DEFAULT_INIT_SCALE) -> tuple[bool, list[dict]]:
    """Run every fault; -> (all caught, localised and baselines passed, rows). ``jax_cache``
    shares jax-side results with other runs of the same configurations. Mesh faults run together
    in one subprocess (see :func:`_run_mesh_faults`)."""
    faults = default_faults() if faults is None else faults
    cache: dict = {} if jax_cache is None else jax_cache
    rows = []
    for f in [f for f in faults if f.stage != "mesh"]:
        rows.append(run_fault(f, profile, seed, init_scale, cache))
        _log(log, rows[-1])
    mesh = [f for f in faults if f.stage == "mesh"]
    if mesh:
        for r in _run_mesh_faults(mesh, profile, seed, init_scale):
            rows.append(r)
            _log(log, r)
    return all(r["ok"] for r in rows), rows


def _log(log, r: dict) -> None:
    if log:
        m = f", margin {r['margin']:.3g}" if r.get("margin") is not None else ""
        log(f"  {r['fault']}: {'ok' if r['ok'] else 'NOT OK'} (first divergence {r['first_divergence']}{m})")


def _main(argv: list[str]) -> int:
    """``python -m parity.faults JSON``: run the named faults here, print their rows (one line)."""
    a = json.loads(argv[0])
    by_name = {f.name: f for f in default_faults()}
    cache: dict = {}
    rows = [run_fault(by_name[n], a["profile"], a["seed"], a["init_scale"], cache) for n in a["names"]]
    print(_ROWS + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = ["Fault", "default_faults", "run_fault", "selftest", "titan_faults"]
