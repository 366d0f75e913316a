"""Optimizers for jaxmoe: learning-rate schedules, AdamW with masked decay, and Muon.

Everything here works on generic parameter pytrees (nested dicts of arrays) and returns ``optax``
transformations, so the training loop only sees ``build_optimizer(cfg.optim, cfg.train.steps, params, groups)``. Which
parameter gets which treatment comes from its declared optimizer group (``matrix``, ``embed``,
``head``, ``vector``; :mod:`jaxmoe.model.params`), never from its name.

Two optimizer set-ups (``optim.optimizer``):

* ``adamw``: AdamW on every parameter (decoupled weight decay, masked by :func:`decay_mask`).
* ``muon``: Muon on every ``matrix`` parameter (:func:`param_labels` == "muon"), AdamW on the
  rest (embedding, LM head, norms, vectors).

Both start with global-norm gradient clipping computed the way ``torch.nn.utils.clip_grad_norm_``
does it (see :func:`clip_by_global_norm`), so that the PyTorch reference can use the stock torch
function.

Numerics contract with the PyTorch reference (``torch_ref``):

* AdamW == ``torch.optim.AdamW`` (bias correction, eps added outside the square root, decoupled
  decay ``p -= lr * wd * p``). ``optax.adamw`` already has exactly these semantics.
* Muon == ``torch.optim.Muon`` of torch 2.13 (see :func:`muon`), applied per matrix where a matrix
  is the *last two* dims of a leaf; leading dims (layers, experts) are batch dims.
* The learning rate of update ``t`` (0-based, the optax ``count``) is ``lr_schedule(t)``; a torch
  loop uses the same value for its ``t``-th ``optimizer.step()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmoe.config import schedule
from jaxmoe.config.schema import OptimConfig
from jaxmoe.train.muon_placement import orthogonalise
from jaxmoe.trees import key_path_str

# --------------------------------------------------------------------------------------------
# Learning-rate schedules: jaxmoe.config.schedule (one definition for jax and numpy)
# --------------------------------------------------------------------------------------------


def lr_schedule(ocfg: OptimConfig, steps: int, base_lr: float) -> Callable[[Any], jax.Array]:
    """:func:`jaxmoe.config.schedule.lr_schedule` in jax: ``step`` may be a traced integer."""
    return schedule.lr_schedule(ocfg, steps, base_lr, xp=jnp)


# --------------------------------------------------------------------------------------------
# Which parameters get Muon / weight decay: read from the declarations' optimizer groups
# --------------------------------------------------------------------------------------------


def param_labels(groups) -> Any:
    """``"muon"`` for every ``"matrix"`` parameter, ``"adamw"`` for the rest (embedding, LM head,
    norms, vectors); ``groups`` is the pytree of optimizer groups declared by the modules
    (:func:`jaxmoe.model.declared_groups`). Leading dims (layers, experts) are batch dims."""
    return jax.tree_util.tree_map(lambda g: "muon" if g == "matrix" else "adamw", groups)


def decay_mask(groups, ocfg: OptimConfig) -> Any:
    """True where AdamW applies weight decay: ``matrix`` and ``head`` always; ``vector`` (norms and
    other vectors) only if ``ocfg.decay_norms``; ``embed`` only if ``ocfg.decay_embeddings``."""

    def decide(g):
        if g == "embed":
            return bool(ocfg.decay_embeddings)
        if g == "vector":
            return bool(ocfg.decay_norms)
        if g in ("matrix", "head"):
            return True
        raise ValueError(f"unknown optimizer group {g!r}")

    return jax.tree_util.tree_map(decide, groups)


# --------------------------------------------------------------------------------------------
# Gradient clipping (torch.nn.utils.clip_grad_norm_ semantics)
# --------------------------------------------------------------------------------------------


def global_norm(tree) -> jax.Array:
    """The fp32 L2 norm of all leaves of ``tree`` together. The train step's ``grad_norm`` and the
    clipping below use this one expression, so XLA computes it once per step (common-
    subexpression elimination merges the identical computations)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (global_norm + 1e-6))``.

    This is ``torch.nn.utils.clip_grad_norm_``'s rule (note the ``+ 1e-6``), which differs
    slightly from ``optax.clip_by_global_norm`` (``max_norm / global_norm`` only when above);
    we follow torch so that the reference can call the stock torch function.
    """

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
        return jax.tree_util.tree_map(lambda g: (g * coef).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------------------------
# Muon
# --------------------------------------------------------------------------------------------


class MuonState(NamedTuple):
    count: jax.Array  # number of updates done (int32), indexes the learning-rate schedule
    momentum: Any  # momentum buffers, like params, fp32


def _lerp(start: jax.Array, end: jax.Array, weight: float) -> jax.Array:
    """``start + weight * (end - start)`` rounded like torch's CPU ``lerp`` (weight cast to fp32;
    for ``|weight| >= 0.5`` torch computes ``end + (weight - 1) * (end - start)`` instead). The
    float32 rounding of the momentum buffer decides which way Newton–Schulz's bf16 input rounds,
    so matching it keeps Muon bit-compatible with torch far more often than the textbook form."""
    w = np.float32(weight)
    if abs(w) < 0.5:
        return start + w * (end - start)
    return end + (w - np.float32(1.0)) * (end - start)


def _newton_schulz(g: jax.Array, coeffs, steps: int, eps: float, dtype) -> jax.Array:
    """torch.optim.Muon's Newton–Schulz orthogonalisation of the matrices in the last two dims.

    ``g`` must already be in *torch orientation* (``[..., out, in]``); see :func:`muon`. Steps, as
    in torch: cast to ``dtype``; if the matrix is tall (rows > cols) work on its transpose;
    divide by ``max(frobenius_norm, eps)``; then ``steps`` times
    ``A = X X^T;  B = b A + c A A;  X = a X + B X``; transpose back.

    Rounding follows torch's CPU kernels as closely as XLA lets us: matmuls accumulate in fp32
    (``preferred_element_type``) and the ``addmm`` combinations are formed in fp32 and rounded to
    ``dtype`` once, as torch's bf16 ``addmm`` does. The norm is reduced in fp32 and rounded to
    ``dtype``, like torch's bf16 ``norm()``.
    """
    a, b, c = (float(v) for v in coeffs)
    x = g.astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    f32 = jnp.float32
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(f32)), axis=(-2, -1), keepdims=True)).astype(dtype)
    norm = jnp.maximum(norm, jnp.asarray(eps, dtype))
    x = (x.astype(f32) / norm.astype(f32)).astype(dtype)

    def mm(p, q):  # batched p @ q over leading dims, fp32 accumulation and result
        return jnp.matmul(p, q, preferred_element_type=f32)

    for _ in range(steps):
        gram = mm(x, jnp.swapaxes(x, -1, -2)).astype(dtype)
        upd = (b * gram.astype(f32) + c * mm(gram, gram)).astype(dtype)
        x = (a * x.astype(f32) + mm(upd, x)).astype(dtype)
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    return x


def _lr_ratio(shape, adjust_lr: str) -> float:
    """Muon's lr adjustment for a matrix ``[..., in, out]`` (torch's ``A, B`` = ``out, in``)."""
    n_in, n_out = shape[-2], shape[-1]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, n_out / n_in))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(n_in, n_out))
    return 1.0


def muon(
    learning_rate,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr: str = "original",
    weight_decay: float = 0.1,
    ns_dtype: str = "bfloat16",
    placement: str = "replicated",
    shardings=None,
) -> optax.GradientTransformation:
    """Muon, reproducing ``torch.optim.Muon`` (torch 2.13) on jaxmoe's ``[..., in, out]`` weights.

    Per leaf (``learning_rate`` may be a float or a schedule of the update index)::

        buf    = momentum * buf + (1 - momentum) * g              (torch: buf.lerp_(g, 1 - mu))
        u      = (1 - momentum) * g + momentum * buf if nesterov else buf   (g.lerp(buf, mu))
        O      = NewtonSchulz(u)           in ns_dtype ("bfloat16" as torch, or "float32")
        update = -lr * weight_decay * param - adjusted_lr * O      (decay uses the *unadjusted* lr)

    ``adjusted_lr``: "original" ``lr * sqrt(max(1, out/in))``; "match_rms_adamw"
    ``lr * 0.2 * sqrt(max(in, out))``; "none" ``lr``.

    Orientation. jaxmoe stores a linear map as ``W [in, out]``; torch stores ``W.T [out, in]``.
    Mathematically NS commutes with transposition, but bf16 rounding does not, and torch's
    shape-dependent choices (transpose tall matrices; ``adjust_lr``'s ``A, B = shape[:2]`` =
    ``(out, in)``) are defined on its own orientation. So we swap the last two axes into torch's
    orientation, run torch's algorithm there, and swap back: jaxmoe's update of ``W`` is then
    exactly the transpose of torch's update of ``W.T``.

    Leading dims are batch dims: a stacked ``[Lm, E, in, out]`` expert weight is orthogonalised
    per (layer, expert) matrix, with its own norm.

    Placement of Newton–Schulz on a mesh (``shardings``: a pytree like the params, of their
    ``NamedSharding``s, or None): ``"replicated"`` lets XLA place it (a sharded matrix is gathered
    wherever it is orthogonalised); ``"owner"`` (:mod:`jaxmoe.train.muon_placement`) orthogonalises whole
    matrices where they live (experts) and gives every other matrix to one owner device, balanced
    by NS FLOPs. The same values either way; without ``shardings`` both are the plain computation.
    """
    for name, value, allowed in (("adjust_lr", adjust_lr, ("original", "match_rms_adamw", "none")),
                                 ("ns_dtype", ns_dtype, ("bfloat16", "float32")),
                                 ("placement", placement, ("replicated", "owner"))):
        if value not in allowed:
            raise ValueError(f"muon {name}={value!r} is not one of {', '.join(allowed)}")
    dtype = jnp.bfloat16 if ns_dtype == "bfloat16" else jnp.float32
    by_path = {} if shardings is None else {
        key_path_str(kp): s for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    lr_fn = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

    def init(params):
        bufs = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return MuonState(count=jnp.zeros([], jnp.int32), momentum=bufs)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("muon needs params (decoupled weight decay); pass params to update()")
        lr = jnp.asarray(lr_fn(state.count), jnp.float32)

        def momentum_step(g, buf):
            if g.ndim < 2:
                raise ValueError(f"muon got a leaf of shape {g.shape}; it needs matrices")
            g32 = g.astype(jnp.float32)
            buf = _lerp(buf, g32, 1.0 - momentum)  # = momentum * buf + (1 - momentum) * g
            u = _lerp(g32, buf, momentum) if nesterov else buf  # = (1 - mu) * g + mu * buf
            return u, buf

        def ns(u):  # whole matrices [..., in, out] -> their orthogonalisation, same layout
            u_t = jnp.swapaxes(u, -1, -2)  # torch orientation [.., out, in]
            return jnp.swapaxes(_newton_schulz(u_t, ns_coefficients, ns_steps, eps, dtype), -1, -2)

        def apply(o, p):
            # Form the new parameter as torch does (decay, then subtract) and return the
            # difference: p + (new - p) == new exactly for small steps (Sterbenz), so an optax
            # apply_updates reproduces torch's rounding instead of adding a re-associated sum.
            p32 = p.astype(jnp.float32)
            new = p32 * (1.0 - lr * weight_decay) - (lr * _lr_ratio(p.shape, adjust_lr)) * o.astype(jnp.float32)
            return (new - p32).astype(p.dtype)

        keyed, treedef = jax.tree_util.tree_flatten_with_path(updates)
        paths = [key_path_str(kp) for kp, _ in keyed]
        flat_b = treedef.flatten_up_to(state.momentum)
        flat_p = treedef.flatten_up_to(params)
        steps = [momentum_step(g, b) for (_, g), b in zip(keyed, flat_b)]
        # NS casts its input to ns_dtype first: cast before placing it (half the bytes in bf16)
        us = {path: u.astype(dtype) for path, (u, _) in zip(paths, steps)}
        if placement == "owner" and by_path:
            os_ = orthogonalise(us, by_path, ns, ns_steps)
        else:
            os_ = {path: ns(u) for path, u in us.items()}
        new_updates = treedef.unflatten([apply(os_[path], p) for path, p in zip(paths, flat_p)])
        new_bufs = treedef.unflatten([b for _, b in steps])
        return new_updates, MuonState(count=optax.safe_increment(state.count), momentum=new_bufs)

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------------------------
# The optimizer of a training run
# --------------------------------------------------------------------------------------------


def _adamw(ocfg: OptimConfig, steps: int, mask) -> optax.GradientTransformation:
    return optax.adamw(
        learning_rate=lr_schedule(ocfg, steps, ocfg.lr),
        b1=ocfg.beta1,
        b2=ocfg.beta2,
        eps=ocfg.eps,
        weight_decay=ocfg.weight_decay,
        mask=mask,
    )


def build_optimizer(ocfg: OptimConfig, steps: int, params, groups, shardings=None) -> optax.GradientTransformation:
    """Gradient clipping (``ocfg.grad_clip``; 0 = off) then AdamW, or Muon + AdamW.

    ``groups``: the optimizer group of every parameter, a pytree like ``params`` (the modules'
    declarations: :func:`jaxmoe.model.declared_groups`). ``adamw``: :func:`optax.adamw` with
    ``lr_schedule(ocfg, steps, ocfg.lr)`` on all params, decay masked by :func:`decay_mask`. ``muon``:
    ``optax.multi_transform`` over :func:`param_labels`, Muon (``lr_schedule(ocfg, steps, ocfg.muon_lr)``,
    ``ocfg.muon_*``) on "muon" leaves and the same AdamW on "adamw" leaves. ``params`` is only
    used for its structure. ``shardings``: the params' ``NamedSharding``s (a pytree like
    ``params``) on a mesh, read by Muon's ``ocfg.muon_placement`` (:mod:`jaxmoe.train.muon_placement`).
    """
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(groups):
        raise ValueError("build_optimizer: groups do not have the structure of params")
    mask = decay_mask(groups, ocfg)
    if ocfg.optimizer == "adamw":
        opt = _adamw(ocfg, steps, mask)
    elif ocfg.optimizer == "muon":
        labels = param_labels(groups)
        # Inside multi_transform the AdamW branch sees the non-adamw leaves as MaskedNode, so its
        # decay mask must have the same MaskedNode placeholders.
        adamw_mask = jax.tree_util.tree_map(
            lambda m, lab: m if lab == "adamw" else optax.MaskedNode(), mask, labels
        )
        opt = optax.multi_transform(
            {
                "muon": muon(
                    lr_schedule(ocfg, steps, ocfg.muon_lr),
                    momentum=ocfg.muon_momentum,
                    nesterov=ocfg.muon_nesterov,
                    ns_coefficients=tuple(ocfg.muon_ns_coefficients),
                    ns_steps=ocfg.muon_ns_steps,
                    eps=ocfg.muon_eps,
                    adjust_lr=ocfg.muon_adjust_lr,
                    weight_decay=ocfg.muon_weight_decay,
                    ns_dtype=ocfg.muon_ns_dtype,
                    placement=ocfg.muon_placement,
                    shardings=shardings,
                ),
                "adamw": _adamw(ocfg, steps, adamw_mask),
            },
            labels,
        )
    else:
        raise ValueError(f"optim.optimizer={ocfg.optimizer!r} is not one of adamw, muon")
    if ocfg.grad_clip > 0:
        opt = optax.chain(clip_by_global_norm(ocfg.grad_clip), opt)
    return opt


__all__ = [
    "MuonState",
    "build_optimizer",
    "clip_by_global_norm",
    "global_norm",
    "decay_mask",
    "lr_schedule",
    "muon",
    "param_labels",
]
