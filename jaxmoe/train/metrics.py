"""Where a run's per-step figures go: one row per step in ``metrics.jsonl``, the same scalars in
TensorBoard (the ``[tb]`` extra; skipped with a note without it), W&B with ``train.wandb``
(:mod:`jaxmoe.train.wandb_log`), the progress line on stderr,
and the MFU the row states (the step's model FLOPs over the devices' peak).

The loop hands :meth:`MetricsSink.step_row` the step's metrics (fetched from the device); the sink
times the step (wall time since the previous row, less what the loop did between steps and said
with :meth:`MetricsSink.pause`: evaluation, checkpoints), builds the row, writes it everywhere and
returns it. Only the
primary process (process 0) writes files; the others build the rows and write nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxmoe.config import Config
from jaxmoe.config.counting import flops_per_token
from jaxmoe.train.optim import lr_schedule
from jaxmoe.train.step import device_peak_flops
from jaxmoe.train.wandb_log import log_row, open_wandb

#: the step's scalars, copied into every row under the same names
SCALARS = ("loss", "ce", "z_loss", "lb", "seq_aux", "router_z", "grad_norm")


def log(msg: str) -> None:
    """One line on stderr, flushed (the trainer's notes and warnings)."""
    print(msg, file=sys.stderr, flush=True)


def to_py(x: Any) -> Any:
    """A device or numpy value as JSON: lists and numbers, a non-finite float as ``None``."""
    if hasattr(x, "tolist"):
        v = np.asarray(x).tolist()
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return x


class Progress:
    """A one-line progress bar with ETA on a terminal; plain periodic lines otherwise."""

    def __init__(self, total: int, start: int, stream=None):
        # sys.stderr looked up now, not at import (it may have been replaced since, e.g. by pytest)
        self.total, self.start, self.stream = total, start, stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()

    def update(self, step: int, text: str) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        filled = int(24 * step / max(self.total, 1))
        line = f"[{'#' * filled}{'.' * (24 - filled)}] {step}/{self.total} {text} eta {eta:5.0f}s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def tensorboard(path):
    """A TensorBoard writer into ``path`` (``tensorboardX``, an extra), or None with one note."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        log("note: tensorboardX is not installed (pip install 'jaxmoe[tb]'); no TensorBoard files")
        return None
    return SummaryWriter(str(path))


class DeadExperts:
    """The experts that have received no token for ``k`` steps in a row (``train.dead_expert_steps``;
    0: never): :meth:`update` gives one warning line the step a streak reaches ``k`` (once per
    streak: an expert that gets tokens again is re-armed), else None. Layers are numbered among
    the MoE layers, as the rows of ``expert_counts`` in metrics.jsonl and ``jaxmoe plot``."""

    def __init__(self, k: int):
        self.k, self.zero_run = k, None

    def update(self, step: int, counts) -> str | None:
        c = np.asarray(counts)
        if self.k <= 0 or c.size == 0:
            return None
        run = np.zeros(c.shape, np.int64) if self.zero_run is None else self.zero_run
        self.zero_run = np.where(c == 0, run + 1, 0)
        hit = np.argwhere(self.zero_run == self.k)
        if not len(hit):
            return None
        by_layer: dict = {}
        for layer, e in hit.tolist():
            by_layer.setdefault(layer, []).append(e)
        where = "; ".join(f"MoE layer {ly} expert{'s' if len(es) > 1 else ''} {', '.join(map(str, es))}"
                          for ly, es in by_layer.items())
        return (f"warning: step {step}: dead expert(s), no tokens for {self.k} steps in a row: {where} "
                "(train.dead_expert_steps)")


def expert_histograms(writer, step: int, counts) -> None:
    """Per MoE layer, the tokens-per-expert histogram (bucket ``e`` = expert ``e``'s count) in
    TensorBoard (``expert_load/moe_layer_N``), written from the counts alone (nothing expanded)."""
    for i, c in enumerate(np.asarray(counts, np.float64)):
        ids = np.arange(len(c), dtype=np.float64)
        n = float(c.sum())
        if n <= 0:
            continue
        writer.add_histogram_raw(f"expert_load/moe_layer_{i}", min=0.0, max=float(len(c) - 1), num=n,
                                 sum=float((ids * c).sum()), sum_squares=float((ids * ids * c).sum()),
                                 bucket_limits=(ids + 0.5).tolist(), bucket_counts=c.tolist(), global_step=step)


class MetricsSink:
    """The rows of one run from step ``start`` on (see the module doc)."""

    def __init__(self, cfg: Config, run_path, *, start: int, primary: bool, quiet: bool, compile_s: float = 0.0):
        t = cfg.train
        self.cfg, self.start, self.compile_s = cfg, start, compile_s
        self.file = open(run_path / "metrics.jsonl", "a") if primary else None
        self.writer = tensorboard(run_path / "tb") if primary else None
        self.wandb = open_wandb(cfg, run_path, start) if primary else None  # train.wandb
        self.progress = Progress(t.steps, start) if (primary and not quiet) else None
        self.sched = lr_schedule(cfg.optim, t.steps, cfg.optim.lr)
        self.peak, self.peak_src = device_peak_flops(cfg.compute.dtype)
        self.fpt, self.n_dev, self.tokens = flops_per_token(cfg), jax.device_count(), t.batch_size * t.seq_len
        self.dead = DeadExperts(t.dead_expert_steps)
        self.losses: list = []
        self.step_times: list[float] = []  # seconds per step, in order
        self.start_clock()

    def start_clock(self) -> None:
        """The next step's time starts now."""
        self._t_last, self._paused = time.perf_counter(), 0.0

    def pause(self, seconds: float) -> None:
        """``seconds`` spent between steps (evaluation, checkpoints): not charged to any step."""
        self._paused += seconds

    def step_row(self, step: int, m: dict, extra: dict) -> dict:
        """The row of ``step`` from its fetched metrics ``m``, written to every destination."""
        now = time.perf_counter()
        seconds = max(now - self._t_last - self._paused, 1e-9)
        self._t_last, self._paused = now, 0.0
        self.step_times.append(seconds)
        tok_s = self.tokens / seconds
        rec = {"step": step, **{k: to_py(m[k]) for k in SCALARS}, "lr": float(self.sched(step - 1)),
               "tokens_per_s": tok_s, "mfu": self.fpt * tok_s / (self.peak * self.n_dev),
               "skipped": bool(m["skipped"])}
        if "mtp_ce" in m:  # model.mtp_layers > 0: the mean over depths of the MTP cross-entropy
            rec["mtp_ce"] = to_py(m["mtp_ce"])
        if "expert_load" in m:
            rec["expert_load_max_mean"] = to_py(m["expert_load"])
            rec["dropped_frac"] = to_py(m["dropped_frac"])
            rec["router_entropy"] = to_py(m["router_entropy"])
            rec["expert_counts"] = to_py(np.asarray(m["counts"]).astype(np.int64))
        if step == self.start + 1:
            rec["mfu_peak_source"] = self.peak_src
            rec["compile_s"] = round(self.compile_s, 3)
        rec.update(extra)
        self.losses.append(rec["loss"])
        if rec["skipped"]:
            log(f"step {step}: non-finite loss, gradient or update (loss={rec['loss']}, grad_norm="
                f"{rec['grad_norm']}); update skipped")
        if "expert_counts" in rec:
            warning = self.dead.update(step, rec["expert_counts"])
            if warning and self.file:
                log(warning)
        self._write(step, rec, tok_s)
        return rec

    def _write(self, step: int, rec: dict, tok_s: float) -> None:
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if self.writer is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(k, v, step)
            if "expert_counts" in rec:
                expert_histograms(self.writer, step, rec["expert_counts"])
        if self.wandb is not None:
            log_row(self.wandb, step, rec)
        t = self.cfg.train
        if self.progress is not None and (step % t.log_every == 0 or step == t.steps):
            loss = f"loss {rec['loss']:.4f}" if rec["loss"] is not None else "loss nan"
            self.progress.update(step, f"{loss} {tok_s:,.0f} tok/s")

    def close(self) -> None:
        for f in (self.progress, self.file, self.writer):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


__all__ = ["SCALARS", "DeadExperts", "MetricsSink", "expert_histograms", "Progress", "log", "tensorboard", "to_py"]
