"""bench/gpu.sh cannot rot: its --dry-run (CPU, tiny shapes) builds, compiles and times a
throughput variant and a memory variant through the same code as on a GPU, reports a variant
whose config field is unknown as skipped, and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    # a throughput and a memory variant, and the Hopper-kernel variant (reference kernels on CPU)
    only = "coarse/blocked,europa/lean+offload_optimizer,fine/ragged_mgpu,coarse/torchtitan"
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--only", only, "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["backend"] == "cpu" and res["bf16_matmul_peak_tflops"] > 0
    by = {v["name"]: v for v in res["variants"]}
    assert set(by) == set(only.split(","))
    for name in only.split(",")[:3]:
        v = by[name]
        assert v["tokens_per_s"] > 0 and 0 < v["mfu"] and v["loss_last"] == v["loss_last"]  # finite
        assert isinstance(v["memory_analysis_bytes"], dict), v
        assert name in r.stdout
    assert "reference" in by["fine/ragged_mgpu"]["kernels"] and "kernels" not in by["coarse/blocked"]
    kc = by["fine/ragged_mgpu"]["kernel_check"]  # reference kernels vs ragged_dot, bf16
    errs = [kc[k] for k in kc if k.startswith("d_") or k == "output"]
    assert kc["finite"] and kc["rows"] == 256 and max(errs) < 3e-2, kc
    assert "vs ragged_dot: max rel L2" in r.stdout
    # the peer: torchtitan's MoE in its own process (CPU: SDPA, no compile), and the ratio per shape
    tt = by["coarse/torchtitan"]
    assert tt["kind"] == "torchtitan" and tt["tokens_per_s"] > 0 and tt["loss_last"] == tt["loss_last"], tt
    assert tt["attention"] == "sdpa" and tt["compile"] is False and tt["device"] == "cpu"
    cb = by["coarse/blocked"]
    assert cb["torchtitan_tokens_per_s"] == tt["tokens_per_s"]
    assert abs(cb["ratio_to_torchtitan"] - cb["tokens_per_s"] / tt["tokens_per_s"]) < 1e-9
    assert by["fine/ragged_mgpu"]["torchtitan_tokens_per_s"] is None  # no fine torchtitan run here
    assert "coarse: jaxmoe / torchtitan = " in r.stdout and "fine: jaxmoe / torchtitan = n/a" in r.stdout
    # where the time goes: a profile of 2 more steps per throughput variant (CPU: XLA's thunks)
    for name in ("coarse/blocked", "fine/ragged_mgpu"):
        tk, sh = by[name]["top_kernels"], by[name]["time_shares"]
        assert 0 < len(tk) <= 15 and all(k["ms"] >= 0 and k["category"] in sh for k in tk), tk
        assert abs(sum(sh.values()) - 1) < 1e-6 and sh["matmul"] > 0, sh
    assert "top_kernels" not in by["europa/lean+offload_optimizer"]


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


@pytest.mark.slow  # a second compile of a variant; the dry run above already checks top_kernels
def test_profile_dry_run(tmp_path):
    """``--profile VARIANT`` keeps a jax.profiler trace and prints the top kernels and the time
    shares (CPU, tiny shapes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    prof = tmp_path / "prof"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--profile", "coarse/blocked",
                        "--profile-dir", str(prof), "--json", str(tmp_path / "p.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(prof.rglob("*.xplane.pb")), "no trace written"
    assert "kernels" in r.stdout and "shares: matmul" in r.stdout and f"trace: {prof}" in r.stdout, r.stdout
    assert [v["name"] for v in json.loads((tmp_path / "p.json").read_text())["variants"]] == ["coarse/blocked"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--profile", "coarse/nope"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not a throughput variant" in bad.stderr


def test_memory_only_dry_run(tmp_path):
    """``--memory-only`` lowers the step for CUDA as on a GPU (cuDNN attention) and lists the
    compiled step's (XLA:CPU proxy) largest allocations against 48 GiB (CPU, tiny shapes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--memory-only", "--only",
                        "coarse/blocked+save_dots", "--attention-model", "both", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["attention_models"] == ["flash", "xla"]
    assert [(x["name"], x["attention_model"]) for x in res["variants"]] == [
        ("coarse/blocked+save_dots", "flash"), ("coarse/blocked+save_dots", "xla")]
    for v in res["variants"]:
        assert v["remat"] == "save_dots"
        # the autos as a GPU run resolves them (the CPU rules would unroll the layer scan)
        assert v["resolved"]["compute.scan_unroll"] == 1 and v["resolved"]["compute.ce_chunk_tokens"] == 0
        assert v["resolved"]["compute.attention_kernel"] == "dot_product" and "compute.scan_unroll" in v["auto_fields"]
        c = v["cuda_stablehlo"]  # lowered as on a GPU: cuDNN attention, no score tensor, no ragged_dot
        assert c["cudnn_attention_calls"] >= 2 and c["score_tensors"] == [] and c["chlo_ragged_dot"] == 0, c
        ma = v["memory_analysis_bytes"]
        assert v["peak_bytes"] == ma["argument"] + ma["output"] - ma["alias"] + ma["temp"] > 0 and v["fits_48GB"]
        top = v["top_allocations"]
        assert len(top) == 5 and all(a["bytes"] > 0 and a["shapes"] for a in top)
        assert [a["bytes"] for a in top] == sorted((a["bytes"] for a in top), reverse=True)
    flash, xla = res["variants"]  # B x H x S x S scores: kept by XLA's attention, not by the stand-in
    assert flash["cpu_score_buffers"] == [] and xla["cpu_score_buffers"], xla
    assert flash["peak_bytes"] < xla["peak_bytes"]
    assert "flash attention]" in r.stdout and "xla attention]" in r.stdout and "resolved for gpu:" in r.stdout
    assert "fits in 48 GiB [XLA:CPU proxy, " in r.stdout


def test_kernel_categories_and_allocation_report(tmp_path):
    """bench/gpu_profile.py: kernel names -> categories, shares, and XLA's memory-usage report
    parsed (sizes, value counts, shapes), by hand."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_profile as gp

    cases = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "matmul",
             "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "matmul",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective", "all-gather-start.2": "collective",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention", "loop_multiply_fusion_3": "other",
             "ynn_fusion": "matmul", "dot.12": "matmul", "input_reduce_fusion": "other",
             "ragged_dot_mgpu_kernel": "matmul"}
    assert {n: gp.category(n) for n in cases} == cases
    s = gp.summarize("test", {"gemm_a": 6e6, "nccl_b": 2e6, "flash_c": 1e6, "fusion_d": 1e6}, top=2)
    assert [k["name"] for k in s["kernels"]] == ["gemm_a", "nccl_b"] and s["total_ms"] == 10.0
    assert s["shares"] == {"matmul": 0.6, "collective": 0.2, "attention": 0.1, "other": 0.1}
    (tmp_path / "module_0001.jit_step.cpu_after_optimizations-memory-usage-report.txt").write_text(
        "Memory Space: default (color=0)\nTotal bytes: 3221225472 (3.00GiB)\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
        "  ------------------------------------------------------------\n"
        "    2.00GiB( 67%);    2.00GiB;            0;                6; f32[4,8,2048,4096], 5\u00d7f32[4,2048]\n"
        "    2.50GiB( 83%);  512.00MiB;   2147483648;                1; bf16[8,2048,16384]\n"
        "    3.00GiB( 97%);  512.00MiB;   2684354560;                2; 2\u00d7f32[32768,4096]\n"
        "    3.09GiB(100%);   96.00MiB;   3221225472;                3; f32[2,4,1024,1024], 2\u00d7bf16[1024,1024]\n")
    (tmp_path / "module_0002.jit_f.cpu_after_optimizations-memory-usage-report.txt").write_text(
        "    1.00MiB(100%);    1.00MiB;            0;                1; f32[512,512]\n")  # smaller: not the step's
    # [.., S, S] buffers (S = 1024); at the B x H x S x S floor the [D, D]-like one is not a score
    assert gp.square_buffers(str(tmp_path), 1024) == ["bf16[1024,1024]", "f32[2,4,1024,1024]"]
    assert gp.square_buffers(str(tmp_path), 1024, 2 * 4 * 1024 * 1024) == ["f32[2,4,1024,1024]"]
    assert gp.square_buffers(str(tmp_path), 4096) == []  # [.., 2048, 4096] and [.., 32768, 4096] are not square
    top = gp.largest_allocations(str(tmp_path), 2)
    assert top == [{"bytes": 2 * 2**30, "values": 6, "shapes": "f32[4,8,2048,4096], 5\u00d7f32[4,2048]"},
                   {"bytes": 2**29, "values": 1, "shapes": "bf16[8,2048,16384]"}]


def test_flash_memory_stand_in_keeps_no_scores(tmp_path, capsys):
    """bench/gpu_fit.py's flash-attention memory model: the compiled (XLA:CPU) fwd+bwd holds no
    ``[.., S, S]`` buffer, where XLA's own attention does (the check can fail), and its gradients
    have the real attention's shapes and dtypes, with and without a mask (GQA: 4 query heads on 2
    KV heads; S = 48 is no other dim here)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_fit
    import gpu_profile
    import jax
    import jax.numpy as jnp

    b, s, h, kv, d = 2, 48, 4, 2, 16
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.bfloat16)
    seg = jnp.repeat(jnp.array([[1, 2], [1, 1]]), s // 2, axis=1)
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]

    def grads(attn, mask):
        def loss(q, k, v):
            out = attn(q, k, v, mask=mask, scale=d**-0.5, is_causal=True)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)

    real, stand = jax.nn.dot_product_attention, gpu_fit.flash_memory_stand_in
    for m in (None, mask):
        (g_r, o_r), (g_s, o_s) = grads(real, m)(q, k, v), grads(stand, m)(q, k, v)
        assert [(x.shape, x.dtype) for x in (o_s, *g_s)] == [(x.shape, x.dtype) for x in (o_r, *g_r)]
        assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (o_s, *g_s))

    # the residuals saved for the backward: exactly cuDNN flash attention's (q, k, v, out, fp32
    # [B, H, S] statistics), plus the additive [B, 1, S, S] bias in the compute dtype when masked
    from jax.ad_checkpoint import print_saved_residuals

    def saved(m):
        capsys.readouterr()
        print_saved_residuals(lambda q, k, v: jnp.sum(stand(q, k, v, mask=m).astype(jnp.float32)), q, k, v)
        return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines())

    flash = ["bf16[2,48,4,16]", "bf16[2,48,4,16]", "bf16[2,48,2,16]", "bf16[2,48,2,16]", "f32[2,4,48]"]
    assert saved(None) == sorted(flash)
    assert saved(mask) == sorted(flash + ["bf16[2,1,48,48]"])

    def square_buffers(attn, tag):
        dump = tmp_path / tag
        jax.jit(grads(attn, None)).lower(q, k, v).compile(
            compiler_options={"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "^$"})
        return gpu_profile.square_buffers(str(dump), s)

    assert square_buffers(real, "xla"), "XLA's attention should keep [.., S, S] scores"
    assert square_buffers(stand, "flash") == []
    with gpu_fit.attention_model("flash"):  # the step's attention call goes to the stand-in
        assert jax.nn.dot_product_attention is stand
    assert jax.nn.dot_product_attention is real
