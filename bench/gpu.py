"""The GPU benchmark behind ``bench/gpu.sh`` (one lent GPU, <= 8 minutes): throughput and memory.

    bench/gpu.sh [--dry-run] [--json PATH] [--budget-s 450] [--xla-profile gpu_overlap|none]
    python bench/gpu.py [--dry-run] --profile VARIANT [--profile-dir DIR]  # trace + top 15 kernels
    python bench/gpu.py [--dry-run] --memory-only [--attention-model flash|xla|both]  # does each shape fit, CPU

Throughput (tokens/s, MFU against a measured bf16 matmul peak, peak device memory), bf16 compute,
flash attention (``compute.attention_kernel=dot_product``: cuDNN on GPU), the ``gpu_overlap`` XLA
flag profile, on the two shapes of ``bench/train_step.py`` scaled to d_model 2048 -- ``coarse``
(8 experts top-2, expert FFN 4096, Mixtral-style) and ``fine`` (64 experts top-8, expert FFN 1024,
QK-norm, Qwen3-MoE-style) -- each with the ``ragged`` path on jax's Hopper grouped-GEMM kernels
(``*/ragged_mgpu``: ``moe.ragged_kernel=mosaic_gpu``, which also reports ``kernel_check``, the
relative L2 error of its output and gradients against ``jax.lax.ragged_dot`` on the device), the
``blocked`` path, and last the ``ragged`` path on ``jax.lax.ragged_dot`` (``*/ragged``: lowered
densely on GPU, a reference). Each throughput variant also runs 2 steps under ``jax.profiler``:
``top_kernels`` and ``time_shares`` (matmul / collective / attention / other; bench/gpu_profile.py).

The peer (issue 27): torchtitan's Qwen3-style MoE at the same shapes (``*/torchtitan``, and
``*/torchtitan_compile`` with ``torch.compile``), each in its own process (bench/titan_worker.py;
jaxmoe never imports torchtitan); every jaxmoe throughput variant gets ``torchtitan_tokens_per_s``
(the faster torchtitan variant of its shape) and ``ratio_to_torchtitan``, and one ``jaxmoe /
torchtitan`` line per shape is printed. The dry run runs it on CPU (SDPA attention, no compile).

Memory (issue 13): peak device memory of a europa-shaped slice (full width d_model 7168, MLA with
64 heads, vocab 163840, 1 dense + 2 MoE layers, 384 experts of width 1536 cut to 16, 4096 tokens)
with the explicit attention scores and whole logits, then with flash attention, with chunked CE,
and with each offload (``compute.remat=offload``, ``optim.offload_optimizer``); a variant whose
config field this tree does not know is reported as skipped, not failed.

Each variant runs in its own process (device memory peaks are per process), in the order above,
and so does the matmul-peak measurement: the driver itself never imports jax. (It used to measure
the peak in-process, and a JAX GPU client preallocates 75% of the device when it starts: every
variant then ran in the 25% left, ~35 GiB of an H200, which is why the 2026-12-04 run saw
out-of-memory on single 20-47 GiB allocations; docs/MEASUREMENTS.md, "GPU".) Variants left when
``--budget-s`` is spent are reported as skipped. ``--dry-run`` runs the same
variants on CPU with tiny shapes, in-process, in seconds (``ragged_mgpu`` with jnp reference
kernels of the same contract in place of the Mosaic ones) (tests/test_bench_gpu.py runs it so
that this script cannot rot). No figure here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import gpu_fit
import gpu_profile
import titan_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- variants ----------------------------------------------------------------------------------

_COMMON = {"moe.lb_coef": 0, "moe.router_z_coef": 0, "moe.seq_aux_coef": 0, "moe.norm_topk_prob": "true",
           "compute.dtype": "bfloat16", "optim.optimizer": "adamw", "optim.grad_clip": 1.0,
           "train.z_loss_coef": 0, "train.steps": 1000, "optim.warmup_steps": 10, "model.first_k_dense": 0}


def _throughput_shapes(dry: bool) -> dict:
    if dry:
        base = {"model.vocab_size": 256, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
                "model.n_kv_heads": 2, "model.head_dim": 16, "train.batch_size": 2, "train.seq_len": 32,
                "model.max_seq_len": 32}
        return {"coarse": dict(base, **{"moe.n_experts": 8, "moe.top_k": 2, "moe.expert_ffn_dim": 128,
                                        "model.qk_norm": "false"}),
                "fine": dict(base, **{"moe.n_experts": 16, "moe.top_k": 4, "moe.expert_ffn_dim": 64,
                                      "model.qk_norm": "true"})}
    base = {"model.vocab_size": 32768, "model.d_model": 2048, "model.n_layers": 4, "model.n_heads": 16,
            "model.n_kv_heads": 8, "model.head_dim": 128, "train.batch_size": 8, "train.seq_len": 2048,
            "model.max_seq_len": 2048}
    return {"coarse": dict(base, **{"moe.n_experts": 8, "moe.top_k": 2, "moe.expert_ffn_dim": 4096,
                                    "model.qk_norm": "false"}),
            "fine": dict(base, **{"moe.n_experts": 64, "moe.top_k": 8, "moe.expert_ffn_dim": 1024,
                                  "model.qk_norm": "true"})}


def _europa_slice(dry: bool) -> dict:
    if dry:
        return {"model.vocab_size": 512, "model.d_model": 64, "model.n_layers": 3, "model.first_k_dense": 1,
                "model.dense_ffn_dim": 128, "model.n_heads": 4, "model.q_lora_rank": 32,
                "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
                "model.v_head_dim": 16, "moe.n_experts": 8, "moe.expert_ffn_dim": 32, "moe.top_k": 2,
                "train.batch_size": 1, "train.seq_len": 64, "model.max_seq_len": 64, "optim.optimizer": "adamw",
                "mesh.expert": 1, "mesh.replica": 1, "mesh.fsdp": 1}
    return {"model.n_layers": 3, "model.first_k_dense": 1, "moe.n_experts": 16, "train.batch_size": 1,
            "train.seq_len": 4096, "model.max_seq_len": 4096, "optim.optimizer": "adamw",
            "mesh.expert": 1, "mesh.replica": 1, "mesh.fsdp": 1}


def variants(dry: bool) -> list[dict]:
    """Every variant: name, preset, overrides, kind ("throughput" / "memory")."""
    out, last = [], []
    paths = {"ragged_mgpu": {"moe.compute_path": "ragged", "moe.ragged_kernel": "mosaic_gpu"},
             "blocked": {"moe.compute_path": "blocked"},
             "ragged": {"moe.compute_path": "ragged", "moe.ragged_kernel": "xla"}}
    for shape, sets in _throughput_shapes(dry).items():
        preset = "mixtral-tiny" if shape == "coarse" else "tiny"
        for name, path_sets in paths.items():
            v = {"name": f"{shape}/{name}", "kind": "throughput", "preset": preset,
                 "sets": {**_COMMON, **sets, **path_sets, "compute.attention_kernel": "dot_product"}}
            (last if name == "ragged" else out).append(v)  # the dense-lowered reference last
    out.sort(key=lambda v: v["name"].split("/")[1] != "ragged_mgpu")  # the grouped GEMMs first
    for shape, sets in _throughput_shapes(dry).items():  # the peer, same shapes (bench/titan_worker.py)
        for comp in ((False,) if dry else (False, True)):  # no torch.compile on CPU (dry run)
            out.append({"name": f"{shape}/torchtitan{'_compile' if comp else ''}", "kind": "torchtitan",
                        "shape": shape, "sets": sets, "compile": comp, "attn": "sdpa" if dry else "flex",
                        "device": "cpu" if dry else "cuda"})
    # 1 dense + 2 MoE layers; the blocked expert path: ragged_dot's dense lowering would add an
    # [E, rows, D] copy (7.5 GiB here) to figures that are about attention, CE and offload
    eu = {**_COMMON, **_europa_slice(dry), "moe.compute_path": "blocked"}
    lean = {"compute.attention_kernel": "dot_product", "compute.ce_chunk_tokens": 64 if dry else 1024}
    mem = [
        ("europa/explicit_attn+whole_logits", {"compute.attention_kernel": "explicit", "compute.ce_chunk_tokens": 0}),
        ("europa/flash_attn", {"compute.attention_kernel": "dot_product", "compute.ce_chunk_tokens": 0}),
        ("europa/flash_attn+chunked_ce", lean),
        ("europa/lean+remat_offload", {**lean, "compute.remat": "offload"}),
        ("europa/lean+offload_optimizer", {**lean, "optim.offload_optimizer": "true"}),
        ("europa/lean+both_offloads", {**lean, "compute.remat": "offload", "optim.offload_optimizer": "true"}),
    ]
    preset = "europa-952b"
    for name, sets in mem:
        out.append({"name": name, "kind": "memory", "preset": preset, "sets": {**eu, **sets}})
    return out + last


# -- one variant -------------------------------------------------------------------------------


def _peak_bytes() -> int | None:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def kernel_check(cfg, rows: int = 4096) -> dict:
    """Relative L2 error of the ragged SwiGLU through ``cfg.moe.ragged_kernel`` against the
    ``xla`` kernel (``jax.lax.ragged_dot``), both in ``cfg``'s dtype: the output and the gradients
    of x and of each expert weight, on ``rows`` rows in random groups (one group empty, the last
    rows in none)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmoe.model.experts import ragged_swiglu

    e, d, i = cfg.moe.n_experts, cfg.model.d_model, cfg.moe.expert_ffn_dim
    dt = jnp.bfloat16 if cfg.compute.dtype == "bfloat16" else jnp.float32
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(rows - rows // 16, np.full(e, 1.0 / e)).astype(np.int32)
    sizes[e // 2] = 0
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (rows, d)).astype(dt)
    w = {"gate_proj": jax.random.normal(ks[1], (e, d, i)) * d ** -0.5,
         "up_proj": jax.random.normal(ks[2], (e, d, i)) * d ** -0.5,
         "down_proj": jax.random.normal(ks[3], (e, i, d)) * i ** -0.5}
    probe = jax.random.normal(ks[4], (rows, d))
    gs = jnp.asarray(sizes)

    def run(kernel):
        def loss(x, w):
            y = ragged_swiglu(x, gs, w, kernel)
            return jnp.sum(y.astype(jnp.float32) * probe), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

    (_, y_k), g_k = run(cfg.moe.ragged_kernel)
    (_, y_x), g_x = run("xla")

    def rel(a, b):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))

    out = {"rows": rows, "output": rel(y_k, y_x), "d_x": rel(g_k[0], g_x[0])}
    for k in ("gate_proj", "up_proj", "down_proj"):
        out[f"d_{k}"] = rel(g_k[1][k], g_x[1][k])
    out["finite"] = bool(all(np.isfinite(v) for k, v in out.items() if k != "rows"))
    return out


def run_variant(v: dict, steps: int, peak_flops: float, profile_dir: str = "") -> dict:
    """Build, compile and time one variant; returns its record (or ``skipped`` with the reason).
    A throughput variant then runs 2 steps under ``jax.profiler.trace`` (into ``profile_dir`` if
    given, else a temporary folder): ``top_kernels`` and ``time_shares`` (bench/gpu_profile.py)."""
    import jax
    import numpy as np

    from jaxmoe.config import load_config
    from jaxmoe.config.counting import flops_per_token
    from jaxmoe.errors import ConfigError
    from jaxmoe.model.transformer import Model, declared_groups, init_params
    from jaxmoe.train.optim import build_optimizer
    from jaxmoe.train.step import init_state, make_train_step, state_shardings

    rec = {"name": v["name"], "kind": v["kind"]}
    try:
        cfg = load_config(v["preset"], overrides=[f"{k}={x}" for k, x in v["sets"].items()])
    except ConfigError as e:  # e.g. optim.offload_optimizer before that field exists
        rec["skipped"] = f"config: {str(e).splitlines()[0][:200]}"
        return rec
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (b, s + 1)).astype(np.int32)
    batch = {"inputs": jax.device_put(toks[:, :-1]), "targets": jax.device_put(toks[:, 1:]),
             "mask": jax.device_put(np.ones((b, s), np.float32))}
    params, buffers = init_params(cfg, 0)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    state = init_state(cfg, tx, params, buffers)
    del params, buffers
    sh = state_shardings(cfg, state)  # optim.offload_optimizer: the optimizer state in pinned_host
    if sh is not None:
        state = jax.device_put(state, sh)
    t = time.perf_counter()
    compiled = make_train_step(Model(cfg), tx).lower(state, batch).compile()
    rec["compile_s"] = round(time.perf_counter() - t, 2)
    try:
        ma = compiled.memory_analysis()
        rec["memory_analysis_bytes"] = {k: int(getattr(ma, k + "_size_in_bytes")) for k in
                                        ("argument", "output", "temp", "generated_code")}
    except Exception as e:  # noqa: BLE001 - not every backend reports it
        rec["memory_analysis_bytes"] = f"unavailable: {type(e).__name__}"
    state, m = compiled(state, batch)
    loss = float(m["loss"])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        m["loss"].block_until_ready()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    rec.update(loss_first=loss, loss_last=float(m["loss"]), step_s=dt, step_s_range=[min(times), max(times)],
               tokens_per_s=b * s / dt, flops_per_token=flops_per_token(cfg),
               peak_device_bytes=_peak_bytes())
    rec["mfu"] = rec["tokens_per_s"] * rec["flops_per_token"] / peak_flops
    if v["kind"] == "throughput":  # a trace of 2 more steps: where the time goes
        with tempfile.TemporaryDirectory() as tmp:
            trace_dir = profile_dir or tmp
            with jax.profiler.trace(trace_dir):
                for _ in range(2):
                    state, m = compiled(state, batch)
                    m["loss"].block_until_ready()
            summary = gpu_profile.summarize(*gpu_profile.kernel_times(gpu_profile.find_xplane(trace_dir)))
        rec["top_kernels"] = summary["kernels"]
        rec["time_shares"] = summary["shares"]
        rec["profile_source"] = summary["source"]
        rec["profile_total_ms"], rec["profile_n_kernels"] = summary["total_ms"], summary["n_kernels"]
        if profile_dir:
            rec["profile_dir"] = profile_dir
    if cfg.moe.compute_path == "ragged" and cfg.moe.ragged_kernel != "xla":
        del state, compiled
        rec["kernel_check"] = kernel_check(cfg, rows=256 if b * s < 4096 else 4096)
    return rec


# -- memory: does the step fit (issue 27 item 2) --------------------------------------------------

def memory_variants(dry: bool) -> list[dict]:
    """The blocked path (the one a CUDA backend picks) at each throughput shape, as benched and
    with ``compute.remat=save_dots``; ``compute.ce_chunk_tokens`` is left ``auto`` as in the bench
    (resolved for gpu by gpu_fit.memory_fit: 1024 at the full shapes)."""
    out = []
    for shape, sets in _throughput_shapes(dry).items():
        base = {**_COMMON, **sets, "moe.compute_path": "blocked", "compute.attention_kernel": "dot_product"}
        out.append({"name": f"{shape}/blocked", "kind": "memory_fit", "preset": "mixtral-tiny" if shape == "coarse"
                    else "tiny", "sets": base})
        out.append({"name": f"{shape}/blocked+save_dots", "kind": "memory_fit",
                    "preset": "mixtral-tiny" if shape == "coarse" else "tiny",
                    "sets": {**base, "compute.remat": "save_dots"}})
    return out


def _memory_only(args) -> int:
    todo = [v for v in memory_variants(args.dry_run)
            if not args.only or any(v["name"].startswith(o) for o in args.only.split(","))]
    models = gpu_fit.ATTENTION_MODELS if args.attention_model == "both" else (args.attention_model,)
    results = []
    for v in todo:
        for att in models:  # each in its own CPU process unless dry: a compile's host memory is returned
            if args.dry_run:
                rec = gpu_fit.memory_fit(v, att)
            else:
                rec = _run_script([os.path.abspath(__file__), "--memory-variant", json.dumps(v),
                                   "--attention-model", att], timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
                rec = rec if "name" in rec else {"name": v["name"], "kind": "memory_fit", "attention_model": att, **rec}
            results.append(rec)
            print(gpu_fit.memory_line(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"memory_only": True, "dry_run": args.dry_run, "fit_bytes": gpu_fit.FIT_BYTES,
                       "attention_models": list(models), "variants": results}, f, indent=2)
    return 0 if all("peak_bytes" in r for r in results) else 1


# -- torchtitan, the peer ------------------------------------------------------------------------


def _run_script(cmd: list[str], timeout: float, env=None) -> dict:
    """Run a Python script (``cmd``) in a fresh process; its ``RESULT`` line as a dict, or
    ``{"skipped": ...}`` / ``{"error": ...}``."""
    try:
        out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=timeout, check=False,
                             env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout:.0f}s"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return {"error": f"exit {out.returncode}: {tail}"}


def run_titan(v: dict, steps: int, timeout: float) -> dict:
    """One torchtitan variant in its own process (bench/titan_worker.py)."""
    cmd = [os.path.join(ROOT, "bench", "titan_worker.py"), "--shape", json.dumps(v["sets"]), "--steps", str(steps),
           "--attn", v["attn"], "--device", v["device"], *(["--compile"] if v["compile"] else [])]
    rec = _run_script(cmd, timeout)
    return {"name": v["name"], "kind": "torchtitan", **rec}


# -- driver ------------------------------------------------------------------------------------


def _header(dry: bool, xla_profile: str) -> dict:
    """Backend, device, jax version and the measured bf16 matmul peak (FLOP/s) of this process."""
    import jax

    from jaxmoe.train.step import measure_matmul_peak

    peak = measure_matmul_peak(256 if dry else 8192, "bfloat16", 3 if dry else 10)
    return {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "dry_run": dry, "xla_profile": xla_profile, "bf16_matmul_peak_tflops": peak / 1e12,
            "jax": jax.__version__}


@contextlib.contextmanager
def _reference_kernels_if_dry(v: dict):
    """Dry run (CPU): a ``mosaic_gpu`` variant runs with the jnp reference kernels of the same
    contract (``grouped_gemm.REFERENCE``) and without the device check, so its wiring and
    ``kernel_check`` run here too; ``rec["kernels"]`` says so."""
    if v["sets"].get("moe.ragged_kernel") != "mosaic_gpu":
        yield False
        return
    from jaxmoe.model import grouped_gemm as gg

    saved = gg.MOSAIC_GPU, gg.check_mosaic_gpu_device
    gg.MOSAIC_GPU, gg.check_mosaic_gpu_device = gg.REFERENCE, (lambda: None)
    try:
        yield True
    finally:
        gg.MOSAIC_GPU, gg.check_mosaic_gpu_device = saved


def _child(args) -> int:
    if args.measure_peak:
        rec = _header(False, args.xla_profile)
    elif args.memory_variant:
        rec = gpu_fit.memory_fit(json.loads(args.memory_variant), args.attention_model)
    else:
        rec = run_variant(json.loads(args.variant), args.steps, args.peak, args.profile_dir)
    print("RESULT " + json.dumps(rec))
    return 0


def _run_child(child_args: list[str], timeout: float) -> dict:
    """Run this script with ``child_args`` in a fresh process; its ``RESULT`` line as a dict, or
    ``{"skipped": ...}`` / ``{"error": ...}``."""
    return _run_script([os.path.abspath(__file__), *child_args], timeout)


def _in_subprocess(v: dict, steps: int, peak: float, timeout: float, xla_profile: str, profile_dir: str = "") -> dict:
    rec = _run_child(["--variant", json.dumps(v), "--steps", str(steps), "--peak", str(peak),
                      "--xla-profile", xla_profile, *(["--profile-dir", profile_dir] if profile_dir else [])], timeout)
    return rec if "name" in rec else {"name": v["name"], "kind": v["kind"], **rec}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, in-process, seconds")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip variants once this is spent")
    p.add_argument("--steps", type=int, default=0, help="timed steps per variant (default 10; 2 dry)")
    p.add_argument("--only", default="", help="comma-separated name prefixes to run")
    p.add_argument("--xla-profile", default="gpu_overlap", choices=("gpu_overlap", "none"))
    p.add_argument("--profile", default="", metavar="VARIANT",
                   help="run only VARIANT, keep its jax.profiler trace (--profile-dir) and print its top 15 kernels "
                        "and the share of time in matmuls, collectives, attention and other")
    p.add_argument("--profile-dir", default="", help="where --profile writes the trace (default bench/gpu_profile/)")
    p.add_argument("--memory-only", action="store_true",
                   help="no timing: each shape's step lowered for CUDA and its compiled memory (XLA:CPU proxy), "
                        "the five largest allocations, against 48 GiB")
    p.add_argument("--attention-model", default="flash", choices=(*gpu_fit.ATTENTION_MODELS, "both"),
                   help="--memory-only: XLA:CPU's attention: flash (cuDNN's residuals), xla (S x S scores), both")
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--memory-variant", default="", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--peak", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--measure-peak", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.xla_profile = "none"  # GPU flags: XLA:CPU would reject them
    else:  # the driver and every child: flags before any backend exists
        from jaxmoe.parallel.distributed import apply_xla_flags_profile  # no jax import

        added = apply_xla_flags_profile(args.xla_profile)
        if not (args.variant or args.measure_peak):
            print(f"XLA flags profile {args.xla_profile}: {len(added)} flags added", file=sys.stderr)
    if args.variant or args.measure_peak or args.memory_variant:
        return _child(args)
    if args.memory_only:
        return _memory_only(args)
    if args.profile:
        if args.profile not in {v["name"] for v in variants(args.dry_run) if v["kind"] == "throughput"}:
            print(f"error: --profile {args.profile!r} is not a throughput variant; one of: "
                  + ", ".join(v["name"] for v in variants(args.dry_run) if v["kind"] == "throughput"), file=sys.stderr)
            return 2
        args.only = args.profile
        args.profile_dir = os.path.abspath(args.profile_dir or os.path.join(
            ROOT, "bench", "gpu_profile", args.profile.replace("/", "_")))
    t_start = time.perf_counter()
    steps = args.steps or (2 if args.dry_run else 10)
    if args.dry_run:  # CPU: in-process
        header = _header(True, args.xla_profile)
    else:  # never in this process: a JAX GPU client here would hold 75% of the device
        header = _run_child(["--measure-peak", "--xla-profile", args.xla_profile],
                            timeout=max(60.0, min(180.0, args.budget_s / 3)))
        if "bf16_matmul_peak_tflops" not in header:
            print(f"error: the matmul-peak process failed: {header.get('error') or header.get('skipped')}",
                  file=sys.stderr)
            return 1
    peak = header["bf16_matmul_peak_tflops"] * 1e12
    backend = header["backend"]
    print(f"{header['device']} ({backend}), bf16 matmul peak {peak / 1e12:.1f} TFLOP/s, "
          f"XLA profile {args.xla_profile}", flush=True)
    if backend != "gpu" and not args.dry_run:
        print("warning: not a GPU backend; the figures are not GPU figures (use --dry-run on CPU)",
              file=sys.stderr)
    results = []
    todo = [v for v in variants(args.dry_run)
            if not args.only or any(v["name"].startswith(o) for o in args.only.split(","))]
    for v in todo:
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < (1 if args.dry_run else 30):
            rec = {"name": v["name"], "kind": v["kind"], "skipped": "time budget spent"}
        elif v["kind"] == "torchtitan":  # its own process, on CPU (dry run) too
            rec = run_titan(v, steps, timeout=600.0 if args.dry_run else left)
        elif args.dry_run:
            with _reference_kernels_if_dry(v) as stand_in:
                rec = run_variant(v, steps, peak, args.profile_dir)
            if stand_in:
                rec["kernels"] = "jnp reference kernels (dry run), not Mosaic GPU"
        else:
            rec = _in_subprocess(v, steps, peak, timeout=left, xla_profile=args.xla_profile,
                                 profile_dir=args.profile_dir)
        results.append(rec)
        print(_line(rec), flush=True)
    for line in titan_worker.attach_ratios(results):
        print(line, flush=True)
    if args.profile and results and "top_kernels" in results[0]:
        r = results[0]
        print(gpu_profile.profile_table({"source": r["profile_source"], "kernels": r["top_kernels"],
                                         "shares": r["time_shares"], "total_ms": r["profile_total_ms"],
                                         "n_kernels": r["profile_n_kernels"]}))
        print(f"trace: {r['profile_dir']}", flush=True)
    out = {**header, "wall_s": time.perf_counter() - t_start, "variants": results}
    if args.json:  # written whole or not at all: a run killed here leaves the previous file
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.json)
    print(f"done in {out['wall_s']:.0f}s", flush=True)
    return 0 if all("error" not in r for r in results) else 1


def _line(r: dict) -> str:
    if "skipped" in r or "error" in r:
        return f"{r['name']:36s} {'SKIPPED' if 'skipped' in r else 'ERROR'}: {r.get('skipped') or r.get('error')}"
    if r["kind"] == "torchtitan":
        return (f"{r['name']:36s} {r['tokens_per_s']:10.0f} tok/s  peak mem {gpu_fit.gib(r['peak_device_bytes'])}  "
                f"(torch {r['torch']}, {r['attention']} attention, compile {'on' if r['compile'] else 'off'}, "
                f"first step {r['first_step_s']:.0f}s; loss {r['loss_first']:.3f} -> {r['loss_last']:.3f})")
    ma = r.get("memory_analysis_bytes")
    temp = gpu_fit.gib(ma["temp"]) if isinstance(ma, dict) else "n/a"
    kc = r.get("kernel_check")
    check = ""
    if kc:
        worst = max(v for k, v in kc.items() if k not in ("rows", "finite"))
        check = f"; vs ragged_dot: max rel L2 {worst:.2e}{'' if kc['finite'] else ' NON-FINITE'}"
    return (f"{r['name']:36s} {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.3f}  peak mem "
            f"{gpu_fit.gib(r['peak_device_bytes'])}  (XLA temp {temp}; compile {r['compile_s']:.0f}s; "
            f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}{check})")


if __name__ == "__main__":
    sys.exit(main())
