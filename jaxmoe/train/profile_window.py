"""``train.profile_steps = "A:B"``: an XLA profiler trace of steps A..B of ``jaxmoe train``.

The trace (``jax.profiler.start_trace``/``stop_trace``: an ``<host>.xplane.pb`` and a
``<host>.trace.json.gz`` per process, the TensorBoard profile plugin's / xprof's layout) goes to
``<run>/tb/plugins/profile/<timestamp>/``, beside the run's TensorBoard scalars, so
``tensorboard --logdir <run>/tb`` (with ``tensorboard-plugin-profile``) or ``xprof <run>/tb``
shows it; one line says where it went. Steps are numbered from 1, as in ``metrics.jsonl``; the
step is compiled before the loop, so the window holds the steps' execution, not their compile.
The trace starts before step A is dispatched and stops once step B's state is ready (one host
synchronisation, at the end of the window only). A resumed run traces the part of the window it
runs; a run that stops inside the window (non-finite steps, preemption) closes the trace there.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from jaxmoe.config.load import profile_window
from jaxmoe.train.metrics import log


class ProfileWindow:
    """Starts and stops the trace around the steps of ``train.profile_steps`` (module doc)."""

    def __init__(self, spec: str, steps: int, run_path: Path, *, start: int, primary: bool, quiet: bool):
        self.window = profile_window(spec, steps)
        self.dir = Path(run_path) / "tb"
        self.primary, self.quiet, self.active = primary, quiet, False
        self.first = self.last = None
        self.overhead = 0.0  # seconds in start_trace/stop_trace, not charged to the steps' tokens/s
        if self.window is not None and start >= self.window[1] and primary and not quiet:
            log(f"profile: train.profile_steps={spec} lies before the resumed step {start + 1}; no trace")

    def before(self, step: int) -> None:
        """Called before step ``step`` (1-based) is dispatched: starts the trace at the window's start."""
        if self.window is None or self.active or self.first is not None:
            return
        a, b = self.window
        if a <= step <= b:
            t0 = time.perf_counter()
            jax.profiler.start_trace(str(self.dir))
            self.active, self.first = True, step
            self.overhead += time.perf_counter() - t0

    def after(self, step: int, state) -> None:
        """Called after step ``step`` was dispatched: stops the trace once step B is done."""
        if self.active:
            self.last = step
            if step >= self.window[1]:
                self.stop(state)

    def take_overhead(self) -> float:
        """The profiler's own seconds since the last call (the loop leaves them out of tokens/s)."""
        t, self.overhead = self.overhead, 0.0
        return t

    def stop(self, state=None) -> None:
        """Stop the trace (if running) after ``state`` is ready, and say where it went."""
        if not self.active:
            return
        if state is not None:
            jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.profiler.stop_trace()
        self.overhead += time.perf_counter() - t0
        self.active = False
        if self.primary and not self.quiet:
            runs = sorted((self.dir / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
            where = runs[-1] if runs else self.dir
            steps = f"steps {self.first}..{self.last}" if self.last else f"from step {self.first}"
            log(f"profile: {steps} traced to {where} (tensorboard --logdir {self.dir}, "
                "Profile tab, or xprof)")


__all__ = ["ProfileWindow"]
