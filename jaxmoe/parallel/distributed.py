"""Multi-host start-up and XLA flag profiles.

Two things must happen before anything touches a JAX backend (``jax.devices()``, the first array,
the first jit): XLA_FLAGS must hold every flag (XLA reads them once, when the backend is created),
and ``jax.distributed.initialize`` must have run (it decides which devices are global). Importing
``jax`` itself is fine; creating the backend is not. ``jaxmoe.parallel.mesh.setup_from_args`` calls
:func:`apply_xla_flags_profile` then :func:`initialize_from_args` first thing, and ``jaxmoe.train.cli``
touches no backend before it.

Multi-host initialisation, in order of precedence:

1. ``--coordinator HOST:PORT --num-processes N --process-id I`` (any cluster, or several processes
   on one machine for tests);
2. a SLURM job step with more than one task (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
   ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID`` set by ``srun``): JAX's own SLURM
   detection computes the coordinator (first node of the step) and the process ids;
3. otherwise one process.

On CPU, cross-process collectives use gloo (``jax_cpu_collectives_implementation = "gloo"``, set
before initialising; it is the default in recent jax but set explicitly so older/newer defaults do
not matter). Each process then feeds only its own rows (``MeshContext.place_batch``), and
checkpoints are written by all processes together (Orbax).
"""

from __future__ import annotations

import os
import shlex
import sys

from jaxmoe.errors import UserError

# Latency-hiding scheduler and collective pipelining / combining for GPU (flags verified to exist
# in the XLA of jaxlib 0.10.2; XLA aborts at start-up on an unknown flag, so do not add guesses).
# See the JAX "GPU performance tips" page for what each does.
XLA_FLAG_PROFILES: dict[str, list[str]] = {
    "none": [],
    "gpu_overlap": [
        "--xla_gpu_enable_latency_hiding_scheduler=true",  # schedule collectives to overlap compute
        "--xla_gpu_enable_highest_priority_async_stream=true",  # collectives on a high-priority stream
        "--xla_gpu_enable_pipelined_all_gather=true",  # prefetch next layer's FSDP all-gather in scans
        "--xla_gpu_enable_pipelined_reduce_scatter=true",  # overlap gradient reduce-scatters
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",  # double-buffer scanned layers
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",  # combine small collectives
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    ],
}


def backend_initialized() -> bool:
    """True once a JAX backend exists (flags set after that are ignored)."""
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # noqa: BLE001 (a private API that may move)  # pragma: no cover
        return False


def apply_xla_flags_profile(name: str, env: dict | None = None) -> list[str]:
    """Append the profile's flags to ``XLA_FLAGS`` (flags already present keep their value).

    Must run before the JAX backend is created (see the module doc); if it already exists the
    flags cannot take effect and a warning says so (never silently ignored). Returns the flags
    added."""
    env = os.environ if env is None else env
    if name not in XLA_FLAG_PROFILES:
        raise UserError(f"mesh.xla_flags_profile={name!r} is not one of: {', '.join(XLA_FLAG_PROFILES)}")
    flags = XLA_FLAG_PROFILES[name]
    if not flags:
        return []
    current = shlex.split(env.get("XLA_FLAGS", ""))
    have = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in have]
    if not added:
        return []
    if env is os.environ and backend_initialized():
        import sys

        print(
            f"warning: mesh.xla_flags_profile={name!r} not applied: the JAX backend is already "
            "initialised; apply it before any jax computation (or export XLA_FLAGS)",
            file=sys.stderr,
        )
        return []
    env["XLA_FLAGS"] = " ".join(current + added)
    return added


def _use_gloo() -> None:
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 (an option a future jax may rename)  # pragma: no cover
        pass


def slurm_world() -> tuple[int, int] | None:
    """(process_id, num_processes) of a multi-task SLURM step, or None."""
    need = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if not all(k in os.environ for k in need):
        return None
    n = int(os.environ["SLURM_NTASKS"])
    return (int(os.environ["SLURM_PROCID"]), n) if n > 1 else None


def _watchdog(timeout: float, coordinator: str, num_processes: int, process_id: int):
    """A timer that ends the process with a one-line error if start-up has not finished in time.

    jax.distributed.initialize waits for every process to register with the coordinator; when one
    never comes, XLA aborts the whole process with a C++ stack trace after its own timeout. This
    fires first (jax's timeout is set longer) and says who was waited for."""
    import threading

    if process_id == 0:
        missing = [i for i in range(num_processes) if i != 0]
        who = (f"process 0 (the coordinator, {coordinator}) waited {timeout:.0f}s for process ids "
               f"{', '.join(map(str, missing))} of --num-processes {num_processes}; at least one "
               "never connected")
    else:
        who = (f"process {process_id} could not complete start-up with the coordinator {coordinator} "
               f"within {timeout:.0f}s (process 0, or another of the {num_processes} processes, "
               "never connected)")

    def fail():
        print(f"jaxmoe: error: multi-host start-up timed out: {who}; start every process with the "
              "same --coordinator and --num-processes (or raise --init-timeout)", file=sys.stderr,
              flush=True)
        os._exit(2)

    t = threading.Timer(timeout, fail)
    t.daemon = True
    return t


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: float = 300.0) -> bool:
    """Start multi-process JAX. Returns True if this is a multi-process run. A process that does
    not come within ``timeout`` seconds ends start-up with a one-line error (see _watchdog)."""
    import jax

    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    if coordinator:
        if num_processes is None or process_id is None:
            raise UserError("--coordinator needs --num-processes N and --process-id I")
        if ":" not in coordinator:
            raise UserError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        if not 0 <= process_id < num_processes:
            raise UserError(f"--process-id {process_id} must be in [0, --num-processes={num_processes})")
        _use_gloo()
        dog = _watchdog(timeout, coordinator, num_processes, process_id)
        dog.start()
        try:
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=int(timeout) + 60)
        finally:
            dog.cancel()
        return num_processes > 1
    if slurm_world() is not None:
        _use_gloo()
        jax.distributed.initialize()  # JAX's SLURM detection: coordinator, count and id from env
        return True
    if num_processes not in (None, 1):
        raise UserError("--num-processes > 1 needs --coordinator HOST:PORT (or a SLURM job step)")
    if process_id not in (None, 0):
        raise UserError("--process-id needs --coordinator HOST:PORT and --num-processes N")
    return False


def initialize_from_args(args) -> bool:
    return initialize(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        timeout=getattr(args, "init_timeout", None) or 300.0,
    )


__all__ = ["XLA_FLAG_PROFILES", "apply_xla_flags_profile", "initialize", "initialize_from_args", "slurm_world"]
