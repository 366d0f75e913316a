"""Preemption: SIGTERM / SIGINT finish the current step, save, and exit with a resumable status.

The first SIGTERM or SIGINT (Ctrl-C; SLURM sends SIGTERM before it kills a preempted or timed-out
job: ask for it early with ``#SBATCH --signal=B:TERM@300``) only sets a flag: the training loop
sees it at the next step boundary, waits for any checkpoint still being written, writes one of
the current step and exits with :data:`EXIT_PREEMPTED` and a line naming the ``--resume``
command. A second signal aborts at once (``KeyboardInterrupt``): the committed checkpoints stay
intact, because a checkpoint is only ever published by an atomic rename
(:mod:`jaxmoe.checkpoint.checkpointer`).

Multi-process runs must save the *same* step on every process, although the signal reaches them
at different steps: there SIGTERM is left to JAX's preemption service (installed by
``jax.distributed.initialize``), which agrees on the next step after the largest one any process
has reached; :meth:`Preemption.should_stop` asks it once per step
(``multihost_utils.reached_preemption_sync_point``). SIGINT keeps its default there (abort).
"""

from __future__ import annotations

import signal
import sys
import threading

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" -- the run is resumable with --resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Context manager that installs the handlers (main thread only) and restores the old ones."""

    def __init__(self, quiet: bool = False, multi_process: bool = False):
        self.quiet, self.multi_process = quiet, multi_process
        self.signal_name: str | None = None
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after ``step``; call it once per step, on every process."""
        if self.multi_process and self.signal_name is None:
            from jax.experimental import multihost_utils  # late: only multi-process runs need it

            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.signal_name = "SIGTERM"
            except RuntimeError:  # preemption service disabled (jax_enable_preemption_service)
                pass
        return self.signal_name is not None

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal_name is not None:  # the second signal: abort now
            raise KeyboardInterrupt(name)
        self.signal_name = name
        print(f"\n{name}: finishing this step and saving a checkpoint (send it again to abort "
              "without saving)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and not self.multi_process:
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
        return False


__all__ = ["EXIT_PREEMPTED", "Preemption"]
