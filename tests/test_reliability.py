"""Reliability of `jaxmoe train`: bad inputs are one line and change nothing, a run directory is
locked and never started over by accident, a corrupt newest checkpoint falls back to an older
one, and SIGTERM/SIGINT save a checkpoint that --resume continues bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.checkpoint.run_dir import RunDir
from jaxmoe.cli import main

ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
SMALL = ["--preset", "tiny", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
         "--set", "train.eval_every=0"]


def cli(*args):
    return main(["train", "--quiet", *args])


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _bad_inputs(tmp: Path):
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")
    theirs = tmp / "someone-elses"
    theirs.mkdir()
    (theirs / "config.toml").write_text("# not a jaxmoe run\n")
    obj = tmp / "obj.npy"
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cut = tmp / "cut.npy"
    np.save(tmp / "full.npy", np.arange(5000, dtype=np.uint16))
    cut.write_bytes((tmp / "full.npy").read_bytes()[:600])
    new = str(tmp / "new-run")
    return [
        (["--out", str(a_file)], "is a file"),
        (["--out", "/proc/jaxmoe-test-out/run"], "cannot write"),
        (["--out", str(theirs)], "not a jaxmoe run"),
        (["--out", new, "--set", "train.log_every=0"], "train.log_every"),
        (["--out", new, "--set", "train.eval_every=5", "--set", "train.eval_batches=0"], "train.eval_batches"),
        (["--out", new, "--set", "optim.lr=nan"], "optim.lr"),
        (["--out", new, "--set", 'optim.muon_ns_coefficients=[3.4, "x", 2.0]'], "optim.muon_ns_coefficients"),
        (["--out", new, "--data", f"tokens:{obj}"], "not a readable .npy"),
        (["--out", new, "--data", f"tokens:{cut}"], "not a readable .npy"),
        (["--out", new, "--resume-step", "3"], "--resume-step needs --resume"),
        (["--out", new, "--num-processes", "2"], "needs --coordinator"),
        (["--out", new, "--process-id", "1"], "--process-id needs"),
        (["--out", new, "--init-from", f"hf:{tmp / 'missing'}"], "not a directory"),
        (["--out", new, "--init-from", "nonsense"], "--init-from"),
        (["--resume", "--out", str(theirs)], "--resume"),
    ]


def test_bad_inputs_are_one_line_and_change_nothing(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    before = snapshot(tmp_path)
    for args, needle in cases:
        rc = cli(*SMALL, "--steps", "2", *args)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and needle in err[0] and "Traceback" not in err[0], (args, err)
        assert snapshot(tmp_path) == before, (args, "files changed")
    assert not (tmp_path / "new-run").exists()


def test_second_trainer_on_a_run_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    holder = RunDir(out)
    holder.lock()  # as a running trainer holds it
    try:
        rc = cli(*SMALL, "--steps", "2", "--out", str(out))
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and f"in use by PID {os.getpid()}" in err[0], err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.unlock()
    assert cli(*SMALL, "--steps", "2", "--out", str(out)) == 0  # released: the next one may run


def test_corrupt_newest_checkpoint_falls_back_and_no_step_twice(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(*SMALL, "--steps", "6", "--stop-after", "4", "--checkpoint-every", "2", "--out", str(out)) == 0
    for p in (out / "checkpoints" / "4").rglob("*"):
        if p.is_file() and "meta" not in str(p.relative_to(out)) and p.stat().st_size > 0:
            p.write_bytes(b"garbage")
    capsys.readouterr()
    assert cli("--resume", "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "checkpoint 4 skipped" in err and "resuming from checkpoint 2" in err, err
    assert "dropped 2 rows past step 2" in err
    steps = [r["step"] for r in rows(out)]
    assert steps == [1, 2, 3, 4, 5, 6]
    # --resume-step picks an exact checkpoint (and a missing one is one line)
    assert cli("--resume", "--resume-step", "5", "--steps", "7", "--out", str(out)) == 2
    assert "no checkpoint for step 5" in capsys.readouterr().err


def test_stop_after_zero_and_changed_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(*SMALL, "--steps", "4", "--stop-after", "0", "--out", str(out)) == 0
    assert RunDir(out).is_run() and not (out / "metrics.jsonl").exists()
    capsys.readouterr()
    # never saved: --resume starts it over from step 0 (and says so); a longer schedule is said too
    assert cli("--resume", "--steps", "5", "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "no checkpoint yet" in err and "train.steps is 5 (was 4)" in err, err
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5]


def _spawn(out, *extra, steps=400):
    cmd = [sys.executable, "-m", "jaxmoe.cli", "train", "--quiet", *SMALL, "--steps", str(steps),
           "--out", str(out), *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_rows(out, n, proc, deadline=900, poll=0.05):  # a hang guard, not a timing assert
    end = time.time() + deadline
    while time.time() < end:
        f = Path(out) / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(poll)
    raise AssertionError("the run did not start")


def test_sigterm_saves_and_resume_is_bit_exact(tmp_path):
    # 48 steps, not 12: with a warm compilation cache the tiny run's last 9 steps took less than
    # one 50 ms poll of _wait_rows, and the run had finished (saved at step 12) when SIGTERM came
    steps = 48
    ref = tmp_path / "straight"
    assert cli(*SMALL, "--steps", str(steps), "--out", str(ref)) == 0
    out = tmp_path / "preempted"
    proc = _spawn(out, steps=steps)
    _wait_rows(out, 3, proc, poll=0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 75, err
    assert "continue with: jaxmoe train --resume --out" in err
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved and max(saved) == rows(out)[-1]["step"] < steps
    assert json.loads((out / "run.json").read_text())["status"] == "preempted"
    assert cli("--resume", "--out", str(out)) == 0
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(ref)]  # bit for bit


@pytest.mark.slow
def test_sigint_during_saves_then_second_signal_aborts(tmp_path):
    out = tmp_path / "run"
    proc = _spawn(out, "--checkpoint-every", "1")  # a save is in flight almost all the time
    _wait_rows(out, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 75, err
    assert "Traceback" not in err
    last = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert last == rows(out)[-1]["step"]
    # two signals: abort at once; what was committed still restores
    proc = _spawn(out, "--resume", "--checkpoint-every", "1")
    _wait_rows(out, last + 3, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=900)
    assert proc.returncode in (75, 130)
    r = subprocess.run([sys.executable, "-m", "jaxmoe.cli", "train", "--quiet", "--resume", "--out", str(out),
                        "--steps", str(last + 6)], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    steps = [x["step"] for x in rows(out)]
    assert steps == list(range(1, last + 7))


def test_multi_host_peer_that_never_comes_times_out_with_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxmoe.cli", "train", "--quiet", *SMALL, "--steps", "2",
                        "--out", str(out), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                        "--process-id", "0", "--init-timeout", "3"],
                       env=ENV, capture_output=True, text=True, timeout=900)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert f"127.0.0.1:{port}" in err[0] and "process ids 1" in err[0] and "--init-timeout" in err[0]
    assert not out.exists()
