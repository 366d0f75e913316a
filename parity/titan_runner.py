"""``python -m parity run --reference torchtitan --titan FAMILY/FLAVOR``: jaxmoe against torchtitan.

One run (:func:`run_titan_suite`), same structure and report as :func:`parity.runner.run_suite`:

1. the jaxmoe config is derived from the torchtitan flavor (:func:`jaxmoe.config.titan.
   config_from_titan`, after ``--titan-set`` edits of the torchtitan config), then the run size
   (``--profile``) and ``--set`` overrides of the train section;
2. weights built once by jaxmoe (:func:`parity.sides.init_weights`, ``--init-scale``; a sigmoid
   flavor's expert bias randomised), given to torchtitan by its native names
   (:func:`jaxmoe.port.maps.titan_map.to_titan`);
3. forward on both sides: routing sets per MoE layer (torchtitan selects with the bias, takes the
   gate weights from the unbiased scores, limits groups), router logits, gate weights, counts,
   logits and KL (torchtitan has no activation probes);
4. the loss as torchtitan computes it (summed CE / global valid tokens; jaxmoe's ``ce`` with every
   aux coefficient at 0, which is what the mapping sets);
5. every gradient by torchtitan name (relative L2), from jaxmoe's training path
   (``make_grad_fn``) and torchtitan's ``loss.backward()``;
6. with ``--steps N``: N training steps on both sides from the same weights and batches --
   jaxmoe's ``make_train_step`` with the train section :func:`jaxmoe.config.titan.
   map_titan_training` set (AdamW decaying every parameter, clipping, ``titan_wsd``, the
   ``sign_centred`` bias rule; ``train.steps`` = N unless ``--set train.steps=`` says otherwise,
   as it is the schedule's length on both sides), torchtitan's ``OptimizersContainer`` /
   ``LRSchedulersContainer`` / MoE bias pre-hook (:meth:`parity.titan_side.TitanSide.train`) --
   compared by :func:`parity.checks.compare_steps`: the losses, every parameter after update 1
   and after N, the expert biases.

``--packed`` (``--steps 0``): batches of packed documents; torchtitan runs its own FlexAttention
with the document mask built from the per-document ``positions`` (forward only: routing, logits
and loss; flex has no CPU backward; :mod:`parity.titan_side`, "Packed documents").

Two precision profiles (``--dtype``):

* ``float32`` (tolerance profile ``float32-adamw``): both sides fp32 -- torchtitan's experts with
  their bf16 casts removed (:class:`parity.titan_side.TitanSide`, ``fp32_experts``): the
  rounding-level comparison.
* ``bfloat16`` (profile ``bfloat16-adamw``): **stock torchtitan** -- its ``GroupedExperts`` as
  shipped, which cast the tokens and the expert weights to bf16 for ``torch._grouped_mm`` even in
  an fp32 model (what a torchtitan run computes in its experts) -- against jaxmoe's bf16 compute
  (``compute.dtype=bfloat16``: matmuls in bf16, router, combine and losses fp32). Not the same
  rounding on the two sides (torchtitan's attention, norms and dense layers stay fp32 here: FSDP's
  bf16 parameter cast is not reproduced in one CPU process), so this is the reported bf16 profile:
  routing, the loss and the logits (scaled) gated at bf16 resolution, gradients and N-step
  figures reported, as the bf16 rows of the torch_ref matrix are.

torchtitan's expert bias (its default ``load_balance_coeff``, on softmax scores as on sigmoid ones)
is mapped and trained on both sides: the N-step run calls torchtitan's bias hook after every step
and compares the biases. Only a run that turns jaxmoe's bias off (``--set
moe.use_expert_bias=false``) trains torchtitan's with the hook off, noted in the report.
"""

from __future__ import annotations

import math
import time

from jaxmoe.config import config_from_dict, parse_override, validate
from jaxmoe.errors import UserError
from parity.checks import (
    Checks,
    compare_forward,
    compare_losses,
    compare_named,
    compare_routing,
    compare_steps,
    first_divergence,
)
from parity.forcing import force_after_near_tie, strict_fraction
from parity.report import assemble
from parity.sides import JaxSide, decisiveness, init_weights, make_batches, setup_numerics, to_numpy
from parity.tolerances import SIZE_PROFILES, tolerances_for

# --init-scale of torchtitan runs. The debug flavors are wider than the tiny presets (MLA heads
# of 192, 16 heads, 6 layers), and scale 8 makes attention so sharp that fp32 rounding is
# amplified layer by layer: deepseek_v3/debugmodel, --profile fast, measured max logit error
# relative to the logits' scale 1.25e-6 at scale 1, 1.30e-6 at 2, 7.5e-6 at 4, 2.1e-4 at 8
# (worst gradient rel L2 2.5e-6, 2.8e-6, 1.7e-5, 1.1e-3), routing identical in all four.
TITAN_INIT_SCALE = 2.0


# The schedule of a --steps N run unless --set gives it: torchtitan's debug trainers'
# (torchtitan/models/deepseek_v3/config_registry.py ``deepseek_v3_debugmodel``: warmup 2,
# decay_ratio 0.8, linear, min_lr_factor 0; lr 8e-4 = default_adamw's), so that N = 20 steps
# cross all three phases (torchtitan's default warmup of 200 would be all warmup). The registry
# module itself imports the whole Trainer (tensorboard, datasets): not importable here.
TITAN_RUN_SCHEDULE = {"warmup_steps": 2, "titan_decay_ratio": 0.8, "titan_decay_type": "linear", "min_lr_ratio": 0.0}


def titan_config(opts, n_steps: int = 0):
    """(TitanConfig, jaxmoe Config sized for the run) from ``opts.titan`` / ``titan_overrides``;
    ``train.steps`` = ``n_steps`` (the schedule's length) unless ``--set`` gives it."""
    from jaxmoe.config.titan import config_from_titan

    if not opts.titan:
        raise UserError("--reference torchtitan needs --titan FAMILY/FLAVOR (e.g. deepseek_v3/debugmodel)")
    tcfg = config_from_titan(opts.titan, opts.titan_overrides)
    cfg = tcfg.config
    data: dict = {}
    for text in opts.overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    cfg = config_from_dict(data, base=cfg)
    given = {f"{s}.{k}" for s, d in data.items() for k in d}  # parse_override: where keys live now
    size = SIZE_PROFILES[opts.profile]
    t = cfg.train
    for k in ("seq_len", "batch_size"):
        if size[k] and f"train.{k}" not in given:
            setattr(t, k, size[k])
    t.batch_size = t.micro_batches * max(1, math.ceil(t.batch_size / t.micro_batches))
    cfg.compute.dtype, t.seed = opts.dtype, opts.seed
    if n_steps and "train.steps" not in given:
        t.steps = n_steps
    for k, v in TITAN_RUN_SCHEDULE.items():
        if f"optim.{k}" not in given:
            setattr(cfg.optim, k, v)
    return tcfg, validate(cfg)


def run_titan_suite(opts, n_steps: int) -> dict:
    """Compare jaxmoe with torchtitan's own model of ``opts.titan`` (see the module doc)."""
    from jaxmoe.port.maps.titan_map import to_titan
    from parity.titan_side import TitanSide

    if opts.mesh or opts.force_routing:
        raise UserError("--reference torchtitan runs on one device with natural routing: drop --mesh / --force-routing")
    if opts.dtype not in ("float32", "bfloat16"):
        raise UserError(f"--reference torchtitan: --dtype {opts.dtype} is not float32 or bfloat16")
    if n_steps < 0:
        raise UserError(f"--steps {n_steps}: must be >= 0")
    if opts.packed and n_steps:
        raise UserError("--packed --reference torchtitan compares one forward (flex attention has no CPU "
                        "backward): use --steps 0")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    tcfg, cfg = titan_config(opts, n_steps)
    if cfg.compute.fp8 != "none":  # this runner builds torchtitan without its float8 converter
        raise UserError(f"--reference torchtitan with compute.fp8={cfg.compute.fp8!r}: FP8 parity runs "
                        "against torch_ref (drop --reference torchtitan or the fp8 setting)")
    tol = tolerances_for(cfg.compute.dtype, cfg.optim.optimizer)
    setup_numerics()
    params, buffers = init_weights(cfg, opts.seed, opts.randomize_bias, opts.init_scale)
    tensors = to_titan(cfg, params, buffers)
    bias = to_numpy(buffers["moe"]["expert_bias"]) if buffers.get("moe", {}).get("expert_bias") is not None else None
    batches = make_batches(cfg, max(1, n_steps), opts.seed, packed=opts.packed)
    stock = opts.dtype == "bfloat16"  # torchtitan's own bf16 experts (module doc)
    ts = TitanSide(tcfg.titan, tensors, fp32_experts=not stock, flex=opts.packed)
    js = JaxSide(cfg, params, buffers, namer=to_titan)
    timings["setup"] = time.perf_counter() - t0

    t = time.perf_counter()
    jf = js.forward(batches[0])
    timings["jax_forward"] = time.perf_counter() - t
    t = time.perf_counter()
    tf = ts.forward(batches[0])
    timings["torch_forward"] = time.perf_counter() - t
    checks = Checks()
    routing = compare_routing(cfg, jf["aux"], tf["aux"], bias, tol, checks)
    layer_errors = compare_forward(cfg, jf, tf, tol, checks, routing=routing)  # torchtitan's router: not replayed
    compare_losses(jf["losses"], tf["losses"], tol, checks, keys=("ce", "loss"))

    grad_worst: dict = {}
    curves, notes = None, list(tcfg.notes)
    if opts.packed:
        notes.append("packed documents: torchtitan's flex block-causal forward only (no CPU backward)")
    else:
        t = time.perf_counter()
        jg = js.grads(batches[0])
        timings["jax_grads"] = time.perf_counter() - t
        t = time.perf_counter()
        tg = ts.grads(batches[0])
        timings["torch_grads"] = time.perf_counter() - t
        grad_worst = compare_named("grad", jg, tg, tol.grad_rel_l2, checks, "backward")
        del jg, tg  # two model-sized copies freed before training (qwen3's 316M parameters: 2.5 GB)
    del jf
    if stock:
        notes.append("bf16 profile: torchtitan's stock experts (bf16 grouped_mm, the rest fp32) against jaxmoe's "
                     "bf16 compute; gated at bf16 resolution, gradients and steps reported as figures")
    forced_info = None
    if n_steps > 0:
        titan_bias = any(b.expert_bias_E is not None for b in ts.moe_blocks())
        hook = titan_bias and cfg.moe.use_expert_bias
        if titan_bias and not hook:
            notes.append("torchtitan's expert-bias hook is off in the training run: its bias is not mapped")
        t = time.perf_counter()
        jt = js.train(batches[:n_steps])
        timings["jax_steps"] = time.perf_counter() - t
        t = time.perf_counter()
        tt = ts.train(batches[:n_steps], cfg, bias_hook=hook, moe=cfg.moe)
        timings["torch_steps"] = time.perf_counter() - t
        def rerun(forced):
            jt.clear()  # replaced by the replay: its snapshots go first (qwen3: 1.3 GB per copy)
            return js.train(batches[:n_steps], forced=forced)

        jt, forced_info = force_after_near_tie(cfg, jt, tt, tol, rerun)
        curves = {"jax": jt["losses"], "torch": tt["losses"]}
        params0 = to_titan(cfg, params, None, with_buffers=False)
        compare_steps(cfg, jt, tt, bias, n_steps, tol, checks, params0=params0, forced=forced_info)

    items = checks.items
    return assemble(
        opts.name or f"titan-{opts.titan.replace('/', '-')}-{opts.dtype}" + ("-packed" if opts.packed else ""), items,
        first_divergence=first_divergence(items), routing=routing,
        comparison_routing="natural (torchtitan's router is not replayed)", curves=curves,
        layer_errors=layer_errors, grad_worst=grad_worst, tol=tol, opts=opts, n_steps=n_steps, cfg=cfg,
        timings=timings, t0=t0, reference="torchtitan", titan=opts.titan,
        forced_from_step=forced_info and forced_info["forced_from_step"], forced_routing=forced_info,
        strict_fraction=strict_fraction(items),
        titan_overrides=list(opts.titan_overrides), notes=notes,
        decisiveness=decisiveness(cfg, tf["logits"], tf["aux"]["router"]["scores"], bias),
        init_scale=opts.init_scale)


__all__ = ["TITAN_RUN_SCHEDULE", "run_titan_suite", "titan_config"]
