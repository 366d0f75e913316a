"""Does the bench's train step fit one lent GPU (issue 27 item 2), checked on a machine without
one: ``bench/gpu.py --memory-only`` runs :func:`memory_fit` per shape.

XLA cannot compile for CUDA without a GPU (jax 0.10.2 here has no CUDA backend to compile with),
so the figure is a proxy, said so in every record: the step is (1) lowered for CUDA as on a GPU
(:func:`as_on_a_gpu`), to show what the GPU program holds -- cuDNN attention calls, no
``[.., S, S]`` score tensors, no ``chlo.ragged_dot`` -- and (2) compiled by XLA:CPU, whose
``memory_analysis()`` and buffer assignment (the five largest allocations, and any
``[.., S, S]`` score buffer) are reported. XLA:CPU cannot call cuDNN: left alone it computes
attention with XLA and keeps its ``[B, KV, G, S, S]`` scores, which cuDNN never materialises
(the ``xla`` attention model below); by default a stand-in with cuDNN's footprint takes its place.

The attention model of the XLA:CPU compile (``attention_model``, ``--attention-model``):

* ``flash`` (default): ``jax.nn.dot_product_attention`` is replaced, for the CPU compile only
  (never in the CUDA lowering), by :func:`flash_memory_stand_in` -- a ``jax.custom_vjp`` with the
  same inputs and output shape/dtype that keeps exactly cuDNN flash attention's residuals (q, k,
  v, out and the fp32 per-row softmax statistics ``[B, H, S]``; with a mask or bias, the additive
  ``[B, 1, S, S]`` bias in the compute dtype that jax hands cuDNN) and whose backward reads all of
  them; nothing of size S x S is computed. Its values are meaningless: it models memory only.
* ``xla``: XLA's own attention (the ``[B, KV, G, S, S]`` scores stacked per layer), the figure
  this module reported before.

Every ``auto`` field is resolved for ``gpu`` (jaxmoe.config.autoconf) before both the lowering and the
compile, so the figure is of the config ``bench/gpu.py`` runs on a GPU (the CPU rules would unroll
the layer scan); the resolved values are in the record (``resolved``).
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import gpu_profile

FIT_BYTES = 48 * 2**30  # 60% of an H100's 80 GB (80 GiB), the smaller of the two lent kinds
ATTENTION_MODELS = ("flash", "xla")


def gib(x) -> str:
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


def flash_memory_stand_in(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
    """``jax.nn.dot_product_attention``'s signature and output (``[B, S, H, d]`` in the query's
    dtype) with cuDNN flash attention's memory footprint, for a compile whose memory is measured:
    the forward saves exactly ``(q, k, v, out, lse)`` -- ``lse`` fp32 ``[B, H, S]``, cuDNN's
    softmax statistics -- plus, given ``mask`` or ``bias``, the additive ``[B, 1, S, S]`` bias in
    the query's dtype (what jax passes cuDNN for a mask); the backward reads every residual and
    returns ``dq, dk, dv`` of q's, k's and v's shapes and dtypes. All work is O(B S H d): no S x S
    tensor is built. The values are NOT attention (memory model only)."""
    import jax
    import jax.numpy as jnp

    if query_seq_lengths is not None or key_value_seq_lengths is not None or local_window_size is not None \
            or return_residual:
        raise NotImplementedError("flash_memory_stand_in models plain (masked/biased, causal) attention only")
    del scale, is_causal, implementation  # shape-neutral: the stand-in models memory, not values
    b, s, h, d = query.shape
    g = h // key.shape[2]
    if mask is not None:  # jax hands cuDNN a mask as an additive bias in the compute dtype
        neg = jnp.asarray(-1e4, query.dtype)  # finite: the stand-in's sums stay finite
        mbias = jnp.where(jnp.broadcast_to(mask, (b, 1, s, s)), jnp.zeros((), query.dtype), neg)
        bias = mbias if bias is None else bias.astype(query.dtype) + mbias
    f32 = jnp.float32

    def rep(x):  # [B, S, KV, d] -> [B, S, H, d], fp32 (each KV head serves G query heads)
        return jnp.repeat(x.astype(f32), g, axis=2)

    def fwd(q, k, v, bias):
        rowmix = 0.0 if bias is None else jnp.mean(bias.astype(f32), axis=(1, 3))[:, :, None, None]  # [B, S, 1, 1]
        out = (q.astype(f32) * jnp.mean(rep(k), axis=1, keepdims=True) + rep(v) + rowmix).astype(q.dtype)
        lse = jnp.transpose(jnp.sum(q.astype(f32) * rep(k), axis=-1), (0, 2, 1))  # [B, H, S] fp32
        return out, (q, k, v, out, lse, bias)

    def bwd(res, dout):
        q, k, v, out, lse, bias = res
        d32 = dout.astype(f32) * jnp.transpose(lse, (0, 2, 1))[..., None]  # [B, S, H, d]
        if bias is not None:
            d32 = d32 + jnp.mean(bias.astype(f32), axis=(1, 3))[:, :, None, None]
        dq = (d32 * rep(k) + out.astype(f32)).astype(q.dtype)

        def per_kv(x):  # [B, S, H, d] fp32 -> [B, S, KV, d]: the G query heads of a KV head summed
            return x.reshape(b, s, h // g, g, x.shape[-1]).sum(axis=3)

        dk = (per_kv(d32 * q.astype(f32)) + v.astype(f32)).astype(k.dtype)
        dv = (per_kv(d32) + k.astype(f32)).astype(v.dtype)
        return dq, dk, dv, (None if bias is None else jnp.zeros_like(bias))

    @jax.custom_vjp
    def attn(q, k, v, bias):
        return fwd(q, k, v, bias)[0]

    attn.defvjp(fwd, bwd)
    return attn(query, key, value, bias)


@contextlib.contextmanager
def attention_model(name: str):
    """While tracing the step for the XLA:CPU compile: ``flash`` puts
    :func:`flash_memory_stand_in` in place of ``jax.nn.dot_product_attention`` (what
    ``compute.attention_kernel=dot_product`` calls); ``xla`` leaves XLA's attention."""
    if name not in ATTENTION_MODELS:
        raise ValueError(f"unknown attention model {name!r}; use one of {', '.join(ATTENTION_MODELS)}")
    if name == "xla":
        yield
        return
    import jax

    saved = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = flash_memory_stand_in
    try:
        yield
    finally:
        jax.nn.dot_product_attention = saved


ATTENTION_NOTE = {"flash": "cuDNN flash attention's residuals (q, k, v, out, fp32 [B,H,S] statistics), no S x S",
                  "xla": "XLA's attention on CPU ([B,KV,G,S,S] fp32 scores kept per layer)"}


def memory_fit(v: dict, attention: str = "flash") -> dict:
    """The variant's bf16 train step, its ``auto`` fields resolved for gpu, (1) lowered for CUDA
    as on a GPU (cuDNN attention): its StableHLO's cuDNN attention calls, ``[.., S, S]`` score
    tensors and ``chlo.ragged_dot`` ops; (2) compiled by XLA:CPU -- XLA cannot compile for CUDA
    without a GPU, so the proxy for the GPU's compiled memory is XLA:CPU's ``memory_analysis()``
    of the same step with attention modelled by ``attention`` (module doc: ``flash``, cuDNN's
    residuals; ``xla``, XLA's scores) -- its five largest allocations and its score buffers."""
    import math
    import re

    import jax

    from jaxmoe.config import load_config
    from jaxmoe.config.autoconf import auto_choices, resolve_auto
    from jaxmoe.model.transformer import Model, abstract_params, declared_groups
    from jaxmoe.train.optim import build_optimizer
    from jaxmoe.train.step import init_state, make_train_step

    cfg = load_config(v["preset"], overrides=[f"{k}={x}" for k, x in v["sets"].items()])
    resolved = auto_choices(cfg, "gpu")  # what a GPU run resolves (the CPU rules would differ)
    cfg = resolve_auto(cfg, "gpu")
    s = cfg.train.seq_len
    rec = {"name": v["name"], "kind": "memory_fit", "remat": cfg.compute.remat, "attention_model": attention,
           "auto_fields": sorted(resolved),
           "resolved": {"moe.compute_path": cfg.moe.compute_path,
                        **{f"compute.{k}": getattr(cfg.compute, k)
                           for k in ("attention_kernel", "scan_unroll", "ce_chunk_tokens", "remat")}}}
    params, buffers = abstract_params(cfg)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
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
        with attention_model(attention):
            lowered = make_train_step(Model(cfg), tx).lower(state, batch)
        ma = lowered.compile(compiler_options=opts).memory_analysis()
        top = gpu_profile.largest_allocations(dump, 5)
        cpu_scores = gpu_profile.square_buffers(dump, s, floor)
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    peak = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    rec.update(proxy=f"XLA:CPU compile of the same step; attention model {attention}: {ATTENTION_NOTE[attention]}",
               compile_s=round(time.perf_counter() - t, 1), memory_analysis_bytes=mem, peak_bytes=peak,
               fits_48GB=peak < FIT_BYTES, top_allocations=top, cpu_score_buffers=cpu_scores)
    return rec


def memory_line(r: dict) -> str:
    if "peak_bytes" not in r:
        return f"{r['name']:36s} ERROR: {r.get('error')}"
    m, c = r["memory_analysis_bytes"], r["cuda_stablehlo"]
    out = [f"{r['name']:36s} peak {gib(r['peak_bytes'])} ({r['peak_bytes'] / 1e9:.1f} GB; args {gib(m['argument'])}, "
           f"temp {gib(m['temp'])}) {'fits' if r['fits_48GB'] else 'DOES NOT fit'} in 48 GiB "
           f"[XLA:CPU proxy, {r.get('attention_model', 'xla')} attention]; "
           f"CUDA lowering: {c['cudnn_attention_calls']} cuDNN attention calls, "
           f"{len(c['score_tensors'])} [..,S,S] tensor types, {c['chlo_ragged_dot']} ragged_dot; "
           f"CPU buffers [..,S,S]: {', '.join(r.get('cpu_score_buffers', [])) or 'none'}"]
    if r.get("resolved"):
        out.append("    resolved for gpu: " + ", ".join(f"{k}={x}" for k, x in sorted(r["resolved"].items())))
    for a in r["top_allocations"]:
        out.append(f"    {gib(a['bytes']):>10s}  {a['values']:3d} values: {a['shapes'][:110]}")
    return "\n".join(out)


__all__ = ["ATTENTION_MODELS", "ATTENTION_NOTE", "FIT_BYTES", "as_on_a_gpu", "attention_model",
           "flash_memory_stand_in", "gib", "memory_fit", "memory_line"]
