"""bench/gpu.sh cannot rot: its --dry-run (CPU, tiny shapes) builds, compiles and times a
throughput variant and a memory variant through the same code as on a GPU, reports a variant
whose config field is unknown as skipped, and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    # a throughput and a memory variant, and the Hopper-kernel variant (reference kernels on CPU)
    only = "coarse/blocked,europa/lean+offload_optimizer,fine/ragged_mgpu"
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--only", only, "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["backend"] == "cpu" and res["bf16_matmul_peak_tflops"] > 0
    by = {v["name"]: v for v in res["variants"]}
    assert set(by) == set(only.split(","))
    for name in only.split(","):
        v = by[name]
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] and v["loss_last"] == v["loss_last"]  # finite
        assert isinstance(v["memory_analysis_bytes"], dict), v
        assert name in r.stdout
    assert "reference" in by["fine/ragged_mgpu"]["kernels"] and "kernels" not in by["coarse/blocked"]
    kc = by["fine/ragged_mgpu"]["kernel_check"]  # reference kernels vs ragged_dot, bf16
    errs = [kc[k] for k in kc if k.startswith("d_") or k == "output"]
    assert kc["finite"] and kc["rows"] == 256 and max(errs) < 3e-2, kc
    assert "vs ragged_dot: max rel L2" in r.stdout


def test_driver_never_imports_jax(tmp_path):
    """On the GPU machine the driver must hold no device memory: a JAX GPU client preallocates 75%
    of the device, and every variant process would run in the rest (the 2026-12-04 H200 run's
    out-of-memory errors). The matmul peak and each variant run in child processes; here they are
    faked, and the driver process must end without jax ever imported."""
    out = tmp_path / "gpu.json"
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import gpu
calls = []
def fake(args, timeout):
    calls.append(args)
    if "--measure-peak" in args:
        return {{"backend": "gpu", "device": "fake H200", "dry_run": False, "xla_profile": "none",
                 "bf16_matmul_peak_tflops": 700.0, "jax": "x"}}
    v = json.loads(args[args.index("--variant") + 1])
    assert float(args[args.index("--peak") + 1]) == 700e12
    return {{"name": v["name"], "kind": v["kind"], "error": "exit 1: faked"}}
gpu._run_child = fake
rc = gpu.main(["--only", "coarse/blocked", "--xla-profile", "none", "--json", {str(out)!r}])
assert rc == 1, rc  # the faked variant reports an error
assert [c[0] for c in calls] == ["--measure-peak", "--variant"], calls
assert "jax" not in sys.modules, "the driver imported jax"
print("OK")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-1000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["device"] == "fake H200" and res["variants"][0]["error"] == "exit 1: faked"


def test_driver_reports_a_failed_peak_process(tmp_path):
    """The matmul-peak child failing: one line on stderr, exit 1, no JSON written."""
    out = tmp_path / "gpu.json"
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import gpu
gpu._run_child = lambda args, timeout: {{"error": "exit 1: CUDA_ERROR_NO_DEVICE"}}
sys.exit(gpu.main(["--xla-profile", "none", "--json", {str(out)!r}]))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-1000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: the matmul-peak process failed: exit 1: CUDA_ERROR_NO_DEVICE"], r.stderr[-1000:]
    assert not out.exists()
