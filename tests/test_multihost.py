"""Multi-process training on one machine (gloo CPU collectives), checkpoint resharding on resume,
and the XLA flag profile.

* A: one process, 8 devices, ``--mesh expert=4,fsdp=2``, 4 steps (uninterrupted reference).
* B: two processes x 4 devices, ``--coordinator 127.0.0.1:PORT``, same mesh, 3 steps: each
  process feeds only its rows; the logged losses equal A's first 3.
* C: ``--resume`` of B in one process with ``--mesh fsdp=8`` and ``--steps 4``: the checkpoint
  written by both processes together restores onto another mesh and process count, and step 4's
  loss equals A's step 4 (all 4 steps are inside the 5-step warm-up, so the lr schedule does not
  depend on ``--steps``).
* The emergency tier: one of two processes SIGKILLed, the restart from the newest complete local
  step, on the same mesh and onto one process / one replica
  (:func:`test_kill_one_process_restart_from_the_newest_complete_tier`).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import free_port

COMMON = ["--preset", "tiny", "--set", "train.seq_len=16", "--set", "train.eval_every=0", "--quiet"]
TIMEOUT = 900


def _env(n_devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("SLURM_JOB_ID", None)  # never let a surrounding SLURM job drive these processes
    return env


def _train(args, n_devices):
    return subprocess.Popen(
        [sys.executable, "-m", "jaxmoe.cli", "train", *COMMON, *args],
        env=_env(n_devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait(procs):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _losses(run: Path):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.slow
def test_two_processes_match_one_and_resume_on_another_mesh(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    port = free_port()
    multi = [
        _train(["--mesh", "expert=4,fsdp=2", "--steps", "3", "--out", str(b),
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], 4)
        for i in range(2)
    ]
    _wait(multi)
    _wait([_train(["--mesh", "expert=4,fsdp=2", "--steps", "4", "--out", str(a)], 8)])
    la, lb = _losses(a), _losses(b)
    assert sorted(lb) == [1, 2, 3] and sorted(la) == [1, 2, 3, 4]
    np.testing.assert_allclose([lb[s] for s in (1, 2, 3)], [la[s] for s in (1, 2, 3)], rtol=1e-5)

    _wait([_train(["--resume", "--mesh", "fsdp=8", "--steps", "4", "--out", str(b)], 8)])
    lc = _losses(b)
    assert sorted(lc) == [1, 2, 3, 4]
    np.testing.assert_allclose(lc[4], la[4], rtol=1e-5)


def test_xla_flag_profile_flags_exist_and_apply_before_init():
    """Every flag of the gpu_overlap profile is known to this jaxlib's XLA (XLA aborts at backend
    start-up on an unknown flag), and setting the profile keeps flags the user already gave."""
    from jaxmoe.parallel.distributed import XLA_FLAG_PROFILES, apply_xla_flags_profile

    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = apply_xla_flags_profile("gpu_overlap", env)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]
    assert not any(f.startswith("--xla_gpu_enable_latency_hiding_scheduler") for f in added)
    assert len(added) == len(XLA_FLAG_PROFILES["gpu_overlap"]) - 1
    code = "import jax; print(len(jax.devices()))"
    e = _env(1)
    e["XLA_FLAGS"] += " " + " ".join(XLA_FLAG_PROFILES["gpu_overlap"])
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr[-2000:]
    # and a misspelt flag really would abort (so the check above has teeth)
    e["XLA_FLAGS"] += " --xla_gpu_enable_latency_hiding_schedulerr=true"
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0


def test_distributed_argument_errors():
    from jaxmoe.errors import UserError
    from jaxmoe.parallel.distributed import initialize

    with pytest.raises(UserError, match="--num-processes"):
        initialize("127.0.0.1:1234", None, 0)
    with pytest.raises(UserError, match="HOST:PORT"):
        initialize("localhost", 2, 0)
    with pytest.raises(UserError, match="--process-id 2"):
        initialize("127.0.0.1:1234", 2, 2)


@pytest.mark.slow
def test_sigterm_to_one_process_saves_the_same_step_on_all(tmp_path):
    """SLURM signals every task, but not at the same step: JAX's preemption service makes both
    processes save one agreed step and exit 75; --resume continues from it."""
    import signal
    import time

    out = tmp_path / "run"
    port = free_port()
    procs = [
        _train(["--mesh", "expert=4,fsdp=2", "--steps", "300", "--out", str(out),
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], 4)
        for i in range(2)
    ]
    try:
        deadline = time.time() + TIMEOUT
        while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [75, 75], [o[-2000:] for o in outs]
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    last = max(_losses(out))
    assert saved and saved[-1] == last < 300
    _wait([_train(["--resume", "--mesh", "expert=4,fsdp=2", "--steps", str(last + 2), "--out", str(out)], 8)])
    assert sorted(_losses(out)) == list(range(1, last + 3))


@pytest.mark.slow
def test_kill_one_process_restart_from_the_newest_complete_tier(tmp_path):
    """Emergency tier (train.local_checkpoint_every=1; no persistent save before the kill) on two
    processes x 4 devices, mesh replica=2,fsdp=2,expert=2 (one replica per process). Process 1 is
    SIGKILLed mid-run (then process 0, stuck in a collective). The local steps >= the last logged
    one are torn, as a kill landing mid-save leaves them: each is skipped with one line, and the
    restart restores step last-1, the newest complete:
    * on both processes, same mesh: the re-run step equals the one logged before the kill, bit
      for bit;
    * on one process of 4 devices (replica=1) with process 1's local directory gone (the host that
      died): process 0's directory alone holds the state; the steps after it equal the same-mesh
      restart's (rtol 1e-5: another mesh sums in another order)."""
    import shutil
    import time

    out = tmp_path / "run"
    tier = ["--set", "train.local_checkpoint_every=1", "--set", "checkpoint.every=100", "--set",
            "checkpoint.minutes=0", "--set", "train.async_loop=false"]
    mesh = ["--mesh", "replica=2,fsdp=2,expert=2"]

    def two(steps, extra=()):
        port = free_port()
        return [_train([*mesh, *tier, *extra, "--steps", str(steps), "--out", str(out), "--coordinator",
                        f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], 4) for i in range(2)]

    procs = two(40)
    try:
        deadline = time.time() + TIMEOUT
        while not ((out / "metrics.jsonl").exists() and len(_losses(out)) >= 4):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        procs[1].kill()
        time.sleep(1.0)
        procs[0].kill()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    before = _losses(out)
    last = max(before)
    root = out / "local_checkpoints"
    torn = set()
    for d in root.iterdir():
        for step in d.iterdir():
            if step.name.isdigit() and int(step.name) >= last:
                data = step / "shards.bin"
                data.write_bytes(data.read_bytes()[:100])
                torn.add(int(step.name))
    assert not (out / "checkpoints").exists() or not any(p.name.isdigit() for p in (out / "checkpoints").iterdir())
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "local_checkpoints" / "process_1")

    outs = _wait(two(last + 2, ["--resume"]))
    assert f"resuming from local checkpoint {last - 1}" in outs[0], outs[0][-2000:]
    for step in torn:  # one line each
        assert sum(f"local checkpoint {step} skipped" in line and "torn" in line
                   for line in outs[0].splitlines()) == 1, outs[0][-2000:]
    after = _losses(out)
    assert sorted(after) == list(range(1, last + 3))
    assert after[last] == before[last]  # re-run after the restore: bit for bit

    one = _wait([_train(["--resume", "--mesh", "replica=1,fsdp=2,expert=2", *tier, "--steps", str(last + 2),
                         "--out", str(copy)], 4)])
    assert f"resuming from local checkpoint {last - 1}" in one[0], one[0][-2000:]
    small = _losses(copy)
    np.testing.assert_allclose([small[s] for s in range(last, last + 3)], [after[s] for s in range(last, last + 3)],
                               rtol=1e-5)
