"""``train --resume-from dcp:STEP_DIR``: a torchtitan run continued by jaxmoe from its full
checkpoint -- the weights through the ``dcp:`` source, the training state (AdamW moments and count,
param group, scheduler position, train state) through :mod:`jaxmoe.port.maps.titan_state`, which
also documents the layout and the mapping.
"""

from __future__ import annotations

import math

import numpy as np

from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.port.maps.titan_state import MOMENTS, grouped, optimizer_entries, read_moment, read_train_state

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
        """``cfg`` with the optim fields the checkpoint's AdamW fixes (lr, betas, eps, weight
        decay on every parameter); a ``--set`` of one to another value is refused. The schedule
        must give the checkpoint's next learning rate at its step."""
        from jaxmoe.train.optim import lr_schedule  # late: jax

        ts, o, t = self.ts, cfg.optim, cfg.train
        want = {"optimizer": "adamw", "lr": ts.initial_lr, "beta1": ts.betas[0], "beta2": ts.betas[1],
                "eps": ts.eps, "weight_decay": ts.weight_decay, "decay_norms": True, "decay_embeddings": True}
        for k in _FIXED:
            if {f"optim.{k}", f"train.{k}"} & given and getattr(o, k) != want[k]:
                raise UserError(f"{self.what}: optim.{k}={getattr(o, k)!r}, but the torchtitan run's AdamW has "
                                f"{want[k]!r} (one group, decay on every parameter); drop that --set")
            setattr(o, k, want[k])
        if ts.step >= t.steps:
            raise UserError(f"{self.what}: the checkpoint is at step {ts.step}; pass --steps N > {ts.step} "
                            "(the run's total, torchtitan's training.steps)")
        got = float(lr_schedule(o, t.steps, o.lr)(ts.count))
        if not math.isclose(got, ts.lr, rel_tol=1e-5, abs_tol=1e-12):
            raise UserError(
                f"{self.what}: the checkpoint's next learning rate (update {ts.count}) is {ts.lr:.6g}, but "
                f"optim.schedule={o.schedule} over train.steps={t.steps} (warmup {o.warmup_steps}) gives "
                f"{got:.6g}; set the torchtitan run's schedule (--steps, --set optim.warmup_steps=, "
                "optim.titan_decay_ratio=, optim.titan_decay_type=, optim.min_lr_ratio=)")
        tokens = ts.step * t.batch_size * t.seq_len
        if ts.ntokens_seen != tokens:
            self.notices.append(f"note: {self.what}: ntokens_seen={ts.ntokens_seen}, not step x batch x seq_len = "
                                f"{tokens}: torchtitan was fed other batches; jaxmoe continues at batch {ts.step}")
        return cfg

    def record(self) -> dict:
        """What run.json keeps of the source (re-opening needs the options)."""
        from jaxmoe.train.init_from import fingerprint

        return {"source": self.src.spec, "options": dict(self.src.ep.options), "fingerprint": fingerprint(self.src),
                "step": self.ts.step, "ntokens_seen": self.ts.ntokens_seen}

    def initial_state(self, cfg: Config, tx, shardings):
        """``(state, start step, data state)``: the weights and expert biases, AdamW's moments and
        count, the step; the data position is batch ``step`` (see the module doc)."""
        import jax
        import optax

        from jaxmoe.port.maps.hf_map import unflatten
        from jaxmoe.train.init_from import load_weights
        from jaxmoe.train.step import opt_init_fn

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
                            "optim.optimizer=adamw")
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


__all__ = ["TitanResume", "open_resume"]
