"""``jaxmoe train``: flags, the run's config (new, resumed or initialised from a checkpoint), and
the exit status. The loop itself is :mod:`jaxmoe.train.loop`; the step :mod:`jaxmoe.train.step`.

Exit status: 0 finished; 2 bad input (one line on stderr, nothing written); 3 stopped after
``train.max_bad_steps`` non-finite steps in a row; 75 preempted by SIGTERM/SIGINT after saving a
checkpoint (continue with ``--resume``); 130 aborted by a second signal (the last committed
checkpoint is intact).

jax is imported only when a run starts (inside :func:`run`), so that ``jaxmoe train --help`` and
config errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from jaxmoe.config import SECTIONS, Config, config_from_dict, load_config
from jaxmoe.errors import UserError

# jax is imported lazily (inside functions) so that `jaxmoe --help` and config errors are instant.


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxmoe.config.cli import add_config_args
    from jaxmoe.port import formats

    add_config_args(p)
    p.add_argument("--steps", type=int, help="total steps (overrides train.steps)")
    p.add_argument("--out", help="run directory (default: runs/<preset>-<time>)")
    p.add_argument("--checkpoint-every", type=int, help="save every N steps (overrides checkpoint.every)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint that restores (a run "
                        "that never saved starts over from step 0 with its saved config)")
    p.add_argument("--resume-step", type=int, help="with --resume: restore this checkpoint step")
    p.add_argument("--init-from", metavar="SRC",
                   help="start from the weights of hf:DIR | orbax:RUN_DIR[@STEP] | torch:FILE | "
                        "dcp:STEP_DIR (model config from the source or --titan; fresh optimizer "
                        "and schedule)")
    p.add_argument("--resume-from", metavar="dcp:STEP_DIR",
                   help="continue a torchtitan run from its full checkpoint step (with --titan naming "
                        "its model): weights, expert biases, AdamW moments, step, LR schedule position "
                        "and data position (batch = step) into a new run --out")
    formats.add_arguments(p, ("source",))
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache (also JAXMOE_COMPILE_CACHE=0)")
    p.add_argument("--data", help="default | tokens:PATH(.bin/.npy) | text:PATH (with --set data.tokenizer=...) | "
                   "mix:0.7*SPEC,0.3*SPEC")
    p.add_argument("--mesh", help="device mesh, e.g. replica=2,fsdp=2,expert=2 (one axis may be -1)")
    p.add_argument("--coordinator", help="multi-host: coordinator HOST:PORT for jax.distributed")
    p.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index")
    p.add_argument("--init-timeout", type=float, default=300.0,
                   help="multi-host: seconds to wait for every process at start-up (default 300)")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step, as if interrupted; "
                   "the LR schedule still spans --steps, so a later --resume continues the same run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _train_overrides(args) -> list[str]:
    extra = []
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.checkpoint_every is not None:
        extra.append(f"checkpoint.every={args.checkpoint_every}")
    if args.data is not None:
        extra.append(f"data.source={args.data}")
    return extra


# keys a resumed run may change without invalidating the checkpoint
_RESUME_MUTABLE = {
    ("train", "steps"), ("checkpoint", "every"), ("train", "eval_every"), ("train", "eval_batches"),
    ("train", "log_every"), ("checkpoint", "keep"), ("train", "max_bad_steps"),
    ("checkpoint", "minutes"), ("train", "async_loop"),
    ("mesh", "replica"), ("mesh", "fsdp"), ("mesh", "expert"), ("mesh", "tensor"), ("mesh", "dispatcher"),
    ("mesh", "dispatch_chunks"), ("mesh", "xla_flags_profile"),
}


def _split_overrides(overrides) -> tuple[list[str], list[str]]:
    """(model/moe overrides, the rest)."""
    from jaxmoe.config import parse_override

    model, rest = [], []
    for o in overrides:
        (model if parse_override(o)[0] in ("model", "moe") else rest).append(o)
    return model, rest


def resolve_config(args) -> tuple[Config, Path, object]:
    """The run's config, directory and --init-from source (or None). On --resume the saved config
    is authoritative; flags may change only what does not alter the computation (steps, checkpoint
    cadence, mesh)."""
    from jaxmoe.port import formats

    extra = _train_overrides(args)
    src_options = {o.name: getattr(args, o.name, None) for o in formats.options(("source",))}
    given = [o.flag for o in formats.options(("source",)) if src_options[o.name] is not None]
    resume_from = getattr(args, "resume_from", None)
    if given and not (args.init_from or resume_from):
        raise UserError(f"{given[0]} describes the --init-from / --resume-from source; give one or drop it")
    if args.resume_step is not None and not args.resume:
        raise UserError("--resume-step needs --resume")
    if resume_from:
        if args.resume or args.init_from:
            raise UserError("--resume-from starts a new run from a torchtitan checkpoint; drop "
                            f"{'--resume' if args.resume else '--init-from'} (a jaxmoe run continues "
                            "with --resume --out RUN_DIR alone)")
        return _resume_from_config(args, resume_from, src_options.get("titan"), extra)
    if args.resume:
        if args.init_from:
            raise UserError("--resume continues a run, which records its own --init-from source; "
                            "drop --init-from")
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
        for section in SECTIONS:
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
        return asked, out, _recorded_source(out)
    if args.init_from:
        from jaxmoe.train.init_from import config_from_source, open_init_source

        model_over, rest = _split_overrides(list(args.overrides) + extra)
        base = load_config(preset=args.preset, path=args.config, overrides=rest)
        src = open_init_source(args.init_from, src_options)
        cfg = config_from_source(base, src, model_over)
    else:
        cfg = load_config(preset=args.preset, path=args.config, overrides=list(args.overrides) + extra)
        src = None
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, out, src


def _resume_from_config(args, spec: str, titan, extra):
    """``--resume-from dcp:STEP_DIR``: the model from ``--titan``, training settings from
    ``--preset`` / ``--config`` (else ``--titan``'s) and ``--set``, AdamW's fields from the
    checkpoint (:class:`jaxmoe.train.titan_resume.TitanResume`)."""
    from jaxmoe.config import apply_setting, parse_override
    from jaxmoe.train.init_from import config_from_source
    from jaxmoe.train.titan_resume import open_resume

    res = open_resume(spec, titan)
    model_over, rest = _split_overrides(list(args.overrides) + extra)
    if args.preset or args.config:
        base = load_config(preset=args.preset, path=args.config, overrides=rest)
    else:
        base = config_from_dict({}, base=res.src.cfg)  # a copy of every section (fix_config edits it)
        for text in rest:
            apply_setting(base, *parse_override(text))
    cfg = config_from_source(base, res.src, model_over)
    given = {".".join(parse_override(o)[:2]) for o in list(args.overrides) + extra}
    res.fix_config(cfg, given)
    for note in res.notices:
        print(note, file=sys.stderr)
    name = cfg.model.name.replace("/", "-").replace(":", "-")
    out = Path(args.out) if args.out else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, out, res


def _recorded_source(out: Path):
    """The --init-from source (or --resume-from checkpoint) a resumed run recorded, re-opened, if
    it has no checkpoint yet (it then starts over from there); its content must not have changed."""
    from jaxmoe.checkpoint.run_dir import RunDir

    rd = RunDir(out)
    rec = rd.record().get("init_from") or rd.record().get("resume_from")
    if not rec or (rd.ckpt_dir.is_dir() and any(p.name.isdigit() for p in rd.ckpt_dir.iterdir())):
        return None
    from jaxmoe.train.init_from import fingerprint, open_init_source

    if "resume_from" in rd.record():
        from jaxmoe.train.titan_resume import open_resume

        res = open_resume(rec["source"], (rec.get("options") or {}).get("titan"))
        if fingerprint(res.src) != rec["fingerprint"]:
            raise UserError(f"--resume: the run started from {rec['source']}, whose contents changed since "
                            "(fingerprint differs); restore it or start a new run")
        return res
    src = open_init_source(rec["source"], rec.get("options"))
    if fingerprint(src) != rec["fingerprint"]:
        raise UserError(f"--resume: the run started from {rec['source']}, whose contents changed since "
                        "(fingerprint differs); restore it or start a new run with --init-from")
    return src


def run(args) -> int:
    from jaxmoe.train.host_alloc import keep_freed_memory

    keep_freed_memory()  # before jax starts its threads (see the module doc)
    cfg, out, src = resolve_config(args)
    mesh_ctx = None
    if (getattr(args, "mesh", None) or getattr(args, "coordinator", None) or _wants_mesh(cfg)
            or getattr(args, "num_processes", None) not in (None, 1)
            or getattr(args, "process_id", None) is not None):
        from jaxmoe.parallel.mesh import setup_from_args

        cfg, mesh_ctx = setup_from_args(cfg, args)
    _check_data_path(cfg)
    from jaxmoe.train.loop import Trainer  # late: jax (see the module doc)
    from jaxmoe.train.titan_resume import TitanResume

    resume_from = src if isinstance(src, TitanResume) else None
    trainer = Trainer(cfg, out, resume=args.resume, resume_step=args.resume_step,
                      init_from=None if resume_from else src, resume_from=resume_from, quiet=args.quiet,
                      mesh_ctx=mesh_ctx, stop_after=args.stop_after,
                      compile_cache_on=not args.no_compile_cache)
    res = trainer.run()
    if res.losses:
        first, last = res.losses[0], res.losses[-1]
        if first is not None and last is not None:
            print(f"trained {res.steps_done} steps into {out}: loss {first:.4f} -> {last:.4f}")
        else:
            print(f"trained {res.steps_done} steps into {out}")
    if res.stopped:
        print(res.stopped, file=sys.stderr)
    return res.exit_code


def _wants_mesh(cfg: Config) -> bool:
    m = cfg.mesh
    return any(getattr(m, k) not in (1,) for k in ("replica", "fsdp", "expert", "tensor"))


def _check_data_path(cfg: Config) -> None:
    """The spec's form (``mix:`` weights included); kinds and paths are checked by the sources."""
    from jaxmoe.data.mixture import parse_data_spec  # pure Python: no grain needed here

    for _, spec in parse_data_spec(cfg.data.source):
        if spec != "default" and ":" not in spec:
            raise UserError(f"--data {spec!r}: expected default, KIND:PATH (tokens:, text:, ...) or mix:...")
