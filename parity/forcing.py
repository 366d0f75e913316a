"""Parity that stays strict after a near-tie: when a training step's routing differs between the
sides on near-ties only, the jax run is replayed from that step on with the reference's expert
choices, so every later state is still compared at rounding-level tolerances.

Why: a near-tie flip (a token whose top-k decision gap is below ``tie_gap``, which rounding alone
explains) sends one token to another expert; its count moves the expert bias by a sign step and
the optimizer's update moves that expert's weights, so the two runs become two trajectories and
every later check could only be a figure (:func:`parity.checks.compare_steps`, "parting at a
near-tie"). Forcing the reference's routing from that step on, as ``--force-routing`` does for
the forward, keeps the trajectories together: the losses, every parameter and the bias after
every later step are held to the strict tolerances, and a bug introduced later still fails.

A step whose first routing difference holds a *real* flip (a clear gap) is not forced: it fails
where it happens. The report says ``forced_from_step`` (None when nothing was forced) and the
tie's margin (the largest decision gap among the flipped tokens, <= ``tie_gap``).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxmoe.config import Config
from parity.checks import parting_step
from parity.tolerances import Tolerances


def force_after_near_tie(cfg: Config, jt: dict, tt: dict, tol: Tolerances,
                         rerun: Callable[[list], dict]) -> tuple[dict, dict | None]:
    """``jt``/``tt``: each side's natural training record (``routing`` per step, from
    :func:`parity.checks.routing_record`). If the first step ``s`` whose routing differs holds
    near-tie flips only, ``rerun(forced)`` trains the jax side again with ``forced[i]`` (the
    reference's ``idx [Lm, T, k]`` for ``i >= s``, None before) and its record replaces ``jt``.
    Returns ``(jt, info)``; ``info`` is None when nothing was forced, else
    ``{"forced_from_step", "tie_margin", "layers"}`` (the flips that caused it)."""
    if not (jt.get("routing") and tt.get("routing")):
        return jt, None
    parting = parting_step(cfg, jt, tt, tol)
    if parting is None:
        return jt, None
    s, layers = parting
    if sum(info["real"] for info in layers):
        return jt, None  # a real flip: compare_steps fails at step_routing[s]
    forced = [None] * s + [rec["idx"] for rec in tt["routing"][s:]]
    out = rerun(forced)
    margins = [info["max_near_tie_gap"] for info in layers if info["max_near_tie_gap"] is not None]
    info = {"forced_from_step": s, "tie_margin": max(margins) if margins else None,
            "layers": [x for x in layers if x["mismatched_tokens"]]}
    return out, info


def strict_fraction(items: list[dict]) -> float:
    """The fraction of a report's checks held to a tolerance (the rest are figures)."""
    return sum(c.get("tolerance") is not None for c in items) / max(1, len(items))


__all__ = ["force_after_near_tie", "strict_fraction"]
