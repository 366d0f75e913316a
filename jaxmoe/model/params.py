"""Parameter declarations: every parameter is declared once, in the module that uses it.

A declaration is an ``nnx.Variable`` created in a module's ``__init__`` whose *type* says what the
tensor is and how it is stored in HF checkpoints, and whose *metadata* says how it is sharded and
optimised::

    self.q_proj = Linear.declare(stack + (d, h * hd), ("embed", "heads"), normal(std))

* type: :class:`Linear` (``[in, out]``, HF stores ``[out, in]``), :class:`ExpertLinear` (stacked
  ``[E, in, out]``), :class:`RMSNorm` (a norm scale), :class:`Embedding`, or the non-trained
  :class:`ExpertBias` buffer. A layer that is a single weight *is* that variable: it applies
  itself (``self.q_proj(x)``, ``self.attn_norm(x)``), so the state path of a weight is the name of
  the layer (``moe/attn/q_proj``), which is the canonical layout of docs/LAYOUT.md;
* ``axes``: one logical axis name per dim, read by the one rules table in
  :mod:`jaxmoe.parallel.sharding` (stacking layers prepends ``"layers"``, see :func:`stack`);
* ``group``: the optimizer group (:data:`GROUPS`), read by :mod:`jaxmoe.train.optim` for Muon/AdamW
  routing and the weight-decay mask. Each type has a default group.

* ``init``: the initialiser (:func:`normal`, :func:`ones`, :func:`zeros`).

Values are made in one place: a declaration holds only its shape until the outermost module
under construction is complete (``@builds`` on each ``__init__``); then :func:`materialize` draws
every parameter from the module's ``rngs``, leaf ``i`` (in sorted path order) from
``fold_in(root, i)``. So a whole stacked leaf ``[L, ...]`` is one draw, values do not depend on
construction order, and under ``jax.jit`` (sharded init) each value is created exactly once.

Stacked layers (the scanned layer stacks) are declared with their leading ``layers`` axis: every
module takes ``stack`` (``()`` for one layer, ``(L,)`` for a stack of L) and prepends it to its
shapes, and :func:`stack_axes` prepends ``"layers"`` to their axes.

Nothing else in jaxmoe lists parameters: shapes, logical axes, optimizer groups and the init come
from these declarations (:func:`declarations`), and the HF names from the architecture record
(:mod:`jaxmoe.archs`) keyed by the same paths.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.model.layers import linear, rms_norm

# optimizer groups: "matrix" (Muon under optim.optimizer=muon; AdamW with decay otherwise),
# "embed" (AdamW; decayed only if optim.decay_embeddings), "head" (AdamW, decayed), "vector"
# (norm scales and other per-feature vectors: AdamW, decayed only if optim.decay_norms)
GROUPS = ("matrix", "embed", "head", "vector")


class Weight(nnx.Param):
    """A trained parameter with ``axes`` and ``group`` metadata (see the module doc)."""

    default_group: ClassVar[str] = "matrix"
    hf_transpose: ClassVar[bool] = False  # HF stores the transpose of the last two dims

    def __init__(self, value, *, axes: tuple = (), group: str | None = None, **metadata):
        # (flax may rebuild a variable from its value and metadata: keep the signature generic;
        # declarations() checks axes against the shape)
        group = group or self.default_group
        if group not in GROUPS:
            raise ValueError(f"optimizer group {group!r} is not one of {GROUPS}")
        super().__init__(value, axes=tuple(axes), group=group, **metadata)

    @classmethod
    def declare(cls, shape, axes, init, **metadata):
        """A declaration of ``shape`` (value made later by :func:`materialize`)."""
        return cls(jax.ShapeDtypeStruct(tuple(shape), jnp.float32), axes=tuple(axes), init=init,
                   **metadata)


class Linear(Weight):
    """A linear map ``[in, out]``; ``w(x) = x @ w`` in ``x.dtype`` with fp32 accumulation."""

    hf_transpose = True

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.get_value())


class ExpertLinear(Weight):
    """Stacked per-expert linear maps ``[E, in, out]`` (an expert compute path applies them)."""

    hf_transpose = True


class RMSNorm(Weight):
    """An RMSNorm scale ``[D]`` (ones at init); ``norm(x)`` normalises over the last axis in fp32
    with the ``eps`` it was declared with."""

    default_group = "vector"

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.get_value(), self.get_metadata()["eps"])


class Embedding(Weight):
    """Token embedding ``[V, D]``: ``emb(tokens)`` looks rows up; :meth:`attend` is the tied head."""

    default_group = "embed"

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.get_value()[tokens]

    def attend(self, x: jax.Array) -> jax.Array:
        w = self.get_value()
        return jnp.einsum("bsd,vd->bsv", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


class Buffer(nnx.Variable):
    """Non-trained state (checkpointed with the model, never touched by the optimizer)."""

    def __init__(self, value, *, axes: tuple = (), **metadata):
        super().__init__(value, axes=tuple(axes), **metadata)

    @classmethod
    def declare(cls, shape, axes, init, **metadata):
        return cls(jax.ShapeDtypeStruct(tuple(shape), jnp.float32), axes=tuple(axes), init=init,
                   **metadata)


class ExpertBias(Buffer):
    """The aux-loss-free routing bias ``[E]`` (selection only), updated by the sign rule."""

    keep_fp32 = True  # stored fp32 whatever the weights' dtype (HF e_score_correction_bias)


# --------------------------------------------------------------------------------------------
# Initialisers (fp32 master weights) and materialisation
# --------------------------------------------------------------------------------------------


class Init(NamedTuple):
    """A declared initialiser: ``normal`` (``std``), ``ones`` or ``zeros``."""

    kind: str
    std: float = 0.0

    def __call__(self, key, shape) -> jax.Array:
        if self.kind == "normal":
            # the barrier keeps XLA from folding std into the sampler's own constants under jit,
            # so a jitted (sharded) init gives bit-for-bit the values of an eager one
            return jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32)) * self.std
        if self.kind == "ones":
            return jnp.ones(shape, jnp.float32)
        if self.kind == "zeros":
            return jnp.zeros(shape, jnp.float32)
        raise ValueError(f"unknown initialiser {self.kind!r}")


def normal(std: float) -> Init:
    return Init("normal", float(std))


def ones() -> Init:
    return Init("ones")


def zeros() -> Init:
    return Init("zeros")


def stack_axes(stack: tuple[int, ...], axes: tuple) -> tuple:
    """Logical axes of a declaration inside a layer stack: one ``"layers"`` axis per stack dim."""
    return ("layers",) * len(stack) + tuple(axes)


def _root_key(rngs: nnx.Rngs) -> jax.Array:
    """The root key of one model build from ``rngs`` (its ``params`` stream, else ``default``):
    the stream's key itself on first use (``nnx.Rngs(seed)`` -> ``jax.random.key(seed)``), then
    ``fold_in(key, count)``; the stream's count advances."""
    stream = rngs.params if "params" in rngs else rngs.default
    count = stream.count.get_value()
    key = stream.key.get_value()
    stream.count.set_value(count + 1)
    data = jnp.where(count == 0, jax.random.key_data(key), jax.random.key_data(jax.random.fold_in(key, count)))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def materialize(module: nnx.Module, rngs: nnx.Rngs) -> None:
    """Give every declared-but-empty variable of ``module`` its value: parameter ``i`` of the
    sorted parameter paths from ``fold_in(root, i)``, buffers from their (key-free) init."""
    flat = list(nnx.to_flat_state(nnx.state(module)))
    params = sorted("/".join(str(p) for p in path) for path, v in flat if isinstance(v, nnx.Param))
    index = {name: i for i, name in enumerate(params)}
    root = _root_key(rngs)
    for path, var in flat:
        value = var.get_value()
        if not isinstance(value, jax.ShapeDtypeStruct) or "init" not in var.get_metadata():
            continue
        init = var.get_metadata()["init"]
        name = "/".join(str(p) for p in path)
        key = jax.random.fold_in(root, index[name]) if name in index else None
        var.set_value(init(key, value.shape))


_BUILDING = contextvars.ContextVar("jaxmoe_building", default=False)


def builds(init_method):
    """Decorator for a module's ``__init__(..., rngs)``: when the module is the outermost one under
    construction, :func:`materialize` it at the end (inner modules leave their declarations
    empty for it)."""

    @functools.wraps(init_method)
    def wrapper(self, *args, rngs: nnx.Rngs, **kwargs):
        if _BUILDING.get():
            return init_method(self, *args, rngs=rngs, **kwargs)
        token = _BUILDING.set(True)
        try:
            init_method(self, *args, rngs=rngs, **kwargs)
        finally:
            _BUILDING.reset(token)
        materialize(self, rngs)

    return wrapper


# --------------------------------------------------------------------------------------------
# Reading the declarations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decl:
    """What a declaration says about one variable (a leaf of the canonical layout)."""

    path: str  # "/"-joined canonical path, e.g. "moe/experts/gate_proj"
    kind: type  # the variable's type (Linear, RMSNorm, ExpertBias, ...)
    shape: tuple[int, ...]
    dtype: object
    axes: tuple
    group: str | None  # optimizer group; None for buffers

    @property
    def trained(self) -> bool:
        return issubclass(self.kind, nnx.Param)

    @property
    def hf_transpose(self) -> bool:
        return bool(getattr(self.kind, "hf_transpose", False))


def declarations(module) -> dict[str, Decl]:
    """Every variable of ``module`` (an ``nnx.Module`` or ``nnx.State``, concrete or abstract) by
    canonical path, sorted."""
    state = module if isinstance(module, nnx.State) else nnx.state(module)
    out = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        value = var.get_value()
        name = "/".join(str(p) for p in path)
        if len(meta.get("axes", ())) != len(value.shape):
            raise ValueError(f"{name}: declared with logical axes {meta.get('axes')} for shape "
                             f"{tuple(value.shape)} (jaxmoe.model.params)")
        out[name] = Decl(name, type(var), tuple(value.shape), value.dtype, tuple(meta["axes"]),
                         meta.get("group"))
    return dict(sorted(out.items()))


__all__ = ["Buffer", "Decl", "Embedding", "ExpertBias", "ExpertLinear", "GROUPS", "Init", "Linear",
           "RMSNorm", "Weight", "builds", "declarations", "materialize", "normal", "ones", "stack_axes",
           "zeros"]
