"""Does the bench's train step fit one lent GPU (issue 27 item 2), checked on a machine without
one: ``bench/gpu.py --memory-only`` runs :func:`memory_fit` per shape.

XLA cannot compile for CUDA without a GPU (jax 0.10.2 here has no CUDA backend to compile with),
so the figure is a proxy, said so in every record: the step is (1) lowered for CUDA as on a GPU
(:func:`as_on_a_gpu`), to show what the GPU program holds -- cuDNN attention calls, no
``[.., S, S]`` score tensors, no ``chlo.ragged_dot`` -- and (2) compiled by XLA:CPU, whose
``memory_analysis()`` and buffer assignment (the five largest allocations) are reported. The CPU
program computes attention with XLA (its ``[B, KV, G, S, S]`` scores, which cuDNN never
materialises) and fuses less than XLA:GPU, so its peak is an upper estimate of the GPU's.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import gpu_profile

FIT_BYTES = 48 * 2**30  # 60% of an H100's 80 GB (80 GiB), the smaller of the two lent kinds


def _gib(x) -> str:
    return f"{x / 2**30:.2f} GiB" if isinstance(x, (int, float)) else "n/a"


@contextlib.contextmanager
def as_on_a_gpu():
    """While tracing for CUDA on a machine without one: ``jax.default_backend()`` says ``gpu``
    (so the model takes its GPU choices, cuDNN attention among them) and jax's cuDNN checks say
    cuDNN 9.10 on compute capability 9.0 (both lent kinds are Hopper). Lowering only: nothing runs."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fa

    saved = jax.default_backend, fa.check_cudnn_version, fa.check_compute_capability
    jax.default_backend = lambda: "gpu"
    fa.check_cudnn_version, fa.check_compute_capability = (lambda: 91000), (lambda capability: True)
    try:
        yield
    finally:
        jax.default_backend, fa.check_cudnn_version, fa.check_compute_capability = saved


def memory_fit(v: dict) -> dict:
    """The variant's bf16 train step (1) lowered for CUDA as on a GPU (cuDNN attention): its
    StableHLO's cuDNN attention calls, ``[.., S, S]`` score tensors and ``chlo.ragged_dot`` ops;
    (2) compiled by XLA:CPU -- XLA cannot compile for CUDA without a GPU, so the proxy for the
    GPU's compiled memory is XLA:CPU's ``memory_analysis()`` of the same program, with XLA's
    attention in place of cuDNN's (it keeps the ``[B, KV, G, S, S]`` scores cuDNN does not: an
    upper bound on that part) -- and the five largest allocations of its buffer assignment."""
    import math
    import re

    import jax

    from jaxmoe.config import load_config
    from jaxmoe.model.transformer import Model, abstract_params, declared_groups
    from jaxmoe.optim import build_optimizer
    from jaxmoe.step import init_state, make_train_step

    cfg = load_config(v["preset"], overrides=[f"{k}={x}" for k, x in v["sets"].items()])
    s = cfg.train.seq_len
    rec = {"name": v["name"], "kind": "memory_fit", "remat": cfg.train.remat}
    params, buffers = abstract_params(cfg)
    tx = build_optimizer(cfg.train, params, declared_groups(cfg))
    state = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
    b = cfg.train.batch_size
    batch = {"inputs": jax.ShapeDtypeStruct((b, s), "int32"), "targets": jax.ShapeDtypeStruct((b, s), "int32"),
             "mask": jax.ShapeDtypeStruct((b, s), "float32")}
    t = time.perf_counter()
    with as_on_a_gpu():  # one device, as the bench runs it (cuDNN's primitive cannot lower on an abstract mesh)
        text = make_train_step(Model(cfg), tx).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    # attention scores: trailing [S, S] dims and at least B x H x S x S elements, every head's (so
    # that e.g. a [L, D, D] weight stack or [1, B, S, D] activations are not taken for one where D == S)
    floor = b * cfg.model.n_heads * s * s
    scores = sorted({m.group(0) for m in re.finditer(rf"tensor<((?:\d+x)*){s}x{s}x\w+>", text)
                     if math.prod(int(x) for x in m.group(1).split("x") if x) * s * s >= floor})
    rec["cuda_stablehlo"] = {"cudnn_attention_calls": len(re.findall(r"custom_call @__cudnn\$fmha", text)),
                             "score_tensors": scores[:6], "chlo_ragged_dot": text.count("chlo.ragged_dot"),
                             "lower_s": round(time.perf_counter() - t, 1)}
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_dump_to": dump, "xla_dump_hlo_pass_re": "^$"}  # buffer assignment is decided before codegen
        ma = make_train_step(Model(cfg), tx).lower(state, batch).compile(compiler_options=opts).memory_analysis()
        top = gpu_profile.largest_allocations(dump, 5)
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    peak = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    rec.update(proxy="XLA:CPU compile of the same step (XLA attention in place of cuDNN's)",
               compile_s=round(time.perf_counter() - t, 1), memory_analysis_bytes=mem, peak_bytes=peak,
               fits_48GB=peak < FIT_BYTES, top_allocations=top)
    return rec


def memory_line(r: dict) -> str:
    if "peak_bytes" not in r:
        return f"{r['name']:36s} ERROR: {r.get('error')}"
    m, c = r["memory_analysis_bytes"], r["cuda_stablehlo"]
    out = [f"{r['name']:36s} peak {_gib(r['peak_bytes'])} ({r['peak_bytes'] / 1e9:.1f} GB; args {_gib(m['argument'])}, "
           f"temp {_gib(m['temp'])}) {'fits' if r['fits_48GB'] else 'DOES NOT fit'} in 48 GiB [XLA:CPU proxy]; "
           f"CUDA lowering: {c['cudnn_attention_calls']} cuDNN attention calls, "
           f"{len(c['score_tensors'])} [..,S,S] tensor types, {c['chlo_ragged_dot']} ragged_dot"]
    for a in r["top_allocations"]:
        out.append(f"    {_gib(a['bytes']):>10s}  {a['values']:3d} values: {a['shapes'][:110]}")
    return "\n".join(out)


__all__ = ["FIT_BYTES", "as_on_a_gpu", "memory_fit", "memory_line"]
