"""The device mesh and the context the trainer runs in: parsing ``--mesh``, making the mesh,
placing params / optimizer state / batches by the rules of :mod:`jaxmoe.parallel.sharding`, validating a
mesh against a config, and the multi-host set-up.

Placement works for concrete arrays and for ``jax.ShapeDtypeStruct`` trees (restore targets get
``.sharding`` attached, so Orbax restores straight into the new layout -- including a different
mesh or process count than the one that saved).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.parallel.sharding import (
    AXES,
    BATCH_AXES,
    declared_axes_flat,
    expert_axes_of,
    logical_to_mesh_axes,
    matched_specs,
    param_specs,
)

# --------------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------------


def parse_mesh(spec: str) -> dict[str, int]:
    """``"replica=2,fsdp=2,expert=2"`` -> sizes of all four axes (unnamed axes are 1)."""
    sizes = {a: 1 for a in AXES}
    seen = set()
    for item in spec.replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise UserError(f"--mesh {spec!r}: expected AXIS=SIZE items, e.g. replica=2,fsdp=2,expert=2")
        name, value = item.split("=", 1)
        if name not in AXES:
            raise UserError(f"--mesh {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in seen:
            raise UserError(f"--mesh {spec!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            v = int(value)
        except ValueError:
            raise UserError(f"--mesh {spec!r}: size of {name!r} must be an integer, got {value!r}") from None
        if v == 0 or v < -1:
            raise UserError(f"--mesh {spec!r}: size of {name!r} must be positive or -1 (fill)")
        sizes[name] = v
    return sizes


def resolve_mesh_shape(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill the one ``-1`` axis and check the product equals the device count."""
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    fill = [a for a in AXES if sizes[a] == -1]
    if len(fill) > 1:
        raise UserError(f"mesh: at most one axis may be -1, got {', '.join(fill)}")
    known = math.prod(v for v in sizes.values() if v != -1)
    desc = ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] != 1)
    if fill:
        if n_devices % known:
            raise UserError(
                f"mesh {desc}: the fixed axes ({known} devices) do not divide the {n_devices} devices"
            )
        sizes[fill[0]] = n_devices // known
    elif known != n_devices:
        raise UserError(
            f"mesh {desc or 'all 1'}: axes multiply to {known} but there are {n_devices} devices; "
            f"make replica*fsdp*expert*tensor = {n_devices} (or set one axis to -1)"
        )
    return sizes


def make_mesh(sizes: dict[str, int], devices=None):
    """A ``jax.sharding.Mesh`` over all four axes with Auto axis types (pjit-style placement;
    jax 0.10's ``make_mesh`` defaults to Explicit, hence the explicit ``axis_types``)."""
    import jax

    shape = tuple(sizes[a] for a in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def mesh_sizes_from_config(cfg: Config) -> dict[str, int]:
    return {a: getattr(cfg.mesh, a) for a in AXES}


# --------------------------------------------------------------------------------------------
# The context handed to the trainer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MeshContext:
    """Everything the trainer needs to run on a mesh.

    ``dispatch``: the expert-parallel dispatcher (``jaxmoe.parallel.expert_dispatch``), bound into the model that
    :meth:`model` builds.
    ``place_state`` / ``place_batch``: put a train state / a host-local batch on the mesh.
    ``replicated``: leaves the rules could not shard (for the log; see the module doc).
    """

    cfg: Config
    mesh: Any
    sizes: dict
    dispatch: Callable | None
    dispatcher: str
    axes: dict = dataclasses.field(default_factory=dict)  # declared logical axes by leaf path
    replicated: list = dataclasses.field(default_factory=list)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return BATCH_AXES

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The expert-parallel mesh axes (``mesh.expert_axes``): experts' E axis and dispatch."""
        return expert_axes_of(self.cfg.mesh.expert_axes)

    @property
    def n_batch_shards(self) -> int:
        return math.prod(self.sizes[a] for a in BATCH_AXES)

    def named(self, spec):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, spec)

    def model(self):
        """The model placed on this mesh: :class:`jaxmoe.model.transformer.Model` with this mesh's
        dispatcher bound in (what the train, eval and parity steps trace)."""
        from jaxmoe.model.transformer import Model

        return Model(self.cfg, self.dispatch)

    # -- state -----------------------------------------------------------------------------
    def state_specs(self, state: dict) -> dict:
        """PartitionSpecs for a train state {"params","buffers","opt_state", scalars...}."""
        import jax
        from jax.sharding import PartitionSpec as P

        rep: list = []
        specs = {}
        pspec = param_specs(state["params"], self.axes, self.sizes, rep, self.expert_axes)
        for k, v in state.items():
            if k == "params":
                specs[k] = pspec
            elif k == "buffers":
                specs[k] = param_specs(v, self.axes, self.sizes, rep, self.expert_axes)
            elif k == "opt_state":
                specs[k] = matched_specs(v, state["params"], pspec)
            else:
                specs[k] = jax.tree.map(lambda _: P(), v)
        self.replicated = sorted(set(rep))
        return specs

    def state_shardings(self, state: dict) -> dict:
        import jax
        from jax.sharding import PartitionSpec as P

        return jax.tree.map(self.named, self.state_specs(state), is_leaf=lambda x: isinstance(x, P))

    def place_state(self, state: dict) -> dict:
        """Shard a train state. Concrete arrays are moved; ShapeDtypeStructs come back with
        ``.sharding`` set (restore targets)."""
        import jax

        shardings = self.state_shardings(state)
        return jax.tree.map(_place, state, shardings)

    def place_params(self, params):
        """Shard a params (or buffers) dict alone."""
        import jax
        from jax.sharding import PartitionSpec as P

        specs = param_specs(params, self.axes, self.sizes, expert_axes=self.expert_axes)
        return jax.tree.map(lambda x, s: _place(x, self.named(s)), params, specs,
                            is_leaf=lambda x: isinstance(x, P) or hasattr(x, "shape"))

    # -- batch -----------------------------------------------------------------------------
    def batch_sharding(self, ndim: int = 2):
        return self.named(logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1)))

    def place_batch(self, batch: dict) -> dict:
        """Host-local numpy rows [B_local, ...] -> global arrays sharded over the batch axes.

        Each process passes only its own rows (``jaxmoe.data.make_data(..., process_index,
        process_count)``); ``jax.make_array_from_process_local_data`` stitches the global array."""
        import jax
        import numpy as np

        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            n_global = v.shape[0] * jax.process_count()
            if n_global % self.n_batch_shards:
                raise UserError(
                    f"batch of {n_global} rows is not divisible by the batch axes "
                    f"replica*fsdp*expert={self.n_batch_shards}; change train.batch_size or the mesh"
                )
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding(v.ndim), v)
        return out


def _place(x, sharding):
    import jax
    import numpy as np

    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Multi-process: every process holds the same full value (same seed); each builds its own
    # addressable shards from it. (device_put onto non-addressable devices is not allowed.)
    if isinstance(x, jax.Array) and x.is_fully_addressable is False:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


# --------------------------------------------------------------------------------------------
# Validation and set-up
# --------------------------------------------------------------------------------------------


def validate_mesh(cfg: Config, sizes: dict[str, int]) -> None:
    """One-line UserErrors for a mesh that cannot run this config (before any compute)."""
    from jaxmoe.config.autoconf import resolve_auto
    from jaxmoe.model.experts import get_path
    from jaxmoe.parallel.expert_dispatch import check_chunks, check_expert_split

    e, t = cfg.moe, cfg.train
    try:  # the dispatchers run an expert path on rows grouped by expert (auto: blocked or ragged)
        get_path(resolve_auto(cfg, "gpu").moe.compute_path if e.compute_path == "auto" else e.compute_path,
                 under_mesh=True)
    except ValueError as err:
        raise UserError(str(err)) from None
    if cfg.model.n_moe_layers:
        check_expert_split(e.n_experts, {a: sizes[a] for a in expert_axes_of(cfg.mesh.expert_axes)})
    nb = math.prod(sizes[a] for a in BATCH_AXES)
    per_micro = t.batch_size // t.micro_batches
    if per_micro % nb:
        raise UserError(
            f"batch axes replica*fsdp*expert={nb} do not divide the {per_micro} sequences per "
            f"micro-batch (train.batch_size={t.batch_size} / train.micro_batches={t.micro_batches}); "
            "change the batch size or the mesh"
        )
    check_chunks(per_micro * t.seq_len // nb, cfg.mesh.dispatch_chunks)


def build_context(cfg: Config, sizes: dict[str, int] | None = None, *, dispatcher: str | None = None,
                  devices=None) -> tuple[Config, MeshContext]:
    """Resolve the mesh for the devices present, validate, and build the MeshContext.

    Returns the config with the resolved mesh sizes (and dispatcher) written into ``cfg.mesh``."""
    import jax

    from jaxmoe.parallel import expert_dispatch as dispatch_mod

    sizes = dict(sizes if sizes is not None else mesh_sizes_from_config(cfg))
    n = len(devices) if devices is not None else jax.device_count()
    sizes = resolve_mesh_shape(sizes, n)
    mesh_cfg = dataclasses.replace(cfg.mesh, **sizes)
    if dispatcher is not None:
        mesh_cfg = dataclasses.replace(mesh_cfg, dispatcher=dispatcher)
    cfg = cfg.replace(mesh=mesh_cfg)
    validate_mesh(cfg, sizes)
    mesh = make_mesh(sizes, devices)
    kind = dispatch_mod.resolve_dispatcher(cfg, platform=mesh.devices.flat[0].platform)
    fn = dispatch_mod.make_dispatch(cfg, mesh, kind)
    ctx = MeshContext(cfg=cfg, mesh=mesh, sizes=sizes, dispatch=fn, dispatcher=kind,
                      axes=declared_axes_flat(cfg))
    # check the rules against the real shapes now, so a bad mesh fails before any compute
    from jaxmoe.model.transformer import abstract_params

    params, buffers = abstract_params(cfg)
    ctx.state_specs({"params": params, "buffers": buffers})
    return cfg, ctx


def setup_from_args(cfg: Config, args) -> tuple[Config, MeshContext]:
    """CLI entry (``jaxmoe train``): XLA flag profile, multi-host init, mesh, dispatcher.

    Order matters: the XLA flag profile must be in XLA_FLAGS and ``jax.distributed.initialize``
    must run before anything touches a jax backend (``jax.devices()`` etc.)."""
    from jaxmoe.parallel import distributed

    distributed.apply_xla_flags_profile(cfg.mesh.xla_flags_profile)
    distributed.initialize_from_args(args)
    spec = getattr(args, "mesh", None)
    sizes = parse_mesh(spec) if spec else mesh_sizes_from_config(cfg)
    cfg, ctx = build_context(cfg, sizes)
    import jax

    if jax.process_index() == 0 and not getattr(args, "quiet", False):
        desc = ",".join(f"{a}={ctx.sizes[a]}" for a in AXES)
        print(f"mesh {desc} over {jax.device_count()} devices in {jax.process_count()} process(es); "
              f"dispatcher {ctx.dispatcher}"
              + (f"; replicated: {len(ctx.replicated)} leaves" if ctx.replicated else ""))
    return cfg, ctx


__all__ = [
    "MeshContext",
    "build_context",
    "make_mesh",
    "mesh_sizes_from_config",
    "parse_mesh",
    "resolve_mesh_shape",
    "setup_from_args",
    "validate_mesh",
]
