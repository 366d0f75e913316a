"""The training loop: ``jaxmoe train``.

Read top to bottom: ``Trainer`` (data, the jitted step of :mod:`jaxmoe.step`, checkpoints
(:mod:`jaxmoe.checkpoint`), eval, metrics.jsonl, TensorBoard, progress bar, resume), then
``add_args`` / ``run``: the CLI. jax is imported inside the functions that need it, so that
``jaxmoe train --help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from jaxmoe.config import Config, config_to_toml, flops_per_token, load_config
from jaxmoe.errors import UserError


_LAZY = {"make_grad_fn": "objective", "router_stats": "objective", "split_micro_batches": "objective",
         "model_loss": "objective", "init_state": "step", "make_train_step": "step",
         "make_eval_step": "step", "device_peak_flops": "step"}


def __getattr__(name):
    # The step and the objective live in jaxmoe.step / jaxmoe.objective (they import jax); these
    # names stay importable from here (public API) without importing jax for `jaxmoe train --help`.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"jaxmoe.{_LAZY[name]}"), name)
    raise AttributeError(name)

# jax is imported lazily (inside functions) so that `jaxmoe --help` and config errors are instant.


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar with ETA on a terminal; plain periodic lines otherwise."""

    def __init__(self, total: int, start: int, stream=sys.stderr):
        self.total, self.start, self.stream = total, start, stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def update(self, step: int, text: str) -> None:
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 24
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {step}/{self.total} {text} eta {eta:5.0f}s"
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _to_py(x: Any) -> Any:
    import numpy as np

    if hasattr(x, "tolist"):
        x = np.asarray(x)
        v = x.tolist()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v
    return x


@dataclasses.dataclass
class RunResult:
    steps_done: int
    losses: list
    out: Path
    stopped: str = ""


class Trainer:
    """Owns a run directory::

        OUT/config.toml       the full config of the run
        OUT/metrics.jsonl     one JSON object per step (and eval records)
        OUT/checkpoints/N/    Orbax checkpoints (params, buffers, optimizer, step, RNG + data position)
        OUT/tb/               TensorBoard event files
    """

    def __init__(self, cfg: Config, out: Path, *, resume: bool = False, quiet: bool = False, mesh_ctx=None,
                 stop_after: int | None = None):
        self.cfg, self.out, self.resume, self.quiet = cfg, Path(out), resume, quiet
        self.stop_after = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
        self.mesh_ctx = mesh_ctx  # jaxmoe.mesh.MeshContext or None (single device)

    # -- set-up ---------------------------------------------------------------------------
    def _prepare_dir(self) -> None:
        ckpt_dir = self.out / "checkpoints"
        has_ckpt = ckpt_dir.exists() and any(ckpt_dir.iterdir())
        if self.resume:
            if not has_ckpt:
                raise UserError(
                    f"--resume: no checkpoint in {ckpt_dir}; run without --resume to start a new run"
                )
            return
        if has_ckpt or (self.out / "metrics.jsonl").exists():
            raise UserError(
                f"{self.out} already holds a run; pass --resume to continue it or choose another --out"
            )

    def run(self) -> RunResult:
        import jax
        import numpy as np

        from jaxmoe.checkpoint import Checkpointer
        from jaxmoe.data import make_data
        from jaxmoe.model.transformer import abstract_params, declared_groups, init_params
        from jaxmoe.optim import build_optimizer, lr_schedule
        from jaxmoe.step import device_peak_flops, init_state, make_eval_step, make_train_step

        cfg = self.cfg
        self._prepare_dir()
        pidx, pcount = jax.process_index(), jax.process_count()
        data = make_data(cfg, "train", process_index=pidx, process_count=pcount)
        if data.vocab_size > cfg.model.vocab_size:
            raise UserError(
                f"data vocabulary ({data.vocab_size} ids) exceeds model.vocab_size={cfg.model.vocab_size}; "
                "use a model with a larger vocab (--set model.vocab_size=N) or another tokenizer"
            )
        ctx = self.mesh_ctx
        dispatch = ctx.dispatch if ctx is not None else None

        params, buffers = init_params(cfg, cfg.train.seed) if not self.resume else (None, None)
        if self.resume:  # build abstract shapes for restore without materialising twice
            params, buffers = abstract_params(cfg)
        tx = build_optimizer(cfg.train, params, declared_groups(cfg))
        if self.resume:
            state = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
        else:
            state = init_state(cfg, tx, params, buffers)
        if ctx is not None:
            state = ctx.place_state(state)

        ckpt = Checkpointer(self.out / "checkpoints", keep=cfg.train.keep_checkpoints)
        start = 0
        if self.resume:
            step0 = ckpt.latest_step()
            state, meta = ckpt.restore(state, step=step0)
            data.restore(meta["data"])
            start = int(meta["step"])
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            if pidx == 0:
                (self.out / "config.toml").write_text(config_to_toml(cfg))

        step_fn = make_train_step(cfg, tx, dispatch=dispatch)
        eval_fn = make_eval_step(cfg, dispatch=dispatch)
        sched = lr_schedule(cfg.train, cfg.train.lr)
        peak, peak_src = device_peak_flops(cfg.train.dtype)
        n_dev = jax.device_count()
        fpt = flops_per_token(cfg)
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len

        writer = None
        if pidx == 0:
            try:
                from tensorboardX import SummaryWriter

                writer = SummaryWriter(str(self.out / "tb"))
            except ImportError:  # pragma: no cover - tensorboardX is a dependency
                writer = None
        metrics_f = open(self.out / "metrics.jsonl", "a") if pidx == 0 else None
        progress = Progress(cfg.train.steps, start) if (pidx == 0 and not self.quiet) else None
        losses, stopped = [], ""
        t_last = time.perf_counter()
        try:
            if start >= self.stop_after:
                raise UserError(
                    f"the run in {self.out} is already at step {start}; pass a larger --steps to continue it"
                )
            for step in range(start, self.stop_after):
                batch = data.next_batch()
                batch = ctx.place_batch(batch) if ctx is not None else {k: np.asarray(v) for k, v in batch.items()}
                state, m = step_fn(state, batch)
                m = jax.device_get(m)
                now = time.perf_counter()
                dt, t_last = now - t_last, now
                tok_s = tokens_per_step / dt
                rec = {
                    "step": step + 1,
                    "loss": _to_py(m["loss"]),
                    "ce": _to_py(m["ce"]),
                    "z_loss": _to_py(m["z_loss"]),
                    "lb": _to_py(m["lb"]),
                    "seq_aux": _to_py(m["seq_aux"]),
                    "router_z": _to_py(m["router_z"]),
                    "grad_norm": _to_py(m["grad_norm"]),
                    "lr": float(sched(step)),
                    "tokens_per_s": tok_s,
                    "mfu": fpt * tok_s / (peak * n_dev),
                    "skipped": bool(m["skipped"]),
                }
                if "expert_load" in m:
                    rec["expert_load_max_mean"] = _to_py(m["expert_load"])
                    rec["dropped_frac"] = _to_py(m["dropped_frac"])
                    rec["router_entropy"] = _to_py(m["router_entropy"])
                    rec["expert_counts"] = _to_py(np.asarray(m["counts"]).astype(np.int64))
                if step == start:
                    rec["mfu_peak_source"] = peak_src
                    rec["compile_included"] = True
                losses.append(rec["loss"])
                if rec["skipped"]:
                    print(
                        f"step {step + 1}: non-finite loss or gradient (loss={rec['loss']}, "
                        f"grad_norm={rec['grad_norm']}); update skipped",
                        file=sys.stderr,
                    )
                bad = int(jax.device_get(state["bad_steps"]))
                if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                    rec.update(self._eval(eval_fn, state))
                if metrics_f:
                    metrics_f.write(json.dumps(rec) + "\n")
                    metrics_f.flush()
                if writer is not None:
                    for k, v in rec.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                            writer.add_scalar(k, v, step + 1)
                if progress is not None and ((step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps):
                    progress.update(step + 1, f"loss {rec['loss']:.4f} {tok_s:,.0f} tok/s" if rec["loss"] is not None else "loss nan")
                if bad >= cfg.train.max_bad_steps:
                    stopped = (
                        f"stopped: {bad} non-finite steps in a row at step {step + 1} "
                        f"(train.max_bad_steps={cfg.train.max_bad_steps}); the last good checkpoint is intact "
                        f"in {self.out / 'checkpoints'}; lower train.lr or check the data"
                    )
                    break
                every = cfg.train.checkpoint_every
                if every and (step + 1) % every == 0 and bad == 0:
                    ckpt.save(step + 1, state, {"step": step + 1, "data": data.state(), "config": cfg.to_dict()})
            else:
                last = self.stop_after
                if last > start and ckpt.latest_step() != last and int(jax.device_get(state["bad_steps"])) == 0:
                    ckpt.save(last, state, {"step": last, "data": data.state(), "config": cfg.to_dict()})
        finally:
            ckpt.wait()
            ckpt.close()
            if progress:
                progress.close()
            if metrics_f:
                metrics_f.close()
            if writer is not None:
                writer.close()
        self.state = state
        return RunResult(steps_done=len(losses), losses=losses, out=self.out, stopped=stopped)

    def _eval(self, eval_fn, state) -> dict:
        import jax
        import numpy as np

        from jaxmoe.data import make_data

        cfg = self.cfg
        ev = make_data(cfg, "eval", process_index=jax.process_index(), process_count=jax.process_count())
        ctx = self.mesh_ctx
        tot = []
        for _ in range(cfg.train.eval_batches):
            b = ev.next_batch()
            b = ctx.place_batch(b) if ctx is not None else {k: np.asarray(v) for k, v in b.items()}
            tot.append(float(jax.device_get(eval_fn(state["params"], state["buffers"], b)["ce"])))
        return {"eval_ce": sum(tot) / len(tot)}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxmoe.cli import add_config_args

    add_config_args(p)
    p.add_argument("--steps", type=int, help="total steps (overrides train.steps)")
    p.add_argument("--out", help="run directory (default: runs/<preset>-<time>)")
    p.add_argument("--checkpoint-every", type=int, help="save every N steps (overrides train.checkpoint_every)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--data", help="default | tokens:PATH(.bin/.npy) | text:PATH (with --set train.tokenizer=...)")
    p.add_argument("--mesh", help="device mesh, e.g. replica=2,fsdp=2,expert=2 (one axis may be -1)")
    p.add_argument("--coordinator", help="multi-host: coordinator HOST:PORT for jax.distributed")
    p.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step, as if interrupted; "
                   "the LR schedule still spans --steps, so a later --resume continues the same run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _train_overrides(args) -> list[str]:
    extra = []
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.checkpoint_every is not None:
        extra.append(f"train.checkpoint_every={args.checkpoint_every}")
    if args.data is not None:
        extra.append(f"train.data={args.data}")
    return extra


# keys a resumed run may change without invalidating the checkpoint
_RESUME_MUTABLE = {
    ("train", "steps"), ("train", "checkpoint_every"), ("train", "eval_every"), ("train", "eval_batches"),
    ("train", "log_every"), ("train", "keep_checkpoints"), ("train", "max_bad_steps"),
    ("mesh", "replica"), ("mesh", "fsdp"), ("mesh", "expert"), ("mesh", "tensor"), ("mesh", "dispatcher"),
    ("mesh", "dispatch_chunks"), ("mesh", "xla_flags_profile"),
}


def resolve_config(args) -> tuple[Config, Path]:
    """The run's config and directory. On --resume the saved config is authoritative; flags may
    change only what does not alter the computation (steps, checkpoint cadence, mesh)."""
    extra = _train_overrides(args)
    if args.resume:
        if not args.out:
            raise UserError("--resume needs --out DIR (the run directory to continue)")
        out = Path(args.out)
        saved = out / "config.toml"
        if not saved.exists():
            raise UserError(f"--resume: {saved} not found; is {out} a jaxmoe run directory?")
        saved_cfg = load_config(path=saved)
        if args.preset or args.config:
            asked = load_config(preset=args.preset, path=args.config, overrides=list(args.overrides) + extra)
        else:
            asked = load_config(path=saved, overrides=list(args.overrides) + extra)
        for section in ("model", "moe", "mesh", "train"):
            a, b = getattr(asked, section), getattr(saved_cfg, section)
            for f in dataclasses.fields(a):
                if (section, f.name) in _RESUME_MUTABLE:
                    continue
                if getattr(a, f.name) != getattr(b, f.name):
                    raise UserError(
                        f"--resume: {section}.{f.name}={getattr(a, f.name)!r} differs from the run's "
                        f"saved {getattr(b, f.name)!r} in {saved}; only steps, checkpoint/eval cadence "
                        "and the mesh may change on resume"
                    )
        cfg = asked
        return cfg, out
    cfg = load_config(preset=args.preset, path=args.config, overrides=list(args.overrides) + extra)
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, out


def run(args) -> int:
    cfg, out = resolve_config(args)
    mesh_ctx = None
    if getattr(args, "mesh", None) or getattr(args, "coordinator", None) or _wants_mesh(cfg):
        from jaxmoe.mesh import setup_from_args

        cfg, mesh_ctx = setup_from_args(cfg, args)
    _check_data_path(cfg)
    trainer = Trainer(cfg, out, resume=args.resume, quiet=args.quiet, mesh_ctx=mesh_ctx,
                      stop_after=args.stop_after)
    res = trainer.run()
    if res.losses:
        first, last = res.losses[0], res.losses[-1]
        print(f"trained {res.steps_done} steps into {out}: loss {first:.4f} -> {last:.4f}" if first is not None and last is not None else f"trained {res.steps_done} steps into {out}")
    if res.stopped:
        print(res.stopped, file=sys.stderr)
        return 3
    return 0


def _wants_mesh(cfg: Config) -> bool:
    m = cfg.mesh
    return any(getattr(m, k) not in (1,) for k in ("replica", "fsdp", "expert", "tensor"))


def _check_data_path(cfg: Config) -> None:
    spec = cfg.train.data
    if spec == "default":
        return
    if ":" not in spec:
        raise UserError(f"--data {spec!r}: expected default, tokens:PATH or text:PATH")
    kind, path = spec.split(":", 1)
    if kind not in ("tokens", "text"):
        raise UserError(f"--data {spec!r}: unknown kind {kind!r}; expected tokens:PATH or text:PATH")
    if not os.path.exists(path):
        raise UserError(f"--data: {path} does not exist")
