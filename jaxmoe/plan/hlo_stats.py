"""Collectives in a compiled (SPMD-partitioned) HLO module: how many, how many bytes.

:func:`count_collectives` reads the text of a *compiled* module (``jitted.lower(...).compile()
.as_text()``: after SPMD partitioning, so shapes are per device) and counts each collective op:
``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``ragged-all-to-all``,
``collective-permute``, ``collective-broadcast`` (an asynchronous pair ``*-start``/``*-done``
counts once, under the op's plain name). The bytes of one op are the larger of its operands' and
its result's array bytes per device (all-gather: the gathered result; reduce-scatter: the input;
all-reduce, all-to-all, permute: the buffer exchanged). Ops inside loop bodies count once (static
count, not trip count).

:func:`optimizer_update_collectives` compiles the optimizer update of a config on a concrete
mesh for the expert and the dense parameter groups separately and counts each: the figure the
planner reports (``optimizer_update_collectives``) and the FlexShard tests check.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.model.transformer import abstract_params, declared_groups
from jaxmoe.parallel.sharding import declared_axes_flat, expert_axes_of, matched_specs, param_specs
from jaxmoe.train.optim import build_optimizer
from jaxmoe.trees import flatten, unflatten

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# "%name = SHAPE opcode(operands), attrs"  (ROOT optional; SHAPE may be a tuple)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")


def _bytes(shape_text: str) -> list[int]:
    """Bytes of each array in a (possibly tuple) HLO shape string."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _DTYPE_BYTES[dtype])
    return out


def _operands(args: str) -> list[str]:
    """Operand names of an instruction (the text up to the closing parenthesis)."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                end = i
                break
    return re.findall(r"%([\w.\-]+)", args[:end])


def _collectives(hlo_text: str):
    """``(computation, line, op, bytes)`` for each collective instruction of a compiled module's
    text: ``op`` without an async ``-start`` suffix, bytes per device as the module doc counts
    them (the larger of result and operands; an async start's tuple result by its largest part)."""
    shapes: dict[str, int] = {}
    found = []
    cur = None
    for line in hlo_text.splitlines():
        c = _COMP.match(line)
        if c and not line.startswith(" "):
            cur = c.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, args = m.groups()
        sizes = _bytes(shape)
        shapes[name] = sum(sizes)
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVES:
            found.append((cur, line, base, op != base, sizes, _operands(args)))
    for cur, line, base, is_async, sizes, operands in found:
        # async *-start results are tuples holding the operands and the results: take the largest
        result = max(sizes, default=0) if is_async else sum(sizes)
        yield cur, line, base, max(result, sum(shapes.get(o, 0) for o in operands))


def count_collectives(hlo_text: str) -> dict:
    """``{op: {"count": n, "bytes": b}}`` for the collectives of a compiled HLO module's text
    (see the module doc); ops that do not occur are absent (``{}``: no collectives)."""
    out: dict = {}
    for _, _, base, nbytes in _collectives(hlo_text):
        rec = out.setdefault(base, {"count": 0, "bytes": 0})
        rec["count"] += 1
        rec["bytes"] += nbytes
    return out


def total(stats: dict) -> tuple[int, int]:
    """``(ops, bytes)`` summed over a :func:`count_collectives` result."""
    return (sum(v["count"] for v in stats.values()), sum(v["bytes"] for v in stats.values()))


def _is_expert(axes) -> bool:
    return "experts" in tuple(axes or ())


def optimizer_update_collectives(cfg, mesh, specs=None) -> dict:
    """Compile ``cfg``'s optimizer update (``cfg.optim.optimizer``, ``cfg.optim.muon_placement``)
    on the concrete ``mesh`` (a ``jax.sharding.Mesh`` with jaxmoe's axis names), parameters and
    optimizer state placed by the rules table, once for the expert parameters (declared with an
    ``experts`` axis) and once for the rest (dense), and count the collectives of each compiled
    module. Returns ``{"expert": {op: {"count", "bytes"}}, "dense": {...}, "module": str}``.

    ``specs``: the params' PartitionSpecs (a pytree like the params) to use instead of the rules
    table's. Global-norm clipping is left out (it adds one scalar all-reduce per group whatever the
    placement); everything else is the optimizer the train step runs."""
    sizes = {a: int(mesh.shape.get(a, 1)) for a in mesh.axis_names}
    ocfg = dataclasses.replace(cfg.optim, grad_clip=0.0)
    params, _ = abstract_params(cfg)
    groups = declared_groups(cfg)
    axes = declared_axes_flat(cfg)
    pspecs = (param_specs(params, axes, sizes, None, expert_axes_of(cfg.mesh.expert_axes))
              if specs is None else specs)
    flat_p = flatten(params)
    out = {"module": (f"optimizer update ({ocfg.optimizer}, muon_placement={ocfg.muon_placement}, "
                      "no clipping) compiled (SPMD-partitioned) on the mesh "
                      + ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1) + f" of {mesh.size} "
                      f"{mesh.devices.flat[0].platform} devices")}
    for kind in ("expert", "dense"):
        keep = {p for p in flat_p if _is_expert(axes.get(p)) == (kind == "expert")}
        if not keep:
            out[kind] = {}
            continue
        sub_p = unflatten({p: v for p, v in flat_p.items() if p in keep})
        sub_g = unflatten({p: v for p, v in flatten(groups).items() if p in keep})
        sub_s = unflatten({p: v for p, v in flatten(pspecs).items() if p in keep})
        shard = jax.tree.map(lambda s: NamedSharding(mesh, s), sub_s, is_leaf=lambda x: isinstance(x, P))
        tx = build_optimizer(ocfg, cfg.train.steps, sub_p, sub_g, shard)
        state = jax.eval_shape(tx.init, sub_p)
        s_specs = matched_specs(state, sub_p, sub_s)
        s_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), s_specs, is_leaf=lambda x: isinstance(x, P))
        fn = jax.jit(tx.update, in_shardings=(shard, s_shard, shard), out_shardings=(shard, s_shard))
        text = fn.lower(sub_p, state, sub_p).compile().as_text()
        out[kind] = count_collectives(text)
    return out


# --------------------------------------------------------------------------------------------
# Bytes per mesh axis and step (``jaxmoe plan --lower``: ``comm_bytes_per_step``)
# --------------------------------------------------------------------------------------------

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_IOTA = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(dims: list[int], perm: list[int] | None):
    import numpy as np

    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of one collective's HLO line (explicit ``{{0,1},{2,3}}``, iota
    ``[G,S]<=[dims]T(perm)``, XLA's mesh form ``mesh['a'=2,...], device_ids=(...) {'a'}``, or a
    collective-permute's ``source_target_pairs``); ``None`` when the line names none (one group of
    every device). The ids are the module's logical device ids: positions in the mesh, flattened."""
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]+\},?)*)\}", line)
    if m:  # a permute: each pair is a group of two
        return [_ints(g) for g in re.findall(r"\{([0-9,]+)\}", m.group(1))]
    m = _MESH_GROUPS.search(line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(sizes)
               if m.group(2) else _iota(sizes, None))
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest = [i for i in range(len(names)) if i not in grouped]
        size = math.prod(sizes[i] for i in grouped)
        return ids.transpose(rest + grouped).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=(\S+)", line)
    if not m:
        return None
    text = m.group(1)
    it = _IOTA.match(text)
    if it:
        shape = _ints(it.group(1))
        return _iota(_ints(it.group(2)), _ints(it.group(3)) if it.group(3) else None).reshape(shape).tolist()
    groups = [_ints(g) for g in re.findall(r"\{([0-9,]+)\}", text)]
    return groups or None


def axes_of_groups(groups, mesh_shape: dict) -> str:
    """The mesh axes a collective's groups span: the axes (of ``mesh_shape``, in its order) along
    which the members of a group differ, joined by ``+`` (``"fsdp"``, ``"expert+fsdp"``); every
    axis of size > 1 when ``groups`` is None; ``"none"`` for groups of one device."""
    import numpy as np

    names, sizes = list(mesh_shape), [int(v) for v in mesh_shape.values()]
    if groups is None:
        return "+".join(a for a, n in zip(names, sizes) if n > 1) or "none"
    spans = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g, dtype=np.int64), sizes)).T
        spans.update(i for i in range(len(names)) if len(set(coords[:, i])) > 1)
    return "+".join(names[i] for i in sorted(spans)) or "none"


def computation_multiplicity(hlo_text: str) -> dict[str, int]:
    """How many times each computation of a compiled module runs per call of its entry: a while
    body its known trip count times its caller's count, any other callee its caller's count."""
    comps, edges, entry, cur = [], {}, None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps.append(cur)
            edges[cur] = []
            entry = cur if line.startswith("ENTRY") else entry
            continue
        if cur is None:
            continue
        trip = _TRIP.search(line)
        for kind, callee in _CALLEE.findall(line):
            edges[cur].append((callee, int(trip.group(1)) if (kind == "body" and trip) else 1))
        for names in _BRANCHES.findall(line):
            edges[cur].extend((n.strip().lstrip("%"), 1) for n in names.split(",") if n.strip())
    mult = dict.fromkeys(comps, 0)
    if entry is not None:
        mult[entry] = 1
    for c in reversed(comps):  # callers are printed after their callees
        for callee, k in edges[c]:
            if callee in mult:
                mult[callee] += mult[c] * k
    return mult


def comm_bytes_by_axis(hlo_text: str, mesh_shape: dict) -> dict:
    """``{axes: {op: {"count", "bytes"}}}``: every collective of a compiled module, by the mesh
    axes its groups span (:func:`axes_of_groups`), bytes per device as :func:`count_collectives`
    counts them, times the number of times its computation runs per step (loop trip counts)."""
    mult = computation_multiplicity(hlo_text)
    out: dict = {}
    for comp, line, base, nbytes in _collectives(hlo_text):
        k = mult.get(comp, 1)
        rec = out.setdefault(axes_of_groups(replica_groups(line), mesh_shape), {}).setdefault(
            base, {"count": 0, "bytes": 0})
        rec["count"] += k
        rec["bytes"] += nbytes * k
    return out


__all__ = ["COLLECTIVES", "axes_of_groups", "comm_bytes_by_axis", "computation_multiplicity",
           "count_collectives", "optimizer_update_collectives", "replica_groups", "total"]
