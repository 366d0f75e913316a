"""The training loop of ``jaxmoe train``, read top to bottom.

1. **Set-up** (:meth:`Trainer.run`): the run directory (``jaxmoe.checkpoint.run_dir``: checked, locked,
   recorded before the first step), the compilation cache, the data (prepared ahead on a thread:
   ``jaxmoe.train.prefetch``), the state -- created under ``jit`` with its shardings, restored from the
   newest checkpoint that restores (or ``--resume-step``), or initialised from ``--init-from`` --
   and the train step, compiled ahead of the first step with a "compiling ..." line.
2. **The loop** (:meth:`Trainer._loop`): dispatch step n, then fetch the metrics of step n-1
   while step n runs (no host synchronisation per step); evaluation and checkpoints run between
   steps on the state of the step that was just dispatched, and their time is not charged to the
   steps' tokens/s. Decisions stay exact: a checkpoint is written only after reading that step's
   non-finite counter; a stop for non-finite steps discards the one step already dispatched past
   it, so metrics.jsonl and the checkpoints are what the synchronous loop writes
   (``train.async_loop = false`` runs exactly that loop, for comparison).
3. **Stopping**: the last step, ``--stop-after``, ``train.max_bad_steps`` non-finite steps in a
   row, or SIGTERM/SIGINT (``jaxmoe.train.preempt``: finish the step, save, exit 75).

What a step writes and when the run saves live beside the loop: :mod:`jaxmoe.train.metrics` (the
row, TensorBoard, the progress line, MFU), :mod:`jaxmoe.train.checkpoint_policy` (every
``checkpoint.every`` steps or about every ``checkpoint.minutes``, and at the end),
:mod:`jaxmoe.train.evaluate` (``eval_ce``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from jaxmoe.checkpoint.checkpointer import Checkpointer
from jaxmoe.checkpoint.run_dir import RunDir
from jaxmoe.config import Config, config_to_toml
from jaxmoe.config.autoconf import auto_choices, backend_kind
from jaxmoe.data import make_data
from jaxmoe.errors import UserError
from jaxmoe.model.transformer import Model, abstract_params, declared_groups, init_fn
from jaxmoe.train import compile_cache
from jaxmoe.train.checkpoint_policy import CheckpointPolicy, local_tier, restore_newest
from jaxmoe.train.evaluate import Evaluator
from jaxmoe.train.metrics import MetricsSink, log
from jaxmoe.train.optim import build_optimizer
from jaxmoe.train.preempt import EXIT_PREEMPTED, Preemption
from jaxmoe.train.prefetch import Prefetcher
from jaxmoe.train.profile_window import ProfileWindow
from jaxmoe.train.step import init_state, make_train_step, opt_init_fn, state_shardings

EXIT_STOPPED = 3  # train.max_bad_steps non-finite steps in a row


@dataclasses.dataclass
class RunResult:
    steps_done: int
    losses: list
    out: Path
    stopped: str = ""
    exit_code: int = 0


class Trainer:
    """One ``jaxmoe train`` run in ``out`` (see the module doc and jaxmoe.checkpoint.run_dir)."""

    def __init__(self, cfg: Config, out: Path, *, resume: bool = False, resume_step: int | None = None,
                 init_from=None, quiet: bool = False, mesh_ctx=None, stop_after: int | None = None,
                 compile_cache_on: bool = True, resume_from=None):
        self.cfg, self.out, self.resume, self.resume_step = cfg, Path(out), resume, resume_step
        self.init_from = init_from  # an opened jaxmoe.port source, or None
        self.resume_from = resume_from  # --resume-from: a jaxmoe.train.titan_resume.TitanResume, or None
        self.quiet, self.mesh_ctx, self.compile_cache_on = quiet, mesh_ctx, compile_cache_on
        self.stop_after = cfg.train.steps if stop_after is None else min(stop_after, cfg.train.steps)
        self.rd = RunDir(self.out, primary=jax.process_index() == 0)

    # -- set-up --------------------------------------------------------------------------------
    def _place_batch(self, batch: dict) -> dict:
        if self.mesh_ctx is not None:
            return self.mesh_ctx.place_batch(batch)
        return {k: jax.device_put(np.asarray(v)) for k, v in batch.items()}

    def _shardings(self, abstract_state):
        return state_shardings(self.cfg, abstract_state, self.mesh_ctx)  # + optimizer offload

    def _fresh_state(self, tx, shardings):
        """Params, buffers and optimizer state created under jit with their output shardings: each
        device materialises only its own shards (from the declared init, or the --init-from source)."""
        cfg = self.cfg
        sh = shardings or {}
        if self.init_from is not None:
            from jaxmoe.train.init_from import load_weights

            params, buffers = load_weights(cfg, self.init_from, shardings)
        else:
            pb = None if shardings is None else (sh["params"], sh["buffers"])
            params, buffers = init_fn(cfg, pb)(cfg.train.seed)
        rest = opt_init_fn(cfg, tx, shardings)(params, buffers)
        return {"params": params, "buffers": buffers, **rest}

    def _initial_state(self, tx, ckpt: Checkpointer):
        """``(state, start step, data state or None)``: restored, or fresh (see the module doc)."""
        cfg = self.cfg
        params, buffers = abstract_params(cfg)
        abstract = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
        shardings = self._shardings(abstract)
        local = self.local = local_tier(cfg, self.out)  # the emergency tier, or None
        if self.resume and (ckpt.all_steps() or (local is not None and local.all_steps())):
            target = abstract if shardings is None else jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
            if self.resume_step is not None:
                found = ckpt.restore(target, step=self.resume_step) + (self.resume_step,)
            else:
                found = restore_newest(ckpt, local, target, log)  # local or persistent: the newest
            if found is not None:
                state, meta, _ = found
                if local is not None:
                    local.drop_after(int(meta["step"]))
                return state, int(meta["step"]), meta.get("data")
        if self.resume_from is not None:  # a torchtitan checkpoint's state (jaxmoe.train.titan_resume)
            return self.resume_from.initial_state(cfg, tx, shardings)
        if self.resume:
            log(f"--resume: {self.out} has no checkpoint yet; starting it over from step 0 with "
                 "its saved config")
        return self._fresh_state(tx, shardings), 0, None

    def _record(self, start: int) -> None:
        """run.json and config.toml before the first step; a changed schedule horizon is said."""
        cfg, rd = self.cfg, self.rd
        rec = rd.record()
        if self.resume and rec.get("steps") not in (None, cfg.train.steps):
            log(f"warning: train.steps is {cfg.train.steps} (was {rec['steps']}): the learning-rate "
                 f"schedule now spans {cfg.train.steps} steps (warmup {cfg.optim.warmup_steps}, decay "
                 f"to min_lr at step {cfg.train.steps}); resume with --steps {rec['steps']} to keep it")
        fields: dict = {"jaxmoe": "0.1.0", "steps": cfg.train.steps, "status": "running",
                        "start_step": start}
        chosen = auto_choices(cfg)  # what the `auto` fields ran as here (config.toml keeps `auto`)
        if chosen:
            fields["resolved"] = {"backend": backend_kind(), **chosen}
            if rd.primary and not self.quiet:  # --quiet: run.json only (errors stay one line)
                log("auto (" + backend_kind() + "): " + ", ".join(f"{k}={v}" for k, v in chosen.items()))
        if self.init_from is not None:
            from jaxmoe.train.init_from import fingerprint, record_source_files

            fields["init_from"] = {"source": getattr(self.init_from, "spec", str(self.init_from.ep)),
                                   "fingerprint": fingerprint(self.init_from)}
            if self.init_from.ep.options:  # format options (--titan): re-opening needs them
                fields["init_from"]["options"] = dict(self.init_from.ep.options)
        if self.resume_from is not None:
            fields["resume_from"] = self.resume_from.record()
        if rd.primary:
            rd.path.mkdir(parents=True, exist_ok=True)
            (rd.path / "config.toml").write_text(config_to_toml(cfg))
            rd.write_record(**fields)
            if self.init_from is not None:  # tokenizer, generation config, token ids: kept for hf:
                record_source_files(self.init_from, rd.path)

    def _compile(self, step_fn, state, batch):
        """Compile the step ahead of the first call, with a "compiling" line and its time."""
        t0 = time.perf_counter()
        with compile_cache.CacheHits() as hits:
            compiled = step_fn.lower(state, batch).compile()
        secs = time.perf_counter() - t0
        if not self.quiet and self.rd.primary:
            src = " (from the compilation cache)" if hits.hits else ""
            log(f"compiling the train step ... {secs:.1f}s{src}")
        return compiled, secs, hits.hits

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, rd = self.cfg, self.rd
        rd.check_target(resume=self.resume)
        pidx, pcount = jax.process_index(), jax.process_count()
        data = make_data(cfg, "train", process_index=pidx, process_count=pcount)  # bad data: before any write
        if data.vocab_size > cfg.model.vocab_size:
            raise UserError(f"data vocabulary ({data.vocab_size} ids) exceeds model.vocab_size="
                            f"{cfg.model.vocab_size}; use a model with a larger vocab (--set "
                            "model.vocab_size=N) or another tokenizer")
        existed = rd.path.exists()
        rd.lock()
        try:
            with Preemption(quiet=self.quiet, multi_process=jax.process_count() > 1) as preempt:
                return self._run(preempt, data)
        except UserError:
            if not existed and not self.resume and rd.primary and not rd.ckpt_dir.exists():
                import shutil  # a new run that failed before its first step leaves nothing behind

                rd.unlock()
                shutil.rmtree(rd.path, ignore_errors=True)
            raise
        finally:
            data.close()  # the Grain worker processes, if any
            rd.unlock()

    def _run(self, preempt: Preemption, data) -> RunResult:
        cfg, rd = self.cfg, self.rd
        self.cache_dir = compile_cache.enable(self.compile_cache_on)
        params = abstract_params(cfg)[0]
        tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg),  # Muon placement reads
                             None if self.mesh_ctx is None else  # the params' shardings
                             self.mesh_ctx.state_shardings({"params": params})["params"])
        ckpt = Checkpointer(rd.ckpt_dir, keep=cfg.checkpoint.keep)
        aborted = False
        try:
            state, start, data_state = self._initial_state(tx, ckpt)
            if data_state is not None:
                data.restore(data_state)
            if start >= self.stop_after:
                if start > 0:
                    raise UserError(f"the run in {self.out} is already at step {start}; pass a larger "
                                    "--steps to continue it")
                self._record(0)  # --stop-after 0: a recorded run that --resume starts at step 0
                rd.write_record(status="stopped", last_step=0)
                log(f"stopped before step 1 (--stop-after 0); continue with: jaxmoe train --resume "
                     f"--out {rd.path}")
                return RunResult(steps_done=0, losses=[], out=self.out)
            dropped = rd.truncate_metrics(start)
            if dropped:
                log(f"metrics.jsonl: dropped {dropped} rows past step {start} (they are re-run)")
            self._record(start)
            return self._loop(state, start, data, tx, ckpt, preempt)
        except KeyboardInterrupt:  # a second signal: leave at once (a save in flight is dropped;
            aborted = True  # committed checkpoints are never touched by an unfinished one)
            raise
        finally:
            if not aborted:
                ckpt.wait()
                ckpt.close()

    def _loop(self, state, start, data, tx, ckpt, preempt) -> RunResult:
        cfg, rd = self.cfg, self.rd
        model = Model(cfg) if self.mesh_ctx is None else self.mesh_ctx.model()
        prefetch = Prefetcher(data, self._place_batch, depth=2 if cfg.train.async_loop else 0)
        policy = CheckpointPolicy(cfg, ckpt, self.stop_after, local=self.local)
        evaluator = Evaluator(cfg, model, self._place_batch)
        sink = MetricsSink(cfg, rd.path, start=start, primary=rd.primary, quiet=self.quiet)
        self.profile = ProfileWindow(cfg.train.profile_steps, cfg.train.steps, rd.path, start=start,
                                     primary=rd.primary, quiet=self.quiet)
        try:
            batch = prefetch.next()
            step_fn, sink.compile_s, _ = self._compile(make_train_step(model, tx), state, batch)
            state, stopped = self._steps(step_fn, state, start, batch, prefetch, policy, evaluator, sink, preempt)
            exit_code = 0
            if stopped:
                exit_code = EXIT_STOPPED
                ckpt.wait()  # an asynchronous save of an earlier step may still be committing
                stopped += policy.intact(self.out, rd.ckpt_dir)
            elif preempt.requested:
                ckpt.wait()
                exit_code = EXIT_PREEMPTED
                stopped = (f"{preempt.signal_name}: saved checkpoint {policy.saved_step} in {rd.ckpt_dir}; "
                           f"continue with: jaxmoe train --resume --out {rd.path}")
            status = {EXIT_STOPPED: "stopped", EXIT_PREEMPTED: "preempted"}.get(exit_code, "finished")
            rd.write_record(status=status, last_step=start + len(sink.losses))
        finally:
            self.profile.stop()  # a run stopped inside the window (else already stopped)
            prefetch.close()
            evaluator.close()
            sink.close()
        self.state = state
        return RunResult(steps_done=len(sink.losses), losses=sink.losses, out=self.out,
                         stopped=stopped, exit_code=exit_code)

    def _steps(self, step_fn, state, step, batch, prefetch, policy, evaluator, sink, preempt):
        """Steps from ``step`` to the last, a stop or a preemption: ``(state, stop message or "")``.
        Step n's metrics are fetched while step n+1 runs (``train.async_loop``; see the module doc)."""
        t = self.cfg.train
        pending = None  # (step, metrics on device, row extras): written one step late
        sink.start_clock()
        while step < self.stop_after:
            self.profile.before(step + 1)  # train.profile_steps (jaxmoe.train.profile_window)
            state, m = step_fn(state, batch)  # dispatched: runs while the host does the rest
            step += 1
            self.profile.after(step, state)
            sink.pause(self.profile.take_overhead())
            cur = (step, m, {"data_tokens": prefetch.position["tokens"]})
            if pending is not None:  # the previous step's metrics, fetched while this one runs
                stopped, pending = self._finish(sink, pending), None
                if stopped:
                    return state, stopped  # this step is discarded: the synchronous loop never ran it
            t0 = time.perf_counter()  # between steps: not charged to any step's tokens/s
            if t.eval_every and step % t.eval_every == 0:
                cur[2].update(evaluator.run(state))
            stop_now = preempt.should_stop(step)
            policy.after_step(step, state, prefetch.position, sink.step_times, stop_now)
            sink.pause(time.perf_counter() - t0)
            if t.async_loop:
                pending = cur
            else:
                stopped = self._finish(sink, cur)
                if stopped:
                    return state, stopped
            if stop_now or step == self.stop_after:
                break
            batch = prefetch.next()
        return state, self._finish(sink, pending) if pending is not None else ""

    def _finish(self, sink: MetricsSink, pending) -> str:
        """Fetch one step's metrics and write its row; -> a stop message, or ""."""
        step, m, extra = pending
        m = jax.device_get(m)
        sink.step_row(step, m, extra)
        bad, limit = int(m["bad_steps"]), self.cfg.train.max_bad_steps
        if bad >= limit:
            return (f"stopped: {bad} non-finite steps in a row at step {step} "
                    f"(train.max_bad_steps={limit}); lower optim.lr or check the data; ")
        return ""


__all__ = ["EXIT_PREEMPTED", "EXIT_STOPPED", "RunResult", "Trainer"]
