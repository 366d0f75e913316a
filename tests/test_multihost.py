"""Multi-process training on one machine (gloo CPU collectives), checkpoint resharding on resume,
and the XLA flag profile.

* A: one process, 8 devices, ``--mesh expert=4,fsdp=2``, 4 steps (uninterrupted reference).
* B: two processes x 4 devices, ``--coordinator 127.0.0.1:PORT``, same mesh, 3 steps: each
  process feeds only its rows; the logged losses equal A's first 3.
* C: ``--resume`` of B in one process with ``--mesh fsdp=8`` and ``--steps 4``: the checkpoint
  written by both processes together restores onto another mesh and process count, and step 4's
  loss equals A's step 4 (all 4 steps are inside the 5-step warm-up, so the lr schedule does not
  depend on ``--steps``).
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
