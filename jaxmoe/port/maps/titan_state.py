"""A torchtitan run's training state as jaxmoe's: the names, the checks and the reads that
``train --resume-from dcp:STEP_DIR`` (:mod:`jaxmoe.train.titan_resume`) and the ``dcp:`` sink's
``--with-optimizer`` (:mod:`jaxmoe.port.formats.dcp`) share.

What a torchtitan 0.3.0 full checkpoint (``CheckpointManager``, one ``OptimizersContainer`` over
AdamW, ``LRSchedulersContainer``) holds besides the model, as DCP flattens it:

* ``optimizer.state.<param fqn>.{exp_avg, exp_avg_sq, step}``: torch AdamW's moments (the
  parameter's shape) and its update count (a float32 scalar tensor), per *module parameter*
  (a GQA layer's fused ``wqkv``, not the state dict's split ``wq``/``wk``/``wv``);
* ``optimizer.param_groups.<param fqn>.<field>`` (byte items): the parameter's group --
  :data:`GROUP_FIELDS`, ``lr`` being the learning rate of the *next* update;
* ``lr_scheduler.last_epoch`` (a byte item): the number of scheduler steps = training steps;
* ``train_state.step`` / ``train_state.ntokens_seen`` (byte items, or scalar tensors);
* ``dataloader``: the loader's own state (``None`` without one).

The mapping to jaxmoe (one table: :mod:`jaxmoe.port.maps.titan_map`; torch AdamW and ``optax.adamw``
have the same moments, bias correction and decoupled decay): ``exp_avg`` / ``exp_avg_sq`` are
``ScaleByAdamState.mu`` / ``nu`` laid out like the parameter, the AdamW ``step`` is the optax
``count`` (also the schedule's), ``last_epoch`` is the update index of the next learning rate
(``lr_schedule(count)``), ``train_state.step`` is jaxmoe's step. The data position is the step:
both frameworks fed jaxmoe's batches, one per step, so jaxmoe continues at batch ``step``
(``{"seek_batch": step}``: a single ``tokens:``/``default`` source in windows packing, whose batch
is a function of its index; :meth:`jaxmoe.data.pipeline.DataIterator.restore` refuses others)
(``ntokens_seen`` is ``step * batch_size * seq_len`` then; anything else is noted).

Reading runs no code from the checkpoint (:meth:`jaxmoe.port.io.dcp_io.DcpDir.read_object`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.port.io.dcp_io import DcpDir
from jaxmoe.port.maps import titan_map

OPT_STATE = "optimizer.state."
PARAM_GROUPS = "optimizer.param_groups."
MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
#: a torch 2.13 AdamW param group's fields, in the order torchtitan's checkpoint lists them
GROUP_FIELDS = ("fused", "foreach", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                "capturable", "differentiable", "decoupled_weight_decay", "initial_lr")


def optimizer_entries(cfg: Config) -> list[titan_map.TitanEntry]:
    """The rows of the name table that carry optimizer state: trained parameters, by module
    parameter name (fused ``wqkv`` rows included)."""
    return [e for e in titan_map.titan_entries(cfg) if e.key.startswith("params/")]


def grouped(entries) -> dict[str, list[titan_map.TitanEntry]]:
    out: dict[str, list[titan_map.TitanEntry]] = {}
    for e in entries:
        out.setdefault(e.key, []).append(e)
    return out


@dataclasses.dataclass
class TitanTrainState:
    """The non-weight state of a torchtitan full checkpoint (see the module doc)."""

    step: int  # train_state.step
    ntokens_seen: int
    count: int  # AdamW's update count (every parameter's ``step``)
    last_epoch: int
    lr: float  # the learning rate of the next update
    initial_lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def read_train_state(d: DcpDir, cfg: Config, what: str) -> TitanTrainState:
    """The training state of the checkpoint ``d`` of ``cfg``'s model, checked: AdamW state for
    every parameter with its shape, one param group, steps that agree (one line otherwise)."""
    ents = optimizer_entries(cfg)
    names = sorted({e.name for e in ents})
    if not any(n.startswith(OPT_STATE) for n in d.tensors):
        raise UserError(f"{what}: a model-only checkpoint (no optimizer state); start from its "
                        "weights with --init-from instead (fresh optimizer and schedule)")
    fields = sorted({n[len(OPT_STATE) + len(names[0]) + 1:] for n in d.tensors
                     if n.startswith(f"{OPT_STATE}{names[0]}.")})
    if "exp_avg" not in fields or "exp_avg_sq" not in fields:
        raise UserError(f"{what}: the optimizer state of {names[0]} holds {', '.join(fields) or 'nothing'}, "
                        "not AdamW's exp_avg / exp_avg_sq; jaxmoe resumes torchtitan's AdamW only")
    shape = {e.name: e.shape for e in ents}
    counts = set()
    for n in names:
        for f in ("exp_avg", "exp_avg_sq", "step"):
            fqn = f"{OPT_STATE}{n}.{f}"
            if fqn not in d.tensors:
                raise UserError(f"{what}: {fqn} is missing (every parameter of the model needs its AdamW state)")
            if f != "step" and d.shape(fqn) != shape[n]:
                raise UserError(f"{what}: {fqn} has shape {list(d.shape(fqn))}, the model's {n} is {list(shape[n])}")
        counts.add(float(d.read_object(f"{OPT_STATE}{n}.step")))
    if len(counts) != 1:
        raise UserError(f"{what}: AdamW step counts differ between parameters ({sorted(counts)[:4]})")
    group = _one_group(d, names, what)
    if group.get("amsgrad") or group.get("maximize") or not group.get("decoupled_weight_decay", False):
        raise UserError(f"{what}: the optimizer is not plain AdamW (amsgrad={group.get('amsgrad')}, maximize="
                        f"{group.get('maximize')}, decoupled_weight_decay={group.get('decoupled_weight_decay')}); "
                        "jaxmoe resumes torchtitan's AdamW only")
    need = ("train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch")
    missing = [n for n in need if n not in d.tensors and n not in d.byte_items]
    if missing:
        raise UserError(f"{what}: {missing[0]} is missing (not a full torchtitan checkpoint)")
    step, ntok, last = (int(d.read_object(n)) for n in need)
    count = int(counts.pop())
    if not step == count == last:
        raise UserError(f"{what}: train_state.step={step}, AdamW step={count} and lr_scheduler.last_epoch="
                        f"{last} disagree; jaxmoe resumes a checkpoint where they are equal")
    b1, b2 = group["betas"]
    return TitanTrainState(step=step, ntokens_seen=ntok, count=count, last_epoch=last, lr=float(group["lr"]),
                           initial_lr=float(group.get("initial_lr", group["lr"])), betas=(float(b1), float(b2)),
                           eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))


def _one_group(d: DcpDir, names, what: str) -> dict:
    """The param group fields, the same for every parameter (torchtitan's one AdamW group)."""
    first = None
    for n in names:
        g = {}
        for f in ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                  "decoupled_weight_decay"):
            fqn = f"{PARAM_GROUPS}{n}.{f}"
            if fqn in d.byte_items or fqn in d.tensors:
                g[f] = d.read_object(fqn)
        for f in ("lr", "betas", "eps", "weight_decay"):
            if f not in g:
                raise UserError(f"{what}: {PARAM_GROUPS}{n}.{f} is missing (not an AdamW param group)")
        if first is None:
            first = (n, g)
        elif g != first[1]:
            diff = next(f for f in g if g.get(f) != first[1].get(f))
            raise UserError(f"{what}: parameters {first[0]} and {n} are in different param groups ({diff} "
                            f"{first[1].get(diff)!r} vs {g.get(diff)!r}); jaxmoe's AdamW has one")
    return first[1]


def read_moment(d: DcpDir, cfg_entries: list[titan_map.TitanEntry], shape, which: str) -> np.ndarray:
    """One jaxmoe leaf of ``exp_avg`` / ``exp_avg_sq`` (fp32), from its torchtitan tensors."""
    out = np.empty(shape, np.float32)
    cache: tuple[str, np.ndarray] | None = None
    for ent in cfg_entries:
        fqn = f"{OPT_STATE}{ent.name}.{which}"
        if cache is None or cache[0] != fqn:
            cache = (fqn, d.read(fqn))
        part = titan_map.jax_part(cache[1], ent)
        if ent.index:
            out[ent.index] = part
        else:
            out[...] = part
    return out


# --------------------------------------------------------------------------------------------
# The dcp: sink's --with-optimizer: jaxmoe's AdamW state as torchtitan's
# --------------------------------------------------------------------------------------------


def orbax_adam_prefix(state_dir: Path, what: str) -> tuple[str, str]:
    """``(path of ScaleByAdamState in the stored tree, path of the state's step)`` of a jaxmoe
    training checkpoint: ``opt_state/1/0`` for clipping + AdamW, ``opt_state/0`` without
    clipping; a one-line error for a checkpoint without AdamW moments (Muon's ``opt_state``
    has other leaves)."""
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(state_dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if "opt_state" not in tree:
        raise UserError(f"{what}: the checkpoint holds no optimizer state")
    hits = []

    def walk(node, path):
        if isinstance(node, dict):
            if "mu" in node and "nu" in node and "count" in node:
                hits.append(path)
            items = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        else:
            return
        for k, v in items:
            walk(v, f"{path}/{k}")

    walk(tree["opt_state"], "opt_state")
    if len(hits) != 1:
        raise UserError(f"{what}: the checkpoint's optimizer state has {len(hits)} AdamW moment sets; "
                        "--with-optimizer writes one AdamW state (torchtitan's)")
    return hits[0], "step"


__all__ = ["GROUP_FIELDS", "MOMENTS", "OPT_STATE", "PARAM_GROUPS", "TitanTrainState", "grouped",
           "optimizer_entries", "orbax_adam_prefix", "read_moment", "read_train_state"]
