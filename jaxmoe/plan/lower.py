"""``jaxmoe plan --lower``: the real train step traced and lowered on an abstract mesh, and the
optimizer update's collectives counted in a partitioned (compiled) module.

Lowering without devices (jax 0.10.2 API, checked here): a ``jax.sharding.AbstractMesh`` with the
plan's axis sizes, ``jax.ShapeDtypeStruct`` inputs carrying ``NamedSharding(abstract_mesh, spec)``,
then ``jax.jit(step).trace(state, batch).lower(lowering_platforms=("cuda",))``: a StableHLO module
for the GPU backend, produced on a CPU-only machine with nothing allocated. It is *not*
partitioned (SPMD partitioning happens in XLA's compile, which needs the target devices), so the
per-device shapes reported are each input's ``sharding.shard_shape`` and XLA's
``memory_analysis()`` is reported only where the backend can compile it (a GPU process with the
mesh's devices).

Collectives of the optimizer update are therefore counted in a module XLA *did* partition: the
update (``tx.update`` of the config's optimizer) compiled by XLA:CPU on at most 8 devices
(:func:`reduced_config`: the same architecture at full width with one dense and one MoE layer, a
small vocabulary, the same number of experts per device, and each mesh axis reduced to the
product of its distinct prime factors, e.g. fsdp=128 -> 2, expert=3 -> 3), once for the
routed-expert leaves and once for the dense ones (gradient clipping off in both: its global norm
is one scalar all-reduce, reported as ``clip``). The JSON says which module the counts came from
(``module``), and lists the leaves whose reduced PartitionSpec differs from the full-size one
(``spec_differences``; e.g. a dim that fsdp=2 divides but fsdp=128 does not).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.config import Config
from jaxmoe.config.autoconf import resolve_auto
from jaxmoe.model.transformer import Model, abstract_params, declared_groups
from jaxmoe.parallel import expert_dispatch as dispatch_mod
from jaxmoe.parallel.sharding import (
    AXES,
    declared_axes_flat,
    expert_axes_of,
    logical_to_mesh_axes,
    matched_specs,
    param_specs,
)
from jaxmoe.plan.hlo_stats import count_collectives as hlo_collectives
from jaxmoe.plan.hlo_stats import optimizer_update_collectives as update_collectives
from jaxmoe.plan.hlo_stats import total
from jaxmoe.train.objective import PACKING_KEYS
from jaxmoe.train.optim import build_optimizer
from jaxmoe.train.step import init_state, make_train_step
from jaxmoe.trees import key_path_str

_ISP = lambda x: isinstance(x, P)  # noqa: E731


def _sizes(cfg: Config) -> dict:
    return {a: getattr(cfg.mesh, a) for a in AXES}


def state_specs(cfg: Config, state: dict) -> dict:
    """The train state's PartitionSpecs (as MeshContext.state_specs, without a concrete mesh)."""
    sizes, ea = _sizes(cfg), expert_axes_of(cfg.mesh.expert_axes)
    axes = declared_axes_flat(cfg)
    ps = param_specs(state["params"], axes, sizes, None, ea)
    out = {"params": ps, "buffers": param_specs(state["buffers"], axes, sizes, None, ea),
           "opt_state": matched_specs(state["opt_state"], state["params"], ps)}
    for k, v in state.items():
        out.setdefault(k, jax.tree.map(lambda _: P(), v))
    return out


def abstract_inputs(cfg: Config, mesh):
    """``(tx, state, batch)``: ShapeDtypeStructs with NamedShardings on ``mesh`` (abstract or not)."""
    params, buffers = abstract_params(cfg)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    state = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
    specs = state_specs(cfg, state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                         state, specs, is_leaf=_ISP)
    b, s = cfg.train.batch_size // cfg.train.micro_batches * cfg.train.micro_batches, cfg.train.seq_len
    bs = NamedSharding(mesh, logical_to_mesh_axes(("batch", None)))
    batch = {"inputs": jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=bs),
             "targets": jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=bs),
             "mask": jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=bs)}
    if cfg.data.packing == "documents":  # the data then carries the document keys (jaxmoe.data.packing)
        batch.update({k: jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=bs) for k in PACKING_KEYS})
    return tx, state, batch


def lower_abstract(cfg: Config, platform: str = "cuda"):
    """``(lowered, abstract state, dispatcher)``: the real train step traced on an abstract mesh
    of the config's shape and lowered for ``platform`` (``lowered.as_text()`` is its StableHLO);
    nothing allocated, no device of that platform needed. ``auto`` fields take the target
    platform's values (:func:`jaxmoe.config.autoconf.resolve_auto`), not this host's."""
    cfg = resolve_auto(cfg, platform)
    sizes = _sizes(cfg)
    mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    tx, state, batch = abstract_inputs(cfg, mesh)
    kind = dispatch_mod.resolve_dispatcher(cfg, platform="gpu" if platform in ("cuda", "rocm") else platform)
    step = make_train_step(Model(cfg, dispatch_mod.make_dispatch(cfg, mesh, kind)), tx, donate=True)
    return step.trace(state, batch).lower(lowering_platforms=(platform,)), state, kind


def lower_train_step(cfg: Config, platform: str = "cuda") -> dict:
    """Trace and lower the real train step for ``platform`` on an abstract mesh of the config's
    shape; per-device input shapes from the shardings; memory_analysis when compilable here."""
    t0 = time.perf_counter()
    cfg = resolve_auto(cfg, platform)  # `auto` fields: the target platform's values, not this host's
    sizes = _sizes(cfg)
    lowered, state, kind = lower_abstract(cfg, platform)
    text = lowered.as_text()
    leaves = []
    for kp, x in jax.tree_util.tree_leaves_with_path(state):
        shard = x.sharding.shard_shape(x.shape)
        leaves.append((math.prod(shard) * x.dtype.itemsize, key_path_str(kp), list(x.shape), list(shard)))
    leaves.sort(reverse=True)
    mem = None
    backend = jax.default_backend()
    if backend == "gpu" and platform in ("cuda", "rocm") and jax.device_count() == math.prod(sizes.values()):
        ma = lowered.compile().memory_analysis()  # only where this process holds the mesh's devices
        mem = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                  "temp_size_in_bytes", "alias_size_in_bytes")}
    return {
        "lowered": True,
        "lowering": {
            "platform": platform,
            "dispatcher": kind,
            "seconds": round(time.perf_counter() - t0, 1),
            "stablehlo_chars": len(text),
            "state_bytes_per_device": sum(n for n, *_ in leaves),
            "largest_per_device_inputs": [{"path": p, "global_shape": g, "per_device_shape": s, "bytes": n}
                                          for n, p, g, s in leaves[:8]],
            "memory_analysis": mem,
            "memory_analysis_note": None if mem else
            f"not compiled: this process's backend is {backend} with {jax.device_count()} device(s); "
            "the lowered module targets the mesh's devices",
        },
    }


# --------------------------------------------------------------------------------------------
# Collectives of the optimizer update, in a partitioned module
# --------------------------------------------------------------------------------------------

def count_collectives(hlo_text: str) -> dict:
    """The planner's summary of :func:`jaxmoe.plan.hlo_stats.count_collectives`: ``{"ops", "bytes",
    "by_kind": {op: count}}`` for a compiled module's text."""
    return count_collectives_summary(hlo_collectives(hlo_text))


def count_collectives_summary(stats: dict) -> dict:
    ops, nbytes = total(stats)
    return {"ops": ops, "bytes": nbytes, "by_kind": {k: v["count"] for k, v in stats.items()}}


def _radical(n: int) -> int:
    out, p = 1, 2
    while n > 1:
        if n % p == 0:
            out *= p
            while n % p == 0:
                n //= p
        p += 1
    return out


def _reduced_sizes(sizes: dict, n_devices: int = 8) -> dict:
    """Each live axis other than ``replica`` reduced to the product of its distinct prime factors
    (128 -> 2, 3 -> 3, 384 -> 6), so a dim that one axis divides at full size is divided by it at
    reduced size; halved further (largest first) while the product exceeds ``n_devices``."""
    out = {a: 1 for a in AXES}
    for a in ("fsdp", "expert", "tensor"):
        out[a] = _radical(sizes[a])
    while math.prod(out.values()) > n_devices:
        a = max(("fsdp", "expert", "tensor"), key=lambda k: out[k])
        out[a] = max(1, out[a] // 2)
    return out


def _spec_table(c: Config) -> dict:
    s = _sizes(c)
    p = abstract_params(c)[0]
    sp = jax.tree.leaves(param_specs(p, declared_axes_flat(c), s, None, expert_axes_of(c.mesh.expert_axes)),
                         is_leaf=_ISP)
    return {key_path_str(kp): q for (kp, _), q in zip(jax.tree_util.tree_leaves_with_path(p), sp)}


def reduced_config(cfg: Config, n_devices: int = 8) -> tuple[Config, list]:
    """The same architecture at full width with 1 dense + 1 MoE layer, the experts of the
    reduced expert-parallel devices (the same number per device), a small vocabulary, on a mesh
    of at most ``n_devices`` (:func:`_reduced_sizes`). Returns it and the leaves whose
    PartitionSpec differs from the full-size one (a dim that e.g. fsdp=2 divides but fsdp=128
    does not)."""
    sizes = _sizes(cfg)
    red = _reduced_sizes(sizes, n_devices)
    m, e = cfg.model, cfg.moe
    ea = expert_axes_of(cfg.mesh.expert_axes)
    e_l = e.n_experts // math.prod(sizes[a] for a in ea)
    n_exp = e_l * math.prod(red[a] for a in ea)
    shape = dict(n_layers=min(m.first_k_dense, 1) + (1 if m.n_moe_layers else 0), first_k_dense=min(m.first_k_dense, 1))
    # vocab: the smallest multiple of 64 with the full vocab's divisibility by the reduced axes
    vocab = next(v for v in range(64, 64 * 1000, 64)
                 if all((v % red[a] == 0) == (m.vocab_size % sizes[a] == 0) for a in AXES))
    small = cfg.replace(model=dataclasses.replace(m, vocab_size=vocab, **shape),
                        moe=dataclasses.replace(e, n_experts=n_exp, top_k=min(e.top_k, n_exp), n_groups=1,
                                                topk_groups=1),
                        mesh=dataclasses.replace(cfg.mesh, **red))
    full = _spec_table(cfg.replace(model=dataclasses.replace(m, **shape)))
    diff = [f"{k}: {full[k]} at full size, {q} reduced" for k, q in _spec_table(small).items()
            if not k.startswith(("embed", "lm_head")) and q != full[k]]
    return small, diff


def optimizer_update_collectives(cfg: Config) -> dict:
    """Collective ops and bytes of the optimizer update, routed-expert leaves vs dense leaves,
    counted in the partitioned module compiled on 8 CPU devices at reduced width."""
    from jaxmoe.parallel.mesh import make_mesh

    if jax.device_count() < 8:
        return {"module": None, "note": f"needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                                        f"this process has {jax.device_count()}", "expert": None, "dense": None}
    small, diff = reduced_config(cfg)
    sizes = _sizes(small)
    mesh = make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
    res = update_collectives(small, mesh)  # expert vs dense leaves, each compiled on its own
    out = {part: count_collectives_summary(res[part]) for part in ("expert", "dense")}
    desc = ",".join(f"{a}={v}" for a, v in sizes.items() if v > 1) or "1 device"
    out["module"] = (f"tx.update ({small.optim.optimizer}, muon_placement={small.optim.muon_placement}) "
                     f"compiled by XLA:CPU on {math.prod(sizes.values())} "
                     f"devices, mesh {desc}, full width, {small.model.n_layers} layers, {small.moe.n_experts} "
                     f"experts, vocab {small.model.vocab_size}, "
                     "after SPMD partitioning; expert and dense leaves compiled separately, clipping off")
    out["same_specs"] = not diff
    out["spec_differences"] = diff
    out["clip"] = {"ops": 1, "note": "gradient clipping's global norm: one scalar all-reduce"}
    return out


def comm_per_step(cfg: Config) -> dict:
    """``comm_bytes_per_step`` (``{axes: bytes}``, per device) and ``comm_collectives`` (``{axes:
    {op: {"count", "bytes"}}}``) of the real train step compiled (SPMD-partitioned) by this
    process's backend on the config's mesh (:func:`compile_on_local_devices`), each collective
    under the mesh axes its replica groups span (``"expert+fsdp"`` for a group over both) and
    counted as often as it runs per step (scan trip counts). Needs as many local devices as the
    mesh has (fake CPU devices do: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``);
    otherwise both are None and ``comm_note`` says why. The dispatcher and kernels are this
    backend's (``auto`` resolves for it), which a GPU run may choose differently."""
    from jaxmoe.plan.hlo_stats import comm_bytes_by_axis

    sizes = _sizes(cfg)
    n = math.prod(sizes.values())
    if jax.device_count() < n:
        return {"comm_bytes_per_step": None, "comm_collectives": None,
                "comm_note": f"not counted: the mesh has {n} devices and this process {jax.device_count()} "
                             f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})"}
    by_axis = comm_bytes_by_axis(compile_on_local_devices(resolve_auto(cfg, jax.default_backend())).as_text(), sizes)
    return {"comm_bytes_per_step": {a: sum(r["bytes"] for r in ops.values()) for a, ops in by_axis.items()
                                    if a != "none"},  # groups of one device move nothing
            "comm_collectives": by_axis,
            "comm_note": f"bytes per device per step (each op's larger of operand and result), from the train "
                         f"step compiled by XLA:{jax.default_backend().upper()} on {n} devices, loop trip "
                         "counts applied; keys: the mesh axes each collective's groups span"}


def lower_report(cfg: Config) -> dict:
    out = lower_train_step(cfg)
    out["optimizer_update_collectives"] = optimizer_update_collectives(cfg)
    out.update(comm_per_step(cfg))
    return out


__all__ = ["comm_per_step", "compile_on_local_devices", "compiled_memory", "count_collectives", "lower_abstract",
           "lower_report",
           "lower_train_step", "optimizer_update_collectives", "reduced_config"]


_FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_on_local_devices(cfg: Config, compiler_options: dict | None = None):
    """The real train step compiled (``jax.stages.Compiled``) for this process's devices on the
    config's mesh (a concrete mesh: e.g. 8 fake CPU devices for a small preset), nothing run.
    Buffer assignment (what ``memory_analysis`` reports) is decided by XLA's HLO passes; the LLVM
    code generation after it does not change it, so it runs unoptimised by default: less
    compile time, identical figures (checked on tiny muon/none: same argument/output/alias/temp
    bytes)."""
    from jaxmoe.parallel.mesh import make_mesh

    sizes = _sizes(cfg)
    mesh = make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
    tx, state, batch = abstract_inputs(cfg, mesh)
    kind = dispatch_mod.resolve_dispatcher(cfg, platform=jax.default_backend())
    step = make_train_step(Model(cfg, dispatch_mod.make_dispatch(cfg, mesh, kind)), tx, donate=True)
    opts = _FAST_CODEGEN if compiler_options is None else compiler_options
    return step.lower(state, batch).compile(compiler_options=opts)


def compiled_memory(cfg: Config) -> dict:
    """XLA's memory_analysis() of the real train step compiled for this process's devices on the
    config's mesh (:func:`compile_on_local_devices`)."""
    ma = compile_on_local_devices(cfg).memory_analysis()
    out = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                              "temp_size_in_bytes", "alias_size_in_bytes")}
    # peak live bytes of the step: inputs + outputs (donated outputs reuse their inputs) + temps
    out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                         - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out
