"""Mesh layouts on 8 fake CPU devices: step time and collective bytes per step from compiled HLO.

    python bench/mesh.py [--preset tiny] [--batch 8] [--seq 16] [--steps 5] [--layouts ...]

For each mesh layout and dispatcher it compiles ``jaxmoe.train.step.make_train_step`` (AdamW), times
``--steps`` steps after a warm-up step, and reads the optimised HLO of the compiled step:
every ``all-to-all``, ``all-gather``, ``reduce-scatter``, ``all-reduce`` and
``collective-permute`` (sync or ``-start`` async forms), its per-device size, and how often it
runs per step (ops inside a ``while`` body — the layer scan, the micro-batch scan — count
``known_trip_count`` times, nested loops multiply).

Byte convention (per device, per step): the full-size buffer of each op — all-gather: its result;
reduce-scatter / all-reduce / all-to-all / collective-permute: its operand (computed from the
result shape, since optimised HLO prints operands without shapes; reduce-scatter: result x group).

Analytic expectation printed beside it (same convention, fp32):

* dispatcher, per MoE layer per micro-batch, 4 transfers (forward dispatch + return, and their
  transposes in the backward pass) — all_to_all: ``[E * C, D]`` with ``C = T_local`` (dropless
  worst case); allgather: ``[expert * T_local, D]`` (gathered tokens / reduce-scattered outputs);
  0 when the expert axis is 1;
* parameters: a leaf split ``s`` ways over the batch axes is all-gathered (forward) and its
  gradient reduce-scattered (``size`` bytes each; expert weights only over their non-``expert``
  axes, since the dispatcher uses them in place along ``expert``), plus, for the part
  replicated over ``r`` batch-axis devices, an all-reduce of ``size / s``. (XLA:CPU reduces
  gradients with all-reduce + slicing rather than reduce-scatter, so on CPU the gradient bytes
  show up under all-reduce.) (XLA may re-gather in the backward pass or
  fuse/cancel ops, so measured and expected differ by such choices; the table shows both.)
CPU timings are only indicative (2 cores, 8 fake devices share them).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import math
import re
import time
from collections import defaultdict

import numpy as np

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8,
               "u64": 8}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|s8|u8|pred|f64|s64|u64)\[([\d,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


def _bytes(text: str) -> int:
    total = 0
    for dt, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES[dt]
    return total


def parse_collectives(hlo: str) -> dict:
    """{kind: (bytes per step per device, ops per step)} from optimised HLO text."""
    comps: dict[str, list[str]] = {}
    entry = None
    cur = None
    for line in hlo.splitlines():
        m = _COMP_HEAD.match(line) if line[:1] not in (" ", "\t") and line.rstrip().endswith("{") else None
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur is not None:
            if line.strip() == "}":
                cur = None
            else:
                comps[cur].append(line)
    # call graph with multiplicities
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = 1
            if " while(" in line:
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trip = int(t.group(1)) if t else 1
                for key in ("body", "condition"):
                    c = re.search(key + r"=%?([\w.\-]+)", line)
                    if c:
                        calls[name].append((c.group(1), trip if key == "body" else trip + 1))
                continue
            for key in ("calls", "to_apply"):
                for c in re.findall(key + r"=%?([\w.\-]+)", line):
                    calls[name].append((c, 1))
            b = re.search(r"branch_computations=\{([^}]*)\}", line)
            if b:
                for c in re.findall(r"%?([\w.\-]+)", b.group(1)):
                    calls[name].append((c, 1))
    mult: dict[str, int] = defaultdict(int)

    def visit(name, m):
        mult[name] += m
        for child, k in calls.get(name, ()):
            if child in comps:
                visit(child, m * k)

    visit(entry, 1)
    out = {k: [0, 0] for k in COLLECTIVES}
    for name, lines in comps.items():
        m = mult.get(name, 0)
        if not m:
            continue
        for line in lines:
            im = _INSTR.match(line)
            if not im:
                continue
            result, op, rest = im.group(3), im.group(4), im.group(5)
            base = op[:-6] if op.endswith("-start") else op
            if base not in COLLECTIVES:
                continue
            # optimised HLO prints operands without shapes, so sizes come from the result:
            # all-gather -> its (full) result; reduce-scatter -> result x group size (= operand);
            # all-reduce / all-to-all / collective-permute -> result (= operand).
            if op.endswith("-start"):  # async: the result tuple also holds the operand buffers
                sizes = [_bytes(f"{dt}[{dims}]") for dt, dims in _SHAPE.findall(result)]
                nbytes = max(sizes) if sizes else 0
            else:
                nbytes = _bytes(result)
            if base == "reduce-scatter":
                g = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
                nbytes *= len(g.group(1).split(",")) if g else 1
            out[base][0] += m * nbytes
            out[base][1] += m
    return {k: tuple(v) for k, v in out.items()}


def analytic(cfg, ctx, params) -> dict:
    """Expected bytes per device per step (see the module doc)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxmoe.parallel.sharding import BATCH_AXES, param_specs
    from jaxmoe.trees import key_path_str

    sizes = ctx.sizes
    nb = math.prod(sizes[a] for a in BATCH_AXES)
    x = sizes["expert"]
    m = cfg.model
    e = cfg.moe
    t_local = cfg.train.batch_size // cfg.train.micro_batches * cfg.train.seq_len // nb
    d = m.d_model
    per_layer = 0
    if x > 1:
        if ctx.dispatcher == "all_to_all":
            per_layer = 4 * e.n_experts * t_local * d * 4
        elif ctx.dispatcher == "allgather":
            per_layer = 4 * x * t_local * d * 4
    dispatch = per_layer * m.n_moe_layers * cfg.train.micro_batches
    specs = param_specs(params, ctx.axes, sizes)
    gather = rs = ar = 0
    for (kp, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        size = math.prod(leaf.shape) * 4
        used = [a for ax in spec if ax for a in (ax if isinstance(ax, tuple) else (ax,))]
        s = math.prod(sizes[a] for a in used if a in BATCH_AXES)
        # expert weights are used in place along `expert` (inside shard_map): only their other
        # sharded axes (fsdp) are gathered
        g = s // sizes["expert"] if "experts" in key_path_str(kp) and "expert" in used else s
        if g > 1:
            gather += size // (s // g)
            rs += size // (s // g)
        r = nb // s
        if r > 1:
            ar += size // s
    return {"dispatch": dispatch, "all-gather(params)": gather, "reduce-scatter(grads)": rs, "all-reduce(grads)": ar}


def run_layout(preset, spec, kind, chunks, batch, seq, steps):
    import jax

    from jaxmoe.config import load_config
    from jaxmoe.model.transformer import declared_groups, init_params
    from jaxmoe.parallel.mesh import build_context, parse_mesh
    from jaxmoe.train.optim import build_optimizer
    from jaxmoe.train.step import init_state, make_train_step

    cfg = load_config(preset, overrides=[f"train.batch_size={batch}", f"train.seq_len={seq}"])
    cfg = cfg.replace(mesh=dataclasses.replace(cfg.mesh, dispatcher=kind, dispatch_chunks=chunks))
    cfg, ctx = build_context(cfg, parse_mesh(spec))
    params, buffers = init_params(cfg, 0)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    state = ctx.place_state(init_state(cfg, tx, params, buffers))
    rng = np.random.default_rng(0)
    v = cfg.model.vocab_size

    def mk():
        return ctx.place_batch({
            "inputs": rng.integers(0, v, (batch, seq)).astype(np.int32),
            "targets": rng.integers(0, v, (batch, seq)).astype(np.int32),
            "mask": np.ones((batch, seq), np.float32),
        })

    step = make_train_step(ctx.model(), tx, donate=True)
    b = mk()
    t0 = time.perf_counter()
    compiled = step.lower(state, b).compile()
    t_compile = time.perf_counter() - t0
    coll = parse_collectives(compiled.as_text())
    state, mtr = compiled(state, b)
    jax.block_until_ready(mtr)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, mtr = compiled(state, mk())
    jax.block_until_ready(mtr)
    t_step = (time.perf_counter() - t0) / steps
    return cfg, ctx, params, coll, t_compile, t_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layouts", nargs="*", default=[
        "expert=8:all_to_all", "expert=8:allgather", "fsdp=8:all_to_all",
        "replica=2,fsdp=2,expert=2:all_to_all", "expert=4,fsdp=2:all_to_all",
        "expert=4,fsdp=2:all_to_all:2", "replica=8:all_to_all",
    ], help="MESH:DISPATCHER[:CHUNKS]")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"{args.preset}, batch {args.batch}x{args.seq}, {jax.device_count()} {jax.devices()[0].platform} devices; "
          "bytes per device per step (ops per step)\n")
    hdr = f"{'layout':42s} {'step ms':>8s} {'compile s':>9s}  " + "  ".join(f"{k:>24s}" for k in COLLECTIVES)
    print(hdr)
    rows = []
    for item in args.layouts:
        parts = item.split(":")
        spec, kind = parts[0], parts[1]
        chunks = int(parts[2]) if len(parts) > 2 else 1
        cfg, ctx, params, coll, tc, ts = run_layout(args.preset, spec, kind, chunks, args.batch, args.seq, args.steps)
        name = f"{spec} {kind}" + (f" x{chunks}" if chunks > 1 else "")
        cells = "  ".join(f"{coll[k][0] / 1e6:>15.3f}MB ({coll[k][1]:>4d})" for k in COLLECTIVES)
        print(f"{name:42s} {ts * 1e3:8.1f} {tc:9.1f}  {cells}", flush=True)
        rows.append((name, analytic(cfg, ctx, params), coll))
    print("\nanalytic expectation (MB per device per step) vs measured:")
    for name, exp, coll in rows:
        disp_kind = "all-to-all" if "all_to_all" in name else "all-gather"
        print(f"  {name:40s} dispatcher {exp['dispatch'] / 1e6:8.3f} expected "
              f"(measured {disp_kind} {coll[disp_kind][0] / 1e6:8.3f}); "
              f"params all-gather {exp['all-gather(params)'] / 1e6:.3f}, grads reduce-scatter "
              f"{exp['reduce-scatter(grads)'] / 1e6:.3f}, grads all-reduce {exp['all-reduce(grads)'] / 1e6:.3f}")


if __name__ == "__main__":
    main()
