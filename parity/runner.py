"""Run jaxmoe and torch_ref on the same weights and batches and compare them.

One run (:func:`run_suite`) goes, top to bottom (the set-up and the two sides are in
:mod:`parity.sides`, the comparisons in :mod:`parity.checks`):

1. **Numerics set-up**: matmul precision pinned on both sides (:func:`parity.sides.setup_numerics`).
2. **Config**: preset + ``--set`` overrides, the run size (``--profile``), ``--dtype`` and
   ``--optimizer`` on *both* sides (fp32 master weights; the dtype is the compute dtype).
3. **Weights, built once** (:func:`parity.sides.init_weights`), given to torch_ref by HF name
   (:func:`parity.sides.to_hf`).
4. **Batches** (:func:`parity.sides.make_batches`); with ``--packed`` rows of packed documents
   (``segment_ids`` / ``positions``: attention masked at document boundaries, per-document RoPE).
5. **Forward** on both sides with probes. Routing per MoE layer: index sets (exact; mismatches
   classified as near-ties or real), then the *comparison forward*: if there were near-tie flips,
   or ``--force-routing`` asks for it, one side replays the other's expert choices
   (``forced_idx``) so that the activation, loss and gradient checks measure numerics and not a
   routing flip. Gate weights, counts, dropped tokens and every probe in forward order.
6. **Losses** (ce, z_loss, lb, seq_aux, router_z, total) with each side's ``compute_loss``.
7. **Gradients** of every parameter, by HF name: jaxmoe's ``make_grad_fn`` (the real training
   path, micro-batch accumulation included) against torch_ref's ``accumulate_gradients``.
8. **N optimizer steps** with ``jaxmoe.train.step.make_train_step`` and ``torch_ref.train.train_step``
   on the same batches: loss curves, every parameter and the expert biases afterwards.
9. **First divergence**: the earliest check in forward order that fails.

The result is a plain dict (``report.json``'s content); :mod:`parity.report` writes the files.

The names other code imports from here (the sides, the checks, the set-up helpers) are
re-exported from :mod:`parity.sides` and :mod:`parity.checks`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

from jaxmoe.config import Config, load_config, parse_override, validate
from jaxmoe.errors import UserError
from jaxmoe.parallel.mesh import build_context, parse_mesh
from jaxmoe.parallel.sharding import BATCH_AXES
from parity.checks import (
    Checks,
    compare_forward,
    compare_losses,
    compare_named,
    compare_routing,
    compare_steps,
    first_divergence,
    selection_gap,
)
from parity.forcing import force_after_near_tie, strict_fraction
from parity.report import assemble
from parity.sides import JaxSide, TorchSide, init_weights, make_batches, setup_numerics, to_hf, to_numpy
from parity.tolerances import DEFAULT_INIT_SCALE, SIZE_PROFILES, tolerances_for

# jax (and torch, through parity.sides) is imported only inside functions: `import parity.runner`
# stays free of both, so `python -m parity --help` is instant and --mesh can set XLA_FLAGS first.


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass
class RunOptions:
    """What ``python -m parity run`` was asked to do (see parity.cli for the flags)."""

    preset: str = "tiny"
    overrides: list = field(default_factory=list)
    dtype: str = "float32"
    steps: int | None = None  # None: the size profile's default
    optimizer: str | None = None  # None: the preset's
    seed: int = 0
    mesh: str | None = None  # e.g. "expert=4,fsdp=2"
    force_routing: str | None = None  # "torch": jax replays torch's choices; "jax": the reverse
    profile: str = "full"  # run size: "fast" | "full"
    name: str | None = None  # label in summaries
    randomize_bias: bool = True
    reference: str = "torch_ref"  # "torch_ref" | "hf" (transformers; parity.hf_runner) | "torchtitan"
    titan: str | None = None  # --reference torchtitan: FAMILY/FLAVOR (parity.titan_runner)
    titan_overrides: list = field(default_factory=list)  # --titan-set PATH=VALUE (torchtitan config)
    init_scale: float = DEFAULT_INIT_SCALE  # weight matrices x this (parity.sides.scale_init)
    packed: bool = False  # batches of packed documents (segment_ids, positions): parity.sides.pack_rows

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.preset, self.dtype]
        parts += [o.replace("moe.", "").replace("train.", "") for o in self.overrides]
        if self.optimizer:
            parts.append(self.optimizer)
        if self.force_routing:
            parts.append(f"force-{self.force_routing}")
        if self.mesh:
            parts.append(self.mesh.replace(",", "_").replace("=", ""))
        if self.packed:
            parts.append("packed")
        return "-".join(parts)


def _override_keys(overrides) -> set[str]:
    """The ``section.key`` each ``--set`` names, where the key lives now (an old train.* key too)."""
    return {".".join(parse_override(o)[:2]) for o in overrides}


def build_config(opts: RunOptions) -> Config:
    """Preset + overrides + run size + dtype/optimizer/seed/steps, validated."""
    if opts.profile not in SIZE_PROFILES:
        raise UserError(f"--profile {opts.profile!r}: choose one of {', '.join(SIZE_PROFILES)}")
    if opts.dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {opts.dtype!r}: choose float32 or bfloat16")
    if opts.force_routing not in (None, "torch", "jax"):
        raise UserError(f"--force-routing {opts.force_routing!r}: choose torch or jax")
    cfg = load_config(preset=opts.preset, overrides=list(opts.overrides))
    size = SIZE_PROFILES[opts.profile]
    given = _override_keys(opts.overrides)
    t = cfg.train
    if size["seq_len"] and "train.seq_len" not in given:
        t.seq_len = size["seq_len"]
    if size["batch_size"] and "train.batch_size" not in given:
        t.batch_size = size["batch_size"]
    # the batch must split into micro-batches (and, on a mesh, over the batch axes)
    shards = _mesh_batch_shards(opts.mesh)
    unit = t.micro_batches * shards
    if "train.batch_size" not in given:
        t.batch_size = unit * max(1, math.ceil(t.batch_size / unit))
    cfg.compute.dtype = opts.dtype
    o = cfg.optim
    if opts.optimizer:
        o.optimizer = opts.optimizer
    if o.optimizer == "muon" and "optim.muon_ns_dtype" not in given:
        # fp32 Newton-Schulz on both sides (torch_ref.muon) unless --set optim.muon_ns_dtype=bfloat16
        # asks for torch.optim.Muon's bf16 NS (its own tolerance profile: parity.tolerances)
        o.muon_ns_dtype = "float32"
    t.seed = opts.seed
    steps = size["steps"] if opts.steps is None else opts.steps
    if steps < 0:
        raise UserError(f"--steps {steps} must be >= 0")
    if steps > 0:
        t.steps = steps  # the LR schedule spans exactly this run
    return validate(cfg)


def _mesh_batch_shards(spec: str | None) -> int:
    if not spec:
        return 1
    sizes = parse_mesh(spec)
    return math.prod(max(1, sizes.get(a, 1)) for a in BATCH_AXES)


def run_steps(opts: RunOptions, cfg: Config) -> int:
    size = SIZE_PROFILES[opts.profile]
    return size["steps"] if opts.steps is None else opts.steps



# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _ensure_devices(n: int) -> None:
    """Fake CPU devices for a mesh: XLA_FLAGS must be set before jax's backend starts."""
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:  # harmless if the backend already started; decisive if it has not
        os.environ["XLA_FLAGS"] = (flags + f" {flag}={n}").strip()
    import jax  # late: only after XLA_FLAGS is set (see the note on imports)

    have = jax.device_count()
    if have < n:
        raise UserError(
            f"--mesh needs {n} devices but jax started with {have}; set XLA_FLAGS={flag}={n} "
            "before jax is imported (python -m parity does this when --mesh is given)"
        )


def mesh_devices(spec: str) -> int:
    sizes = parse_mesh(spec)
    fixed = math.prod(v for v in sizes.values() if v and v > 0)
    return fixed if all(v != -1 for v in sizes.values()) else max(8, fixed)


def _titan_suite(opts: RunOptions, with_steps: bool) -> dict:
    from parity.titan_runner import run_titan_suite  # late: imports torchtitan

    if opts.steps is None and with_steps:
        raise UserError("--reference torchtitan: pass --steps N (0: one forward/backward; N: N training "
                        "steps with torchtitan's optimizer, schedule and bias hook)")
    return run_titan_suite(opts, (opts.steps or 0) if with_steps else 0)


def _compare_grads(js, ts, batch, forced, cache, patch, tol, checks, timings) -> dict:
    """Every parameter's gradient on both sides (jax's cached per routing and fault)."""
    gkey, jpatch = patch
    t = time.perf_counter()
    ckey = ("grads", None if forced is None else forced.tobytes(), gkey)
    if ckey not in cache:
        cache[ckey] = js.grads(batch, forced, patch=jpatch())
    jg = cache[ckey]
    timings["jax_grads"] = time.perf_counter() - t
    t = time.perf_counter()
    tg = ts.grads(batch, forced)
    timings["torch_grads"] = time.perf_counter() - t
    return compare_named("grad", jg, tg, tol.grad_rel_l2, checks, "backward")


def _compare_training(cfg, js, ts, batches, cache, patch, bias, params0, tol, checks, timings) -> dict:
    """``len(batches)`` optimizer steps on both sides, compared step by step; the loss curves."""
    gkey, jpatch = patch
    n_steps = len(batches)
    t = time.perf_counter()
    tkey = ("train", n_steps, gkey)
    if tkey not in cache:  # shared by the torch-side optimizer faults of one configuration
        with jpatch():
            cache[tkey] = js.train(batches)
    jt = cache[tkey]
    timings["jax_steps"] = time.perf_counter() - t
    t = time.perf_counter()
    tt = ts.train(batches)
    timings["torch_steps"] = time.perf_counter() - t

    def rerun(forced):
        with jpatch():
            return js.train(batches, forced=forced)

    jt, info = force_after_near_tie(cfg, jt, tt, tol, rerun)
    compare_steps(cfg, jt, tt, bias, n_steps, tol, checks, params0=params0, forced=info)
    return {"jax": jt["losses"], "torch": tt["losses"], "forced": info}


def run_suite(opts: RunOptions, *, fault=None, jax_cache: dict | None = None, with_grads: bool = True,
              with_steps: bool = True, log=print) -> dict:
    """Run one parity comparison; returns the report dict (see module doc)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if opts.packed and opts.reference == "hf":
        raise UserError("--packed compares against torch_ref or torchtitan (not --reference hf); "
                        "drop --packed or --reference")
    if opts.reference == "torchtitan":  # the config comes from the flavor, not a preset
        return _titan_suite(opts, with_steps)
    if opts.mesh:
        _ensure_devices(mesh_devices(opts.mesh))
    cfg = build_config(opts)
    if cfg.compute.fp8 != "none" and opts.reference != "torch_ref":
        raise UserError(f"compute.fp8={cfg.compute.fp8!r} is mirrored by torch_ref only (transformers has no FP8 "
                        f"recipe of its own); drop --reference {opts.reference} or the fp8 setting")
    n_steps = run_steps(opts, cfg) if with_steps else 0
    if opts.reference == "hf":
        from parity.hf_runner import run_hf_suite  # late: imports transformers

        return run_hf_suite(opts, cfg, n_steps)
    if opts.reference != "torch_ref":
        raise UserError(f"--reference {opts.reference!r}: choose torch_ref, hf or torchtitan")
    tol = tolerances_for(cfg.compute.dtype, cfg.optim.optimizer, forced=opts.force_routing is not None,
                         ns_dtype=cfg.optim.muon_ns_dtype, fp8=cfg.compute.fp8)
    setup_numerics()

    ctx = None
    if opts.mesh:
        cfg, ctx = build_context(cfg, parse_mesh(opts.mesh))

    key = (cfg.to_json(), opts.seed, opts.randomize_bias, opts.mesh, opts.init_scale, opts.packed)
    cache = jax_cache.setdefault(key, {}) if jax_cache is not None else {}
    if "weights" not in cache:
        cache["weights"] = init_weights(cfg, opts.seed, opts.randomize_bias, opts.init_scale)
    params, buffers = cache["weights"]
    if "hf" not in cache:
        cache["hf"] = to_hf(cfg, params, buffers, any_bias=True)
    hf = cache["hf"]
    bias = to_numpy(buffers["moe"]["expert_bias"]) if buffers.get("moe", {}).get("expert_bias") is not None else None
    batches = make_batches(cfg, max(1, n_steps), opts.seed, packed=opts.packed)
    timings["setup"] = time.perf_counter() - t0

    # A fault may patch the jax side (parity.faults: a backward or dispatch fault). Its patch is
    # active while jax traces; what it changes is cached under the fault's own key (`jax_key`):
    # the forward only if the fault says the forward changes, the gradients always.
    jpatch = (lambda: fault.jax_patch()) if fault is not None and fault.jax_key else contextlib.nullcontext
    fkey = fault.jax_key if fault is not None and fault.jax_forward else None
    gkey = fault.jax_key if fault is not None else None
    t = time.perf_counter()
    if ("jax", fkey) not in cache:
        with jpatch():
            cache[("jax", fkey)] = JaxSide(cfg, params, buffers, ctx)
    js = cache[("jax", fkey)]
    if ("fwd", fkey) not in cache:
        with jpatch():
            cache[("fwd", fkey)] = js.forward(batches[0])
    jf = cache[("fwd", fkey)]
    timings["jax_forward"] = time.perf_counter() - t
    t = time.perf_counter()
    ts = TorchSide(cfg, hf, fault, jax_info={"counts": jf["aux"]["counts"]})
    tf = ts.forward(batches[0])
    timings["torch_forward"] = time.perf_counter() - t

    checks = Checks()
    routing = compare_routing(cfg, jf["aux"], tf["aux"], bias, tol, checks)
    # The comparison forward: replay one side's routing in the other when asked, or when the
    # natural runs disagree only on near-ties (so the numerics checks measure numerics).
    forced, mode = None, "natural"
    if opts.force_routing == "torch":
        forced, mode = tf["aux"]["router"]["topk_idx"], "jax replays torch's expert choices (--force-routing torch)"
        with jpatch():
            jf = js.forward(batches[0], forced)
    elif opts.force_routing == "jax" or (routing["near_tie"] and not routing["real"]):
        forced = jf["aux"]["router"]["topk_idx"]
        mode = ("torch replays jax's expert choices (--force-routing jax)" if opts.force_routing == "jax"
                else f"torch replays jax's expert choices ({routing['near_tie']} near-tie flips)")
        tf = ts.forward(batches[0], forced)
    layer_errors = compare_forward(cfg, jf, tf, tol, checks)
    compare_losses(jf["losses"], tf["losses"], tol, checks)

    grad_worst = (_compare_grads(js, ts, batches[0], forced, cache, (gkey, jpatch), tol, checks, timings)
                  if with_grads else {})
    curves = None
    if n_steps > 0:
        curves = _compare_training(cfg, js, ts, batches[:n_steps], cache, (gkey, jpatch), bias, hf, tol, checks,
                                   timings)

    items = checks.items
    forced_info = curves.pop("forced") if curves else None
    return assemble(
        opts.label, items, first_divergence=first_divergence(items), routing=routing, comparison_routing=mode,
        forced_from_step=forced_info and forced_info["forced_from_step"], forced_routing=forced_info,
        strict_fraction=strict_fraction(items), curves=curves, layer_errors=layer_errors, grad_worst=grad_worst,
        tol=tol, opts=opts, n_steps=n_steps, cfg=cfg, timings=timings, t0=t0,
        mesh=None if ctx is None else {"sizes": ctx.sizes, "dispatcher": ctx.dispatcher},
        fault=None if fault is None else fault.name)


__all__ = ["Checks", "JaxSide", "RunOptions", "TorchSide", "build_config", "first_divergence", "init_weights",
           "make_batches", "run_suite", "selection_gap", "to_hf"]
