"""``jaxmoe plan``: will this preset's train step fit on this mesh? (a contract: flags, JSON fields)

::

    jaxmoe plan --preset NAME --mesh SPEC [--optimizer adamw|muon] [--remat POLICY]
                [--offload-optimizer] [--device-memory GB] [--host-memory GB]
                [--tokens-per-device N] [--lower] [--json]

Everything per device is derived from the real declarations and the one rules table, without
allocating anything: parameter shapes (``abstract_params``), their PartitionSpecs
(:func:`jaxmoe.parallel.sharding.param_specs`), the optimizer state's shapes (``jax.eval_shape`` of the real
optax ``init``) sharded like their parameters. Activations and dispatch buffers are analytic
(:func:`activation_bytes`, :func:`dispatch_bytes`), from the token count, the remat policy and the
compute dtype. ``--lower`` (:mod:`jaxmoe.plan.lower`) traces and lowers the real train step on an
abstract mesh of that shape and counts the optimizer update's collectives in a partitioned module.

``replicated_dense_fraction``: the fraction of the dense (non-routed-expert) parameters that no
mesh axis shards, i.e. that every device of a replica holds whole. A layout above
:data:`MAX_REPLICATED_DENSE` or one whose experts are not whole on each device is listed under
``layout_problems``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import jax
from jax.sharding import PartitionSpec as P

from jaxmoe.config import Config, load_config
from jaxmoe.config.autoconf import resolve_auto
from jaxmoe.config.counting import count_params, flops_per_token, human
from jaxmoe.errors import UserError
from jaxmoe.model.blocked import RUN_ROWS
from jaxmoe.model.transformer import abstract_params, declared_groups
from jaxmoe.parallel.expert_dispatch import receive_rows, resolve_dispatcher
from jaxmoe.parallel.mesh import parse_mesh, validate_mesh
from jaxmoe.parallel.sharding import AXES, BATCH_AXES, declared_axes_flat, expert_axes_of, matched_specs, param_specs
from jaxmoe.train.optim import build_optimizer
from jaxmoe.trees import key_path_str

MAX_REPLICATED_DENSE = 0.05  # a layout replicating more of the dense weights is reported
GB = 1e9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# --------------------------------------------------------------------------------------------
# Configuration for the plan
# --------------------------------------------------------------------------------------------


def plan_config(cfg: Config, sizes: dict, *, optimizer=None, remat=None, tokens_per_device=None,
                offload_optimizer=False) -> Config:
    """``cfg`` with the mesh, optimizer, remat and batch the plan is for (validated: one-line
    UserErrors for a mesh that cannot run it)."""

    if any(v == -1 for v in sizes.values()):
        raise UserError("jaxmoe plan: give every mesh axis a size (no -1: there are no devices to fill it from)")
    mesh = dataclasses.replace(cfg.mesh, **{a: sizes[a] for a in AXES})
    train, optim, compute = cfg.train, cfg.optim, cfg.compute
    if optimizer:
        optim = dataclasses.replace(optim, optimizer=optimizer)
    if remat:
        compute = dataclasses.replace(compute, remat=remat)
    nb = math.prod(sizes[a] for a in BATCH_AXES)
    if tokens_per_device is not None:
        if tokens_per_device <= 0 or tokens_per_device % train.seq_len:
            raise UserError(
                f"--tokens-per-device {tokens_per_device} must be a positive multiple of train.seq_len="
                f"{train.seq_len} (whole sequences per device)"
            )
        train = dataclasses.replace(train, batch_size=tokens_per_device // train.seq_len * nb * train.micro_batches)
    optim = dataclasses.replace(optim, offload_optimizer=bool(offload_optimizer))
    cfg = cfg.replace(mesh=mesh, train=train, optim=optim, compute=compute)
    validate_mesh(cfg, sizes)
    return cfg


def tokens_per_device(cfg: Config) -> int:
    nb = math.prod(getattr(cfg.mesh, a) for a in BATCH_AXES)
    return cfg.train.batch_size // cfg.train.micro_batches * cfg.train.seq_len // nb


# --------------------------------------------------------------------------------------------
# Per-device bytes of the state (exact: shapes and specs)
# --------------------------------------------------------------------------------------------


def _shards(spec, sizes) -> int:
    n = 1
    for ax in spec:
        for a in (() if ax is None else (ax if isinstance(ax, tuple) else (ax,))):
            n *= sizes[a]
    return n


def _is_expert(path: str) -> bool:
    return "/experts/" in f"/{path}/"


def state_bytes(cfg: Config) -> dict:
    """Per-device bytes of params / buffers / optimizer state (split expert/dense), the
    replicated-dense statistics and the per-leaf table, from shapes and specs only."""
    sizes = {a: getattr(cfg.mesh, a) for a in AXES}
    ea = expert_axes_of(cfg.mesh.expert_axes)
    params, buffers = abstract_params(cfg)
    axes = declared_axes_flat(cfg)
    rep: list = []
    pspecs = param_specs(params, axes, sizes, rep, ea)
    bspecs = param_specs(buffers, axes, sizes, None, ea)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    opt = jax.eval_shape(tx.init, params)
    ospecs = matched_specs(opt, params, pspecs)
    isP = lambda x: isinstance(x, P)  # noqa: E731

    def table(tree, specs):
        out = []
        for (kp, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(tree),
                                    jax.tree_util.tree_leaves(specs, is_leaf=isP)):
            n = math.prod(leaf.shape) * leaf.dtype.itemsize
            out.append((key_path_str(kp), tuple(leaf.shape), spec, n, n // _shards(spec, sizes)))
        return out

    pt, bt, ot = table(params, pspecs), table(buffers, bspecs), table(opt, ospecs)
    dense = [r for r in pt if not _is_expert(r[0])]
    dense_total = sum(r[3] for r in dense)
    dense_whole = sum(r[3] for r in dense if _shards(r[2], sizes) == 1)
    experts = [r for r in pt if _is_expert(r[0])]
    n_ep = math.prod(sizes[a] for a in ea)
    whole = all(r[2][1] is not None and _shards(r[2], sizes) == n_ep for r in experts)
    return {
        "sizes": sizes,
        "expert_axes": ea,
        "params": {"expert": sum(r[4] for r in experts), "dense": sum(r[4] for r in dense)},
        "buffers": sum(r[4] for r in bt),
        "optimizer_state": {"expert": sum(r[4] for r in ot if _is_expert(r[0])),
                            "dense": sum(r[4] for r in ot if not _is_expert(r[0]))},
        "replicated_dense_fraction": dense_whole / max(dense_total, 1),
        "dense_per_device_fraction": sum(r[4] for r in dense) / max(dense_total, 1),
        "experts_whole": whole,
        "replicated_leaves": sorted(set(rep)),
        "largest_dense_per_device": sorted(((r[4], r[0]) for r in dense), reverse=True)[:5],
        "max_dense_layer_bytes": _one_layer_dense_bytes(pt),
    }


def _one_layer_dense_bytes(pt) -> int:
    """Bytes of one layer's dense weights when gathered whole (FSDP all-gather inside the scan),
    the largest of the stacked groups (dense/, moe/ without experts), plus embed/lm_head."""
    per = {}
    for path, shape, _spec, n, _ in pt:
        top = path.split("/")[0]
        if top in ("dense", "moe") and not _is_expert(path):
            per[top] = per.get(top, 0) + n // shape[0]
    return max(per.values(), default=0)


# --------------------------------------------------------------------------------------------
# Analytic activations and dispatch buffers
# --------------------------------------------------------------------------------------------


def _attn_widths(m) -> list[int]:
    """Output widths of one layer's attention matmuls (per token)."""
    if m.attention == "gqa":
        return [m.n_heads * m.head_dim, 2 * m.n_kv_heads * m.head_dim, m.n_heads * m.head_dim, m.d_model]
    qh = m.qk_nope_head_dim + m.qk_rope_head_dim
    w = [m.q_lora_rank, m.n_heads * qh] if m.q_lora_rank else [m.n_heads * qh]
    return w + [m.kv_lora_rank + m.qk_rope_head_dim, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                m.n_heads * m.v_head_dim, m.d_model]


def recv_rows(cfg: Config, t: int) -> int:
    """Rows the expert FFN runs on per device and MoE layer: the receive buffer
    (:func:`jaxmoe.parallel.expert_dispatch.receive_rows`) of the dispatcher the trainer would pick on a GPU
    (:func:`jaxmoe.parallel.expert_dispatch.resolve_dispatcher`), padded to whole blocks on the blocked path."""
    e = cfg.moe
    n_x = math.prod(getattr(cfg.mesh, a) for a in expert_axes_of(cfg.mesh.expert_axes))
    kind = resolve_dispatcher(cfg, platform="gpu")
    rows = receive_rows(kind, e, n_x, t, cfg.mesh.a2a_capacity_factor)
    path = resolve_auto(cfg, "gpu").moe.compute_path  # auto: what a GPU run picks
    return rows + (e.n_experts // n_x * e.block_size if path == "blocked" else 0)


def _layer_saved(cfg: Config, t: int, moe: bool, with_experts: bool = True) -> int:
    """Bytes one layer keeps for its backward without remat: inputs of the norms, every attention
    matmul output, the attention scores and probabilities ([B, H, S, S] fp32), the FFN
    intermediates (MoE: gate/up on the received rows and the received rows themselves)."""
    m, e = cfg.model, cfg.moe
    b = _DTYPE_BYTES[cfg.compute.dtype]
    s = cfg.train.seq_len
    widths = 2 * m.d_model + sum(_attn_widths(m))
    scores = 2 * (t // s) * m.n_heads * s * s * 4
    if moe:
        ffn = t * (e.n_experts * 4 // b + m.d_model + e.n_shared_experts * 2 * e.expert_ffn_dim)
        if with_experts:
            ffn += recv_rows(cfg, t) * (2 * e.expert_ffn_dim + m.d_model)
    else:
        ffn = t * (2 * m.dense_ffn_dim + m.d_model)
    return (t * widths + ffn) * b + scores


def activation_bytes(cfg: Config, t: int) -> dict:
    """Activations per device by memory space for ``t`` tokens per micro-batch: what the
    backward keeps (by ``compute.remat``), one layer's working set (its expert part is counted in
    :func:`dispatch_bytes`), and the loss's fp32 logits."""
    m = cfg.model
    b = _DTYPE_BYTES[cfg.compute.dtype]
    mode = cfg.compute.remat
    ld, lm = m.first_k_dense, m.n_moe_layers
    carry = (ld + lm) * t * m.d_model * b  # the scan's saved layer inputs
    # One layer's working set in the backward. Without remat its residuals are already in `saved`
    # and the backward adds their cotangents (1x the layer's saved set). With remat (full,
    # save_dots, offload) the layer's forward is recomputed inside the backward scan body and
    # XLA keeps the recomputed residuals *and* the cotangents flowing through them live together
    # (2x): XLA:CPU's live-range dump at the peak (tiny-mla, remat full) shows the recomputed
    # attention scores/softmax and matmul outputs beside their gradients in that loop body.
    # Its expert part is counted in :func:`dispatch_bytes`.
    per_layer = max(_layer_saved(cfg, t, False) if ld else 0, _layer_saved(cfg, t, True, False) if lm else 0)
    work = per_layer * (1 if mode == "none" else 2)
    host = 0
    if mode == "none":
        saved = ld * _layer_saved(cfg, t, False) + lm * _layer_saved(cfg, t, True) + carry
    elif mode == "save_dots":  # matmul outputs: attention, dense FFN, experts on received rows
        e = cfg.moe
        saved = (ld + lm) * t * sum(_attn_widths(m)) * b + carry
        saved += ld * t * 2 * m.dense_ffn_dim * b + lm * recv_rows(cfg, t) * 2 * e.expert_ffn_dim * b
    else:  # full, offload: only layer inputs kept (offload: attn_out, ffn_out on the host too)
        saved = carry
        if mode == "offload":
            host = 2 * (ld + lm) * t * m.d_model * b
    logits = t * m.vocab_size * (4 * 2 + b)  # fp32 logits and their gradient, the compute copy
    return {"device": saved + work + logits, "pinned_host": host}


def dispatch_bytes(cfg: Config, t: int) -> int:
    """One MoE layer's expert-parallel working set per device at the step's peak, the backward of
    that layer: 6 buffers of R rows of D (R = :func:`recv_rows`) and 2 of R rows of I.

    This is what XLA keeps live there (XLA:CPU's live-range dump at the peak, ``--xla_dump_to``
    ``*-live-range.txt`` "Stack trace breakdown for peak usage", tiny and tiny-mla on
    fsdp=2,expert=4 with remat full, all_to_all dispatcher): from the layer's forward
    (recomputed under remat) the zero-filled send buffer and its scatter-add ``[E*C, D]`` and two
    copies of ``[E*C, D]`` row buffers that XLA inserts around the all_to_alls and the gathers;
    from the backward the zero-filled cotangent buffer and its scatter-add; and about two
    ``[R, I]`` buffers of the expert FFN (the blocked path's gate/up pre-activation and the
    activated rows; their gradients exist one run of rows at a time). The previous model (4 R x D
    + 4 R x I) matched tiny (I = D) by coincidence and under-counted tiny-mla (I = D/2).

    The blocked path adds one run's working set, modelled as ``min(RUN_ROWS, R)`` rows of
    ``2 D + 2 I`` (the gathered x and dy rows, the run's gate/up gradient): XLA's peak grew by
    387 (tiny, remat none) and 354 (tiny-mla, remat full) floats per row when runs went from 256
    to 512 rows (fsdp=2,expert=4), part of which the terms above already cover; with this term
    the planner is within 0.94-1.06 of XLA on the cases of tests/test_plan.py that were rerun."""
    m, e = cfg.model, cfg.moe
    if not m.n_moe_layers:
        return 0
    b = _DTYPE_BYTES[cfg.compute.dtype]
    r = recv_rows(cfg, t)
    blocked = resolve_auto(cfg, "gpu").moe.compute_path == "blocked"
    run = min(RUN_ROWS, r) * (2 * m.d_model + 2 * e.expert_ffn_dim) if blocked else 0
    return (r * (6 * m.d_model + 2 * e.expert_ffn_dim) + run) * b


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def make_plan(cfg: Config, *, offload_optimizer=False, device_memory_gb=96.0, host_memory_gb=None,
              lower=False) -> dict:
    """The planner's JSON (see the module doc and the README's "Planning a run")."""
    counts = count_params(cfg)
    st = state_bytes(cfg)
    t = tokens_per_device(cfg)
    p_exp, p_dense = st["params"]["expert"], st["params"]["dense"]
    params = p_exp + p_dense + st["buffers"]
    opt = st["optimizer_state"]["expert"] + st["optimizer_state"]["dense"]
    act = activation_bytes(cfg, t)
    acc = 2 if cfg.train.micro_batches > 1 else 1
    opt_space = "pinned_host" if offload_optimizer else "device"
    per = {
        "params": {"device": params, "pinned_host": 0},
        "grads": {"device": acc * (p_exp + p_dense), "pinned_host": 0},
        "optimizer_state": {"device": 0, "pinned_host": 0},
        # the update (fp32, like the params) and one layer's dense weights gathered whole (FSDP)
        "optimizer_update": {"device": p_exp + p_dense, "pinned_host": 0},
        "gathered_weights": {"device": 2 * st["max_dense_layer_bytes"], "pinned_host": 0},
        "dispatch_buffers": {"device": dispatch_bytes(cfg, t), "pinned_host": 0},
        "activations": act,
    }
    per["optimizer_state"][opt_space] = opt
    if offload_optimizer:  # streamed to the device for the update: one layer's worth at a time
        per["optimizer_state"]["device"] = 0
    total = {s: sum(v[s] for v in per.values()) for s in ("device", "pinned_host")}
    cap = {"device": device_memory_gb * GB, "pinned_host": (host_memory_gb or 0) * GB}
    fits_by = {s: total[s] <= cap[s] for s in cap}
    over = []
    for s in cap:
        if not fits_by[s]:
            contrib = sorted(((v[s], k) for k, v in per.items() if v[s]), reverse=True)[:3]
            over.append({"memory_space": s, "need_bytes": total[s], "have_bytes": int(cap[s]),
                         "largest": [{"kind": k, "bytes": n} for n, k in contrib]})
    problems = []
    if cfg.model.n_moe_layers and not st["experts_whole"]:
        problems.append(f"experts are not whole on each device (sharded beyond the expert-parallel axes "
                        f"{'*'.join(st['expert_axes'])}); set mesh.expert_axes='fsdp,expert'")
    if st["replicated_dense_fraction"] > MAX_REPLICATED_DENSE:
        problems.append(
            f"{st['replicated_dense_fraction']:.1%} of the dense weights are replicated on every device "
            f"(> {MAX_REPLICATED_DENSE:.0%}): no mesh axis divides their dims; factor the mesh so that an "
            f"fsdp size divides d_model={cfg.model.d_model}")
    out = {
        "preset": cfg.model.name,
        "mesh": st["sizes"],
        "expert_axes": list(st["expert_axes"]),
        "optimizer": cfg.optim.optimizer,
        "remat": cfg.compute.remat,
        "dtype": cfg.compute.dtype,
        "offload_optimizer": bool(offload_optimizer),
        "tokens_per_device": t,
        "dispatcher": cfg.mesh.dispatcher,
        "a2a_capacity_factor": cfg.mesh.a2a_capacity_factor,
        "total_params": counts["total_params"],
        "active_params": counts["active_params"],
        "flops_per_token": flops_per_token(cfg),
        "per_device": per,
        "per_device_total": total,
        "memory_limits_bytes": {s: int(v) for s, v in cap.items()},
        "fits": all(fits_by.values()),
        "does_not_fit": over,
        "replicated_dense_fraction": st["replicated_dense_fraction"],
        "dense_per_device_fraction": st["dense_per_device_fraction"],
        "experts_whole": st["experts_whole"],
        "layout_problems": problems,
        "replicated_leaves": st["replicated_leaves"],
        "lowered": False,
        "optimizer_update_collectives": None,
        "method": "params/optimizer state: exact shapes and rule-derived specs; activations and "
                  "dispatch buffers: analytic (jaxmoe/plan/memory.py activation_bytes, dispatch_bytes)",
    }
    if lower:
        from jaxmoe.plan import lower as plan_lower

        out.update(plan_lower.lower_report(cfg))
    return out


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxmoe.config.cli import add_config_args

    add_config_args(p)
    p.add_argument("--mesh", required=True, help="mesh sizes, e.g. replica=4,fsdp=128,expert=3")
    p.add_argument("--optimizer", choices=["adamw", "muon"], help="default: the config's")
    p.add_argument("--remat", choices=["none", "full", "save_dots", "offload"], help="default: the config's")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer state in pinned_host memory")
    p.add_argument("--device-memory", type=float, default=96.0, metavar="GB", help="per device (default 96)")
    p.add_argument("--host-memory", type=float, default=0.0, metavar="GB",
                   help="pinned host memory per device (default 0)")
    p.add_argument("--tokens-per-device", type=int, metavar="N", help="tokens per device per micro-batch")
    p.add_argument("--lower", action="store_true",
                   help="also trace and lower the real train step on an abstract mesh of this shape")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    if args.lower:
        # the optimizer update's collectives are counted in a module compiled on 8 CPU devices;
        # XLA reads the flag when the first backend starts (jax.devices()), which the CLI has not
        # done yet
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if not args.preset and not args.config:
        raise UserError("jaxmoe plan: give --preset NAME (or --config FILE)")
    cfg = load_config(preset=args.preset, path=args.config, overrides=args.overrides)
    for flag, v in (("--device-memory", args.device_memory), ("--host-memory", args.host_memory)):
        if v < 0:
            raise UserError(f"{flag} {v}: must be >= 0 GB")
    cfg = plan_config(cfg, parse_mesh(args.mesh), optimizer=args.optimizer, remat=args.remat,
                      tokens_per_device=args.tokens_per_device, offload_optimizer=args.offload_optimizer)
    out = make_plan(cfg, offload_optimizer=args.offload_optimizer, device_memory_gb=args.device_memory,
                    host_memory_gb=args.host_memory, lower=args.lower)
    print(json.dumps(out, indent=2, default=str) if args.json else render(out))
    return 0


def render(p: dict) -> str:
    g = lambda n: f"{n / GB:8.2f} GB"  # noqa: E731
    mesh = ",".join(f"{a}={v}" for a, v in p["mesh"].items() if v != 1)
    lines = [
        f"{p['preset']} on {mesh} (experts over {'*'.join(p['expert_axes'])}), {p['optimizer']}, remat "
        f"{p['remat']}, {p['dtype']}, {p['tokens_per_device']} tokens/device",
        f"  params {human(p['total_params'])} total, {human(p['active_params'])} active; "
        f"{p['flops_per_token']:.3e} training FLOPs/token",
        f"  per device {'':24s}{'device':>11s} {'pinned_host':>11s}",
    ]
    for k, v in p["per_device"].items():
        lines.append(f"    {k:26s}{g(v['device'])} {g(v['pinned_host'])}")
    t = p["per_device_total"]
    lim = p["memory_limits_bytes"]
    lines.append(f"    {'total':26s}{g(t['device'])} {g(t['pinned_host'])}")
    lines.append(f"    {'available':26s}{g(lim['device'])} {g(lim['pinned_host'])}")
    lines.append(f"  replicated dense weights: {p['replicated_dense_fraction']:.2%}; experts whole per "
                 f"device: {p['experts_whole']}")
    for prob in p["layout_problems"]:
        lines.append(f"  layout problem: {prob}")
    lines.append(f"  fits: {'yes' if p['fits'] else 'NO'}")
    for o in p["does_not_fit"]:
        big = ", ".join(f"{c['kind']} {c['bytes'] / GB:.1f} GB" for c in o["largest"])
        lines.append(f"    {o['memory_space']}: needs {o['need_bytes'] / GB:.1f} GB of "
                     f"{o['have_bytes'] / GB:.1f} GB; largest: {big}")
    if p["lowered"]:
        lines.append(f"  lowered: yes ({p['lowering']['platform']}, {p['lowering']['seconds']:.0f} s)")
        c = p["optimizer_update_collectives"]
        lines.append(f"  optimizer update collectives ({c['module']}): expert {c['expert']['ops']} ops "
                     f"{c['expert']['bytes']} B, dense {c['dense']['ops']} ops {c['dense']['bytes']} B")
    return "\n".join(lines)


__all__ = ["MAX_REPLICATED_DENSE", "activation_bytes", "dispatch_bytes", "make_plan", "plan_config", "state_bytes"]
