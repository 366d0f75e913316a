"""When ``jaxmoe train`` saves: every ``checkpoint.every`` steps, or about every
``checkpoint.minutes`` of training, and at the end or when preempted -- and only a state it may
save.

The time rule becomes a step count once two steps have been timed (their median), and process 0's
count is broadcast, so that every process of a multi-process run decides alike. A save is exact:
only a state whose last step was finite is written (the non-finite counter is read first), except
when preempted, where the skipped steps left the parameters as they were and the state is still
consistent.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from jaxmoe.checkpoint.checkpointer import Checkpointer
from jaxmoe.config import Config
from jaxmoe.data import gather_states


class CheckpointPolicy:
    """The save decisions of one run into ``ckpt`` (see the module doc)."""

    def __init__(self, cfg: Config, ckpt: Checkpointer, stop_after: int):
        self.cfg, self.ckpt, self.stop_after = cfg, ckpt, stop_after
        self.every = cfg.checkpoint.every
        self.saved_step = ckpt.latest_step()

    def after_step(self, step: int, state, position: dict, step_times: list, stop_now: bool) -> None:
        """Save ``state`` (the state after ``step``) if a save is due and allowed."""
        if self.every == 0 and self.cfg.checkpoint.minutes > 0 and len(step_times) >= 2:
            self.every = self.steps_per_checkpoint(step_times)
        due = step == self.stop_after or (self.every and step % self.every == 0) or stop_now
        if not due or step == self.saved_step:
            return
        if stop_now or int(jax.device_get(state["bad_steps"])) == 0:
            self.ckpt.save(step, state, {"step": step, "data": gather_states(position, jax.process_count()),
                                         "config": self.cfg.to_dict()})
            self.saved_step = step

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


__all__ = ["CheckpointPolicy"]
