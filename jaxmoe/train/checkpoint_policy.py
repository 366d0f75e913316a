"""When ``jaxmoe train`` saves: every ``checkpoint.every`` steps, or about every
``checkpoint.minutes`` of training, and at the end or when preempted -- and only a state it may
save.

The time rule becomes a step count once two steps have been timed (their median), and process 0's
count is broadcast, so that every process of a multi-process run decides alike. A save is exact:
only a state whose last step was finite is written (the non-finite counter is read first), except
when preempted, where the skipped steps left the parameters as they were and the state is still
consistent.

The emergency tier (``train.local_checkpoint_every``, :mod:`jaxmoe.checkpoint.emergency`) saves
by the same rule, every N steps, to each process's local directory, except at a step the
persistent tier has just saved. :func:`restore_newest` picks the tier a restart resumes from: the
newest complete one, local or persistent.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from jaxmoe.checkpoint.checkpointer import Checkpointer
from jaxmoe.checkpoint.emergency import LocalTier
from jaxmoe.config import Config
from jaxmoe.data import gather_states


class CheckpointPolicy:
    """The save decisions of one run into ``ckpt`` (see the module doc)."""

    def __init__(self, cfg: Config, ckpt: Checkpointer, stop_after: int, local: LocalTier | None = None):
        self.cfg, self.ckpt, self.stop_after, self.local = cfg, ckpt, stop_after, local
        self.every = cfg.checkpoint.every
        self.saved_step = ckpt.latest_step()

    def after_step(self, step: int, state, position: dict, step_times: list, stop_now: bool) -> None:
        """Save ``state`` (the state after ``step``) if a save is due and allowed."""
        if self.every == 0 and self.cfg.checkpoint.minutes > 0 and len(step_times) >= 2:
            self.every = self.steps_per_checkpoint(step_times)
        due = step == self.stop_after or (self.every and step % self.every == 0) or stop_now
        k = self.cfg.train.local_checkpoint_every
        local_due = self.local is not None and k > 0 and step % k == 0
        if (not due or step == self.saved_step) and not local_due:
            return
        if not (stop_now or int(jax.device_get(state["bad_steps"])) == 0):
            return
        meta = {"step": step, "data": gather_states(position, jax.process_count()), "config": self.cfg.to_dict()}
        if due and step != self.saved_step:
            self.ckpt.save(step, state, meta)
            self.saved_step = step
        elif local_due:
            self.local.save(step, state, meta)

    def steps_per_checkpoint(self, step_times: list) -> int:
        """``checkpoint.minutes`` as a step count, from the median measured step time (the same
        on every process: process 0's figure is broadcast)."""
        step_s = statistics.median(step_times)
        k = max(1, round(self.cfg.checkpoint.minutes * 60 / max(step_s, 1e-6)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            k = int(multihost_utils.broadcast_one_to_all(np.int32(k)))
        return k

    def intact(self, run_path, ckpt_dir) -> str:
        """What is left to continue from, after a stop for non-finite steps."""
        last = self.ckpt.latest_step()
        if last is None:
            return (f"no checkpoint was written; {run_path} keeps the config and metrics, and "
                    "--resume starts it over from step 0")
        return f"the last good checkpoint (step {last}) is intact in {ckpt_dir}"


def local_tier(cfg: Config, run_path) -> LocalTier | None:
    """This process's emergency tier: ``train.local_checkpoint_dir`` (default
    ``RUN_DIR/local_checkpoints``), or None when ``train.local_checkpoint_every`` is 0 and no
    local directory is there to resume from."""
    from pathlib import Path

    root = Path(cfg.train.local_checkpoint_dir or Path(run_path) / "local_checkpoints")
    if cfg.train.local_checkpoint_every == 0 and not root.is_dir():
        return None
    return LocalTier(root, jax.process_index(), jax.process_count())


def restore_newest(ckpt: Checkpointer, local: LocalTier | None, target, log):
    """``(state, meta, step)`` from the newest complete tier -- the local one (its newest complete
    step, each newer one skipped with one line) when it is newer than the persistent one's newest
    step, else the persistent one (its newest checkpoint that restores) -- or None when neither
    has a checkpoint."""
    persistent = ckpt.latest_step()
    found = local.newest_complete(target, log) if local is not None else None
    if found is not None and (persistent is None or found[0] > persistent):
        state, meta = local.restore(target, found[1])
        log(f"resuming from local checkpoint {found[0]} in {local.root} (the newest complete tier; "
            f"persistent: {persistent if persistent is not None else 'none'})")
        return state, meta, found[0]
    if persistent is None:
        return None
    state, meta, step, skipped = ckpt.restore_newest_good(target, log=log)
    if skipped:
        log(f"resuming from checkpoint {step}, the newest that restores")
    return state, meta, step


__all__ = ["CheckpointPolicy", "local_tier", "restore_newest"]
