"""The run directory of ``jaxmoe train``: what it holds, who may write it, and how it is resumed.

Layout::

    OUT/run.json          the run record, written before the first step: jaxmoe version, the
                          schedule horizon (train.steps), the --init-from source and its content
                          fingerprint; a directory with it is a jaxmoe run
    OUT/config.toml       the full config of the run
    OUT/metrics.jsonl     one JSON object per step ({"step", "loss", "ce", "tokens_per_s", ...}),
                          eval results inside the step's row, and events marked {"event": ...}
    OUT/checkpoints/N/    Orbax checkpoints (jaxmoe.checkpoint.checkpointer)
    OUT/tb/               TensorBoard event files
    OUT/.lock             held (flock) by the trainer writing the directory; names its PID

Rules that keep user data safe (every violation is a one-line UserError before anything is
written): ``--out`` must be a directory path we can write; an existing directory must be empty or
a jaxmoe run (``run.json``, or the ``config.toml`` + ``metrics.jsonl``/``checkpoints/`` of runs
made before run.json existed); a run directory is never started over without ``--resume``; one
trainer at a time holds the lock (a second one is refused with the holder's PID; a lock left by a
dead process is released by the kernel and simply taken).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from jaxmoe.errors import UserError

RECORD, CONFIG, METRICS, CHECKPOINTS, LOCK = "run.json", "config.toml", "metrics.jsonl", "checkpoints", ".lock"


def _writable(path: Path) -> Path:
    """The nearest existing ancestor of ``path``, checked to be a writable directory."""
    p = path
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise UserError(f"--out {path}: {p} is a file, not a directory; choose a directory path")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"--out {path}: {p} is not writable; choose a directory you can write")
    return p


class RunDir:
    """One run directory (see the module doc). ``primary``: this process writes the shared files
    (process 0 of a multi-process run); the others only read."""

    def __init__(self, path, *, primary: bool = True):
        self.path = Path(path)
        self.primary = primary
        self._lock_fd: int | None = None

    # -- what is there ------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.path / CHECKPOINTS

    def is_run(self) -> bool:
        p = self.path
        if (p / RECORD).is_file():
            return True
        return (p / CONFIG).is_file() and ((p / METRICS).is_file() or (p / CHECKPOINTS).is_dir())

    def record(self) -> dict:
        f = self.path / RECORD
        if not f.is_file():
            return {}
        try:
            return json.loads(f.read_text())
        except ValueError as e:
            raise UserError(f"{f} is not valid JSON ({e}); restore it or start a new --out") from None

    def check_target(self, *, resume: bool) -> None:
        """Refuse an ``--out`` that is not ours to write (see the module doc)."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise UserError(f"--out {p} is a file, not a directory; choose a directory path")
        _writable(p)
        if (p / LOCK).exists():  # another trainer first: its PID is the useful thing to say
            self.lock()
            self.unlock()
        if resume:
            if not self.is_run():
                what = "does not exist" if not p.exists() else "is not a jaxmoe run directory"
                raise UserError(f"--resume: {p} {what} (no {RECORD} or {CONFIG}); run without "
                                "--resume to start a new run there")
            return
        if self.is_run():
            raise UserError(f"{p} already holds a run; pass --resume to continue it or choose another --out")
        if p.is_dir() and any(q.name != LOCK for q in p.iterdir()):
            raise UserError(f"--out {p} is a non-empty directory that is not a jaxmoe run; choose an "
                            "empty or new directory")

    # -- the lock -----------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold ``OUT/.lock`` for this process's lifetime (primary only)."""
        if not self.primary or self._lock_fd is not None:
            return
        f = self.path / LOCK
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"--out {self.path}: cannot write there ({e.strerror}); choose a directory "
                            "you can write") from None
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{self.path} is in use by {holder}; wait for it to finish or choose "
                            "another --out") from None
        except OSError:  # a file system without flock: best effort with the PID alone
            holder = os.read(fd, 200).decode(errors="replace").split()
            if holder and holder[-1] == socket.gethostname() and _alive(int(holder[1])):
                os.close(fd)
                raise UserError(f"{self.path} is in use by PID {holder[1]} on {holder[-1]}; wait "
                                "for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"PID {os.getpid()} on {socket.gethostname()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- the record and the metrics -----------------------------------------------------------
    def write_record(self, **fields) -> None:
        if not self.primary:
            return
        rec = {**self.record(), **fields}
        rec.setdefault("created", time.strftime("%Y-%m-%d %H:%M:%S"))
        tmp = self.path / (RECORD + ".tmp")
        tmp.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path / RECORD)

    def truncate_metrics(self, step: int) -> int:
        """Keep only the metrics rows of steps <= ``step`` (events included), so a resumed run never
        holds a step twice; returns how many rows were dropped. Atomic (temporary + rename)."""
        f = self.path / METRICS
        if not self.primary or not f.is_file():
            return 0
        keep, dropped = [], 0
        for line in f.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a crash mid-write
                dropped += 1
                continue
            if int(row.get("step", 0)) <= step:
                keep.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = self.path / (METRICS + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, f)
        return dropped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["CHECKPOINTS", "CONFIG", "LOCK", "METRICS", "RECORD", "RunDir"]
