"""Whole-matrix placement for Muon ("FlexShard"): every matrix is orthogonalised whole, once.

Muon's Newton–Schulz (NS) needs whole matrices, but FSDP shards a dense matrix across devices
and a fallback may leave it replicated. Replicated NS runs every matrix on every device (europa:
~930 TFLOP per device per step); all-gathering moves every matrix to every device. Here each
matrix is given to ONE owner device instead:

* **Where it lives** (zero collectives): a leaf whose matrix dims (the last two) are not sharded
  and whose batch dims (layers, experts) are sharded over some mesh axis -- stacked experts
  ``[L, E, in, out]`` with ``E`` over ``expert`` (or over ``fsdp x expert``) -- is orthogonalised
  on the devices that hold it. Nothing moves.
* **Gathered in its batch shard**: stacked experts whose ``E`` axis is sharded *and* whose
  matrix dims are split too (``E`` over ``expert``, ``in`` over ``fsdp``): each device gathers its
  own experts' matrices over the matrix dims' axes only, orthogonalises them, keeps its slice.
* **Owner-placed** (every other matrix leaf: only matrix dims sharded, or the leaf replicated):
  a leaf with batch shape ``B`` holds ``M = prod(B)`` matrices (a scanned ``[L, in, out]`` leaf
  holds L). Matrices of one shape, dtype and matrix-dim sharding form a class (e.g. every
  layer's ``q_proj``, or ``gate``/``up`` together). :func:`plan_owners` gives each matrix an owner
  among the ``N`` devices of one replica (all mesh axes but ``replica``: replicas never talk for
  the optimizer), longest-processing-time first by NS FLOPs, with at most ``K = ceil(M / N)`` of a
  class per device. At run time a class's NS input is gathered into an owner buffer
  ``[N, K, in, out]`` (unused slots zero) whose first axis is sharded over the replica's devices,
  so resharding into it is one all-to-all (each element sent once, to its owner); the owner
  orthogonalises its ``K`` slots -- empty slots are skipped at run time by a ``lax.cond`` on a
  per-device mask -- and the result is resharded back to the parameter's own sharding (the
  inverse all-to-all; plus an all-gather only where the parameter itself is replicated).

The decision reads the *parameter shardings* (``NamedSharding`` per leaf), never a specific rule,
so it stays right when the rules table changes. Numerics: the per-matrix computation is the same
function as the replicated path (:func:`jaxmoe.train.optim._newton_schulz`), so the result equals
single-device Muon (fp32 NS: to rounding of the matmuls' accumulation order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

REPLICA_AXIS = "replica"  # owners are chosen inside one replica (see the module doc)


def ns_flops(shape, steps: int = 5) -> float:
    """Newton–Schulz FLOPs of one ``[m, n]`` matrix (``s = min, l = max``): per step the Gram
    ``2 s^2 l``, its square ``2 s^3`` and the product with X ``2 s^2 l``."""
    s, big = sorted(int(d) for d in shape[-2:])
    return float(steps) * (4.0 * s * s * big + 2.0 * s ** 3)


def _spec_dims(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes of each dim of an array with PartitionSpec ``spec``."""
    out = []
    for i in range(ndim):
        e = spec[i] if i < len(spec) else None
        out.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
    return out


def owner_axes(mesh) -> tuple[str, ...]:
    """The mesh axes owners are spread over: every axis of size > 1 but ``replica``."""
    return tuple(a for a in mesh.axis_names if a != REPLICA_AXIS and mesh.shape[a] > 1)


def placement(sharding, ndim: int) -> str:
    """How the matrices of a leaf (``ndim >= 2``) with this sharding are orthogonalised:

    * ``"local"``: its matrix dims (the last two) are not sharded and a batch dim is (each device
      holds whole matrices, and not all of them), or there is no mesh to spread over: NS where
      they live, zero collectives;
    * ``"gather"``: matrix dims *and* a batch dim are sharded (stacked experts split over
      ``fsdp`` along ``in``): each device gathers only its own batch shard's matrices over the
      matrix dims' axes, orthogonalises them and keeps its slice (no owner exchange needed);
    * ``"owner"``: the rest (dense matrices: only matrix dims sharded, or replicated): owners.
    """
    if not isinstance(sharding, NamedSharding) or not owner_axes(sharding.mesh):
        return "local"
    mesh = sharding.mesh
    live = [tuple(a for a in d if mesh.shape[a] > 1) for d in _spec_dims(sharding.spec, ndim)]
    batch_sharded = any(live[:-2])
    if batch_sharded:
        return "local" if not (live[-1] or live[-2]) else "gather"
    return "owner"


@dataclasses.dataclass(frozen=True)
class ClassPlan:
    """Where the matrices of one class (owner-placed matrices of one shape and matrix-dim
    sharding, concatenated in path order) go: ``slots[d, k]`` is the index of the matrix device
    ``d`` orthogonalises in its slot ``k`` or -1 (empty); ``where[m] = d * K + k`` the inverse."""

    slots: np.ndarray  # [N, K] int32
    where: np.ndarray  # [M] int32


def plan_owners(classes: dict, n: int, steps: int = 5) -> tuple[dict, np.ndarray]:
    """Owners for ``classes`` (key -> ``(count M, matrix shape)``) among ``n`` devices: longest
    processing time first (cost :func:`ns_flops`), each matrix to the least loaded device (ties:
    the lowest index) among those holding fewer than ``K = ceil(M / n)`` of its class, so that
    the owner buffers (and the bytes the all-to-alls move) stay minimal. Returns
    ``({key: ClassPlan}, NS FLOPs per device)``."""
    load = np.zeros(n)
    plans = {}
    order = sorted(classes, key=lambda key: (-ns_flops(classes[key][1], steps), str(key)))
    for key in order:
        m, shape = classes[key]
        cost = ns_flops(shape, steps)
        k = max(1, -(-m // n))
        slots = np.full((n, k), -1, np.int32)
        where = np.zeros(m, np.int32)
        count = np.zeros(n, np.int64)
        for i in range(m):
            free = np.flatnonzero(count < k)
            d = int(free[np.argmin(load[free])])  # argmin: the first (lowest index) on ties
            slots[d, count[d]] = i
            where[i] = d * k + count[d]
            count[d] += 1
            load[d] += cost
        plans[key] = ClassPlan(slots, where)
    return plans, load


def _skip_empty(ns: Callable, axes: tuple[str, ...], mesh):
    """``[N, K, a, b]`` buffer (first axis over ``axes``) and ``[N, K]`` mask -> NS of the full
    slots, zeros in the empty ones, each device working only on its own slots."""

    def local(x, mask):  # x [1, K, a, b], mask [1, K] on one device
        kind = jax.eval_shape(ns, x[0, 0])
        outs = []
        for k in range(x.shape[1]):
            outs.append(jax.lax.cond(mask[0, k], ns, lambda _: jnp.zeros(kind.shape, kind.dtype), x[0, k]))
        return jnp.stack(outs)[None]

    spec = P(axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)


def _matrix_spec(sharding: NamedSharding, ndim: int) -> tuple:
    """The PartitionSpec entries of the last two dims (the matrix) of a leaf."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return spec[-2], spec[-1]


def owner_placed(shardings: dict, shapes: dict) -> list[str]:
    """The paths (of ``shapes``: path -> leaf shape) that :func:`orthogonalise` gives to owners."""
    out = []
    for path, shape in shapes.items():
        sh = shardings.get(path)
        if len(shape) >= 2 and placement(sh, len(shape)) == "owner":
            out.append(path)
    return sorted(out)


def orthogonalise(us: dict, shardings: dict, ns: Callable, steps: int = 5) -> dict:
    """Newton–Schulz of every matrix of every leaf of ``us`` (path -> NS input, sharded like its
    parameter; ``shardings``: path -> that ``NamedSharding``, or None for no mesh), placed as the
    module doc says. ``ns``: ``[..., a, b] -> [..., a, b]`` on whole matrices (batch dims free).
    Returns path -> NS output in the parameter's sharding.

    Owner-placed matrices of one shape, dtype and matrix-dim sharding form one class, moved in one
    buffer: per class ``[N, K, a, b]``, ``K = ceil(M / N)``; each device sends and receives
    ``K a b (N-1)/N`` elements each way, where an all-gather of the class would bring it
    ``M a b (N-1)/N``."""
    placed = set(owner_placed(shardings, {p: tuple(u.shape) for p, u in us.items()}))
    out = {}
    for p, u in us.items():
        if p in placed:
            continue
        if placement(shardings.get(p), u.ndim) == "gather":  # whole matrices of this batch shard
            sh = shardings[p]
            spec = tuple(sh.spec) + (None,) * (u.ndim - len(sh.spec))
            whole = P(*spec[:-2], None, None)
            u = jax.lax.with_sharding_constraint(u, NamedSharding(sh.mesh, whole))
            # inside shard_map: XLA must not re-partition NS's matmuls along the matrix dims
            # (it would, propagating the parameter's sharding back: an all-reduce per step)
            local = jax.shard_map(ns, mesh=sh.mesh, in_specs=whole, out_specs=whole, check_vma=False)
            out[p] = jax.lax.with_sharding_constraint(local(u), sh)
        else:
            out[p] = ns(u)  # in place: zero collectives
    if not placed:
        return out
    meshes = {shardings[p].mesh for p in placed}
    if len(meshes) != 1:
        raise ValueError("flexshard: parameters are placed on more than one mesh")
    mesh = meshes.pop()
    axes = owner_axes(mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    members: dict = {}
    for path in sorted(placed):
        u = us[path]
        key = (tuple(u.shape[-2:]), str(u.dtype), _matrix_spec(shardings[path], u.ndim))
        members.setdefault(key, []).append(path)
    counts = {key: (sum(math.prod(us[p].shape[:-2]) for p in ps), key[0]) for key, ps in members.items()}
    plans, _ = plan_owners(counts, n, steps)
    buf_sh = NamedSharding(mesh, P(axes))
    run = _skip_empty(ns, axes, mesh)
    for key, paths in members.items():
        (a, b), _, (sa, sb) = key
        plan = plans[key]
        n_, k = plan.slots.shape
        here = NamedSharding(mesh, P(None, sa, sb))  # matrices as the params hold them
        mats = jnp.concatenate([us[p].reshape(-1, a, b) for p in paths]
                               + [jnp.zeros((1, a, b), us[paths[0]].dtype)])
        mats = jax.lax.with_sharding_constraint(mats, here)
        idx = np.where(plan.slots < 0, mats.shape[0] - 1, plan.slots).reshape(-1)
        buf = jax.lax.with_sharding_constraint(mats[idx], here).reshape(n_, k, a, b)
        buf = jax.lax.with_sharding_constraint(buf, buf_sh)  # -> owners: one all-to-all
        mask = jax.lax.with_sharding_constraint(jnp.asarray(plan.slots >= 0), buf_sh)
        o = run(buf, mask)
        # back: an all-to-all over the axes the matrix dims use, then (only where the params are
        # replicated over some owner axes) an all-gather over the rest
        used = {x for e in (sa, sb) if e is not None for x in ((e,) if isinstance(e, str) else e)}
        rest = tuple(x for x in axes if x not in used)
        o = jax.lax.with_sharding_constraint(o, NamedSharding(mesh, P(rest or None, None, sa, sb)))
        o = jax.lax.with_sharding_constraint(o, NamedSharding(mesh, P(None, None, sa, sb)))
        o = jax.lax.with_sharding_constraint(o.reshape(n_ * k, a, b)[plan.where], here)
        start = 0
        for p in paths:
            size = math.prod(us[p].shape[:-2])
            piece = o[start:start + size].reshape(us[p].shape)
            out[p] = jax.lax.with_sharding_constraint(piece, shardings[p])
            start += size
    return out


__all__ = ["ClassPlan", "REPLICA_AXIS", "ns_flops", "orthogonalise", "owner_axes", "placement",
           "owner_placed", "plan_owners"]
