"""A torchtitan run's training state in jaxmoe and back: ``train --resume-from dcp:STEP_DIR`` and
the ``dcp:`` sink's ``--with-optimizer``.

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

The mapping to jaxmoe (one table: :mod:`jaxmoe.port.titan_map`; torch AdamW and ``optax.adamw``
have the same moments, bias correction and decoupled decay): ``exp_avg`` / ``exp_avg_sq`` are
``ScaleByAdamState.mu`` / ``nu`` laid out like the parameter, the AdamW ``step`` is the optax
``count`` (also the schedule's), ``last_epoch`` is the update index of the next learning rate
(``lr_schedule(count)``), ``train_state.step`` is jaxmoe's step. The data position is the step:
both frameworks fed jaxmoe's batches, one per step, so jaxmoe continues at batch ``step``
(``{"seek_batch": step}``: a single ``tokens:``/``default`` source in windows packing, whose batch
is a function of its index; :meth:`jaxmoe.data.pipeline.DataIterator.restore` refuses others)
(``ntokens_seen`` is ``step * batch_size * seq_len`` then; anything else is noted).

Reading runs no code from the checkpoint (:meth:`jaxmoe.port.dcp_io.DcpDir.read_object`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.port import titan_map
from jaxmoe.port.dcp_io import DcpDir

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
# train --resume-from dcp:STEP_DIR
# --------------------------------------------------------------------------------------------

#: train fields the checkpoint's AdamW group fixes (field -> TitanTrainState attribute / value)
_FIXED = ("optimizer", "lr", "beta1", "beta2", "eps", "weight_decay", "decay_norms", "decay_embeddings")


class TitanResume:
    """``--resume-from dcp:STEP_DIR``: the opened checkpoint (weights through the ``dcp:`` source,
    training state through :func:`read_train_state`), what the run record keeps, and the state
    the loop starts from."""

    def __init__(self, src):
        self.src = src  # a jaxmoe.port.formats.dcp.DcpSource (weights, config, the DcpDir)
        self.what = f"--resume-from {src.ep}"
        self.ts = read_train_state(src.dir, src.cfg, self.what)
        self.notices = [n for n in src.notices if "skipping the training state" not in n]

    def fix_config(self, cfg: Config, given: set[str]) -> Config:
        """``cfg`` with the train fields the checkpoint's AdamW fixes (lr, betas, eps, weight
        decay on every parameter); a ``--set`` of one to another value is refused. The schedule
        must give the checkpoint's next learning rate at its step."""
        from jaxmoe.optim import lr_schedule  # late: jax

        ts, t = self.ts, cfg.train
        want = {"optimizer": "adamw", "lr": ts.initial_lr, "beta1": ts.betas[0], "beta2": ts.betas[1],
                "eps": ts.eps, "weight_decay": ts.weight_decay, "decay_norms": True, "decay_embeddings": True}
        for k in _FIXED:
            if f"train.{k}" in given and getattr(t, k) != want[k]:
                raise UserError(f"{self.what}: train.{k}={getattr(t, k)!r}, but the torchtitan run's AdamW has "
                                f"{want[k]!r} (one group, decay on every parameter); drop that --set")
            setattr(t, k, want[k])
        if ts.step >= t.steps:
            raise UserError(f"{self.what}: the checkpoint is at step {ts.step}; pass --steps N > {ts.step} "
                            "(the run's total, torchtitan's training.steps)")
        got = float(lr_schedule(t, t.lr)(ts.count))
        if not math.isclose(got, ts.lr, rel_tol=1e-5, abs_tol=1e-12):
            raise UserError(
                f"{self.what}: the checkpoint's next learning rate (update {ts.count}) is {ts.lr:.6g}, but "
                f"train.schedule={t.schedule} over train.steps={t.steps} (warmup {t.warmup_steps}) gives "
                f"{got:.6g}; set the torchtitan run's schedule (--steps, --set train.warmup_steps=, "
                "train.titan_decay_ratio=, train.titan_decay_type=, train.min_lr_ratio=)")
        tokens = ts.step * t.batch_size * t.seq_len
        if ts.ntokens_seen != tokens:
            self.notices.append(f"note: {self.what}: ntokens_seen={ts.ntokens_seen}, not step x batch x seq_len = "
                                f"{tokens}: torchtitan was fed other batches; jaxmoe continues at batch {ts.step}")
        return cfg

    def record(self) -> dict:
        """What run.json keeps of the source (re-opening needs the options)."""
        from jaxmoe.init_from import fingerprint

        return {"source": self.src.spec, "options": dict(self.src.ep.options), "fingerprint": fingerprint(self.src),
                "step": self.ts.step, "ntokens_seen": self.ts.ntokens_seen}

    def initial_state(self, cfg: Config, tx, shardings):
        """``(state, start step, data state)``: the weights and expert biases, AdamW's moments and
        count, the step; the data position is batch ``step`` (see the module doc)."""
        import jax
        import optax

        from jaxmoe.init_from import load_weights
        from jaxmoe.port.hf_map import unflatten
        from jaxmoe.step import opt_init_fn

        params, buffers = load_weights(cfg, self.src, shardings)
        rest = opt_init_fn(cfg, tx, shardings)(params, buffers)
        groups = grouped(optimizer_entries(cfg))
        moments = {}
        for m, which in MOMENTS.items():
            flat = {k: read_moment(self.src.dir, ents, self.src.shapes[k], which) for k, ents in groups.items()}
            moments[m] = unflatten(flat)["params"]
        found = []

        def put(new, old):  # onto the sharding jaxmoe's own init gave that leaf
            arr = np.asarray(new, old.dtype)
            if jax.process_count() == 1:
                return jax.device_put(arr, old.sharding)
            return jax.make_array_from_callback(arr.shape, old.sharding, lambda idx: arr[idx])

        def swap(node):
            if isinstance(node, optax.ScaleByAdamState):
                found.append(node)
                return node._replace(count=put(self.ts.count, node.count),
                                     mu=jax.tree.map(put, moments["mu"], node.mu),
                                     nu=jax.tree.map(put, moments["nu"], node.nu))
            if isinstance(node, optax.ScaleByScheduleState):
                return node._replace(count=put(self.ts.count, node.count))
            if isinstance(node, tuple) and hasattr(node, "_fields"):
                return type(node)(*[swap(x) for x in node])
            if isinstance(node, (tuple, list)):
                return type(node)(swap(x) for x in node)
            if isinstance(node, dict):
                return {k: swap(v) for k, v in node.items()}
            return node

        opt_state = swap(rest["opt_state"])
        if len(found) != 1:
            raise UserError(f"{self.what}: jaxmoe's optimizer has {len(found)} AdamW states; resuming needs "
                            "train.optimizer=adamw")
        state = {"params": params, "buffers": buffers, **rest, "opt_state": opt_state,
                 "step": put(self.ts.step, rest["step"])}
        return state, self.ts.step, {"seek_batch": self.ts.step}  # DataIterator.restore


def open_resume(spec: str, titan: str | None) -> TitanResume:
    """``--resume-from SPEC`` opened: a ``dcp:`` step directory with its ``--titan`` model."""
    from jaxmoe.port.formats import open_source, parse_endpoint

    ep = parse_endpoint(spec, "--resume-from")
    if ep.scheme != "dcp":
        raise UserError(f"--resume-from {spec}: continues a torchtitan run (dcp:STEP_DIR); a jaxmoe run "
                        "continues with --resume --out RUN_DIR")
    if not titan:
        raise UserError(f"--resume-from {spec}: name the model with --titan FAMILY/FLAVOR (or a jaxmoe "
                        "preset / config .toml): a DCP checkpoint holds no config")
    return TitanResume(open_source(ep.with_options(titan=titan)))


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


__all__ = ["GROUP_FIELDS", "MOMENTS", "OPT_STATE", "PARAM_GROUPS", "TitanResume", "TitanTrainState", "grouped",
           "open_resume", "optimizer_entries", "orbax_adam_prefix", "read_moment", "read_train_state"]
