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
    only = "coarse/blocked,europa/lean+offload_optimizer"  # a throughput and a memory variant
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--only", only, "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["backend"] == "cpu" and res["bf16_matmul_peak_tflops"] > 0
    by = {v["name"]: v for v in res["variants"]}
    assert set(by) == set(only.split(","))
    for name in ("coarse/blocked", "europa/lean+offload_optimizer"):
        v = by[name]
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] and v["loss_last"] == v["loss_last"]  # finite
        assert isinstance(v["memory_analysis_bytes"], dict), v
        assert name in r.stdout
