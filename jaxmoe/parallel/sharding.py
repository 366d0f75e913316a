"""The sharding rules: how every parameter, buffer and optimizer-state leaf is laid out on the mesh.

How sharding is decided, in three steps (the mesh itself and placement: :mod:`jaxmoe.parallel.mesh`):

1. **Mesh.** Four named axes, always in this order (names are a contract)::

       replica   pure data-parallel replicas (params replicated across them)
       fsdp      parameter / optimizer-state sharding inside a replica
       expert    expert parallelism (experts' E axis), also FSDP for dense weights
       tensor    optional tensor parallelism (the batch is *not* split over it)

   ``--mesh replica=4,expert=384`` (or the config's ``[mesh]``) gives the sizes; one axis may be
   ``-1`` to take the remaining devices. Axes not named are 1.

2. **Logical axes.** Every parameter and buffer declares its logical axis names where it is
   created (``axes=`` metadata, :mod:`jaxmoe.model.params`); the stacked layer axis of ``dense/``
   and ``moe/`` leaves is ``"layers"`` and is never sharded. :func:`declared_axes_flat` reads them.

3. **Rules.** ONE table, :data:`LOGICAL_RULES`, maps each logical name to mesh axes (MaxText
   style). Divisibility is checked per array: a *strict* logical axis (``batch``, ``experts``,
   and anything over ``tensor``) that does not divide raises a one-line :class:`UserError` naming
   the axis; an FSDP-style axis (``embed``, ``expert_embed``, ``lora``) that does not divide moves
   its mesh axes (or a subset of them) to another unsharded dim of the same array that they
   divide, and otherwise leaves the array replicated along them (recorded in
   ``MeshContext.replicated``). The fallback keeps a mesh whose expert-parallel size divides few
   dense dims runnable; the layout that shards them is the factored one (``mesh.expert_axes =
   "fsdp,expert"``: experts whole over fsdp x expert, dense weights FSDP over fsdp), and
   ``jaxmoe plan`` reports the replicated share and whether experts stay whole (the europa-952b
   figures: docs/MEASUREMENTS.md, "Planner: europa-952b").

Optimizer state is sharded like the parameter it belongs to: every optax leaf whose key path ends
in a parameter path and whose shape equals that parameter's gets the parameter's sharding; other
leaves (counts, scalars) are replicated.

"""

from __future__ import annotations

import math

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.trees import key_path_str

AXES = ("replica", "fsdp", "expert", "tensor")

# --------------------------------------------------------------------------------------------
# THE rules table: logical axis name -> mesh axes (None = replicated along that dim)
# --------------------------------------------------------------------------------------------

LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("replica", "fsdp", "expert"),  # the batch (tokens) is split over every axis but tensor
    "layers": None,  # scanned layer stacks: never sharded (the scan slices it)
    "vocab": ("tensor",),
    "embed": ("fsdp", "expert"),  # dense weights: FSDP over fsdp x expert
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "lora": ("fsdp", "expert"),  # MLA low-rank dims: FSDP too (q_b_proj/kv_b_proj have no embed dim)
    "norm": None,
    "router_experts": None,  # router's E output dim and the expert bias: tiny, replicated
    # experts' E axis: the expert-parallel axes, i.e. those of this entry named in
    # ``mesh.expert_axes`` ("expert" by default; "fsdp,expert" keeps experts whole with fsdp > 1:
    # E over fsdp x expert, e.g. 384 experts on fsdp=128 x expert=3, one per device per layer)
    "experts": ("fsdp", "expert"),
    # when fsdp is not expert-parallel the experts' next dim is FSDP-sharded over it (gathered at
    # dispatch entry); when it is, the experts dim already claimed it and this stays unsharded
    "expert_embed": ("fsdp",),
    "expert_mlp": ("tensor",),
}

# logical axes whose mesh axes may move to another dim of the same array (or shrink to a subset)
# when they do not divide; every other sharded logical axis must divide exactly (else UserError)
FSDP_LIKE = {"embed", "expert_embed", "lora"}

EXPERT_AXES_CHOICES = ("expert", "fsdp,expert")  # values of mesh.expert_axes


def mesh_axes(logical: str, expert_axes: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The mesh axes :data:`LOGICAL_RULES` maps the logical axis ``logical`` to (``()``: not
    sharded). ``experts`` keeps only those of ``expert_axes`` (:func:`expert_axes_of`; default
    ``("expert",)``), in rules-table order."""
    axes = LOGICAL_RULES[logical] or ()
    if logical == "experts":
        axes = tuple(a for a in axes if a in (("expert",) if expert_axes is None else expert_axes))
    return axes


def logical_to_mesh_axes(logical: tuple[str | None, ...], expert_axes: tuple[str, ...] | None = None):
    """A PartitionSpec from logical axis names, one per dim (``None``: not sharded), by the rules
    table (MaxText's ``logical_to_mesh_axes``): each dim gets :func:`mesh_axes` of its name, one
    mesh axis as a name, several as a tuple. No divisibility check: that is :func:`spec_for`."""
    from jax.sharding import PartitionSpec as P

    dims = [mesh_axes(name, expert_axes) if name else () for name in logical]
    return P(*[(d if len(d) > 1 else d[0]) if d else None for d in dims])


BATCH_AXES = mesh_axes("batch")  # the mesh axes the batch's rows (the tokens) are split over


def expert_axes_of(value: str | None) -> tuple[str, ...]:
    """``mesh.expert_axes`` (``"expert"`` or ``"fsdp,expert"``) -> the expert-parallel mesh axes,
    in :data:`LOGICAL_RULES` order (the order of the E blocks over the devices)."""
    names = tuple(a for a in (value or "expert").replace(" ", "").split(",") if a)
    if ",".join(names) not in EXPERT_AXES_CHOICES:
        raise UserError(f"mesh.expert_axes={value!r}: choose one of {', '.join(repr(c) for c in EXPERT_AXES_CHOICES)}")
    return tuple(a for a in LOGICAL_RULES["experts"] if a in names)


def declared_axes_flat(cfg: Config) -> dict[str, tuple]:
    """Logical axes of every parameter and buffer of ``cfg``'s model, by ``/``-joined path: read
    from the declarations in the modules (jaxmoe.model.params), never from a table here."""
    from jaxmoe.model.transformer import model_declarations  # jax-only; this module imports lazily

    return {k: d.axes for k, d in model_declarations(cfg).items()}


def logical_axes(cfg: Config, path: str) -> tuple[str | None, ...] | None:
    """Logical axis names of the leaf ``path`` of ``cfg``'s model (None: no such declaration)."""
    return declared_axes_flat(cfg).get(path)


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------


def _live(axes, sizes) -> tuple[str, ...]:
    """Mesh axes of a rule with the size-1 ones dropped (keeps specs short and divisibility real)."""
    return tuple(a for a in (axes or ()) if sizes[a] > 1)


def _subsets(axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Non-empty sub-tuples of ``axes`` (order kept), largest first."""
    out = []
    for mask in range(1, 1 << len(axes)):
        out.append(tuple(a for b, a in enumerate(axes) if mask >> b & 1))
    return sorted(out, key=len, reverse=True)


def spec_for(path: str, shape: tuple[int, ...], axes: tuple | None, sizes: dict[str, int],
             replicated: list | None = None, expert_axes: tuple[str, ...] = ("expert",)):
    """PartitionSpec of one leaf (``axes``: its declared logical axes) from the rules table.

    Each dim takes the live (size > 1) mesh axes of its logical name; a mesh axis is used at most
    once per array (the first dim claiming it wins). A dim that the axes do not divide:

    * FSDP-like (``embed``, ``expert_embed``, ``lora``): its axes are re-placed, largest product
      first, on this dim or another free non-layer dim (largest dim first) that they divide, also
      trying subsets of the axes (e.g. only ``fsdp`` when ``fsdp*expert`` does not divide);
      nothing fits -> the array stays replicated along them (listed in ``replicated``);
    * anything else (``experts`` over the expert-parallel axes, dims over ``tensor``): one-line
      UserError.

    ``expert_axes`` (:func:`expert_axes_of`): which axes of the ``experts`` rule are used.
    """
    from jax.sharding import PartitionSpec as P

    if axes is None:
        if replicated is not None:
            replicated.append(f"{path} (no declaration)")
        return P()
    if len(axes) != len(shape):
        raise ValueError(f"sharding: {path} has shape {tuple(shape)} but declared axes {axes}")
    dims: list[tuple[str, ...]] = [()] * len(shape)
    used: set[str] = set()
    pending = []
    for i, name in enumerate(axes):
        rule = mesh_axes(name, expert_axes) if name in LOGICAL_RULES else ()
        live = tuple(a for a in _live(rule, sizes) if a not in used)
        if not live:
            continue
        n = math.prod(sizes[a] for a in live)
        if shape[i] % n == 0:
            dims[i] = live
            used.update(live)
        elif name in FSDP_LIKE:
            pending.append((i, name, live))
        else:
            raise UserError(
                f"mesh axis {'*'.join(f'{a}={sizes[a]}' for a in live)} does not divide {path} "
                f"dim {i} ({name}={shape[i]}); choose a mesh whose {'*'.join(live)} size divides {shape[i]}"
            )
    for i, name, live in pending:
        avail = tuple(a for a in live if a not in used)
        free = [j for j in range(len(shape)) if j != i and not dims[j] and axes[j] != "layers"]
        where = [i] + sorted(free, key=lambda j: -shape[j])
        placed = False
        for sub in _subsets(avail):
            k = math.prod(sizes[a] for a in sub)
            for j in where:
                if not dims[j] and shape[j] % k == 0:
                    dims[j] = sub
                    used.update(sub)
                    placed = True
                    break
            if placed:
                break
        left = [a for a in live if a not in used]
        if replicated is not None and left:
            replicated.append(f"{path} (not sharded over {'*'.join(left)}: {name}={shape[i]})")
    return P(*[(d if len(d) > 1 else d[0]) if d else None for d in dims])


def param_specs(tree, axes: dict[str, tuple], sizes: dict[str, int], replicated: list | None = None,
                expert_axes: tuple[str, ...] = ("expert",)):
    """PartitionSpecs for a params (or buffers) nested dict, leaf by leaf; ``axes``: declared
    logical axes by ``/``-joined path (:func:`declared_axes_flat`)."""
    import jax

    def one(kp, x):
        path = key_path_str(kp)
        return spec_for(path, tuple(x.shape), axes.get(path), sizes, replicated, expert_axes)

    return jax.tree_util.tree_map_with_path(one, tree)


def matched_specs(tree, params, pspecs):
    """Specs for a tree (e.g. optax state) whose leaves mirror params: a leaf whose key path ends
    in a parameter's path and has that parameter's shape gets its spec; the rest are replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    by_path = {}
    for (kp, p), (_, s) in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree_util.tree_leaves_with_path(pspecs, is_leaf=lambda x: isinstance(x, P)),
    ):
        by_path[tuple(key_path_str(kp).split("/"))] = (tuple(p.shape), s)

    def one(kp, leaf):
        names = tuple(key_path_str(kp).split("/"))
        shape = tuple(getattr(leaf, "shape", ()))
        for start in range(len(names)):
            hit = by_path.get(names[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(one, tree)


__all__ = [
    "AXES",
    "BATCH_AXES",
    "EXPERT_AXES_CHOICES",
    "FSDP_LIKE",
    "LOGICAL_RULES",
    "declared_axes_flat",
    "expert_axes_of",
    "logical_axes",
    "logical_to_mesh_axes",
    "mesh_axes",
    "matched_specs",
    "param_specs",
    "spec_for",
]
