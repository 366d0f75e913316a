"""Where a train step's time goes, jaxmoe beside torchtitan, part by part, on torchtitan's flavor.

    python bench/step_parts.py --titan deepseek_v3/debugmodel [--rounds 2] [--reps 5] [--set KEY=VALUE] [--json]

The shape is ``bench/train_step.py``'s torchtitan peer (``--peer torchtitan``): the flavor as
``jaxmoe config --from-titan`` maps it, batch ``TITAN_B x TITAN_S``, fp32, on CPU. Each part is
timed forward + backward (the gradient of ``sum(out * r)`` for a fixed random ``r``, with respect
to the part's parameters and its input) on one layer's module, alone, in a process of its own per
framework:

* ``attention``: the attention module (MLA or GQA, RoPE included) -- jaxmoe's ``make_attention``
  with the kernel ``auto`` picks, torchtitan's ``layers[i].attention`` (SDPA);
* ``moe block``: router + dispatch + routed experts + shared experts -- jaxmoe's ``MoEBlock`` on the
  path ``auto`` picks, torchtitan's ``layers[i].moe`` (fp32 experts, ``torch._grouped_mm``);
* ``shared experts``: the shared SwiGLU alone (so ``moe block - shared`` is the router, the
  dispatch and the routed experts);
* ``dense mlp``: the first layers' SwiGLU;
* ``head + CE``: final norm, LM head and cross-entropy (jaxmoe's chunked or whole CE as ``auto``
  picks; torchtitan's ``CrossEntropyLoss``) -- gradient with respect to the hidden states and the
  head;
* ``optimizer``: clipping + AdamW over every parameter, given the gradients (jaxmoe: the
  optimizer half of ``make_train_step``; torchtitan: ``clip_grad_norm_`` + its fused AdamW);
* ``whole step``: ``bench/train_step.py``'s step of each side, for the rest
  (embedding, residual adds, layer norms, the loss's bookkeeping): ``whole - sum(parts x count)``.

Per part: milliseconds per call (median of ``--reps``, then of ``--rounds`` rounds, the order of
the two processes alternating), the count per step, the per-step milliseconds, and jaxmoe /
torchtitan time. Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step as ts

PARTS = ("attention", "moe block", "shared experts", "dense mlp", "head + CE", "optimizer", "whole step")


def _median_ms(fn, sync, reps: int) -> float:
    sync(fn())  # compile / warm up
    sync(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def counts(cfg) -> dict:
    m = cfg.model
    return {"attention": m.n_layers, "moe block": m.n_moe_layers,
            "shared experts": m.n_moe_layers if cfg.moe.n_shared_experts else 0,
            "dense mlp": m.first_k_dense, "head + CE": 1, "optimizer": 1, "whole step": 1}


def jax_parts(cfg, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jaxmoe.config.autoconf import resolve_auto
    from jaxmoe.model.attention import make_attention
    from jaxmoe.model.layers import rope_tables
    from jaxmoe.model.mlp import SwiGLU
    from jaxmoe.model.moe import MoEBlock
    from jaxmoe.model.transformer import declared_groups, init_params
    from jaxmoe.train.losses import chunked_cross_entropy, cross_entropy
    from jaxmoe.train.optim import build_optimizer, global_norm

    cfg = resolve_auto(cfg, "cpu")
    m = cfg.model
    b, s, d = cfg.train.batch_size, cfg.train.seq_len, m.d_model
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, s, d)).astype(np.float32))
    r = jnp.asarray(rng.standard_normal((b, s, d)).astype(np.float32))
    cos, sin = rope_tables(m, s)
    sync = jax.block_until_ready

    def module_part(module, call):
        graphdef, state = nnx.split(module)

        def loss(state, x):
            return jnp.sum(call(nnx.merge(graphdef, state), x).astype(jnp.float32) * r)

        g = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return lambda: g(state, x)

    rngs = nnx.Rngs(0)
    out = {}
    attn = make_attention(m, kernel=cfg.compute.attention_kernel, rngs=rngs)
    out["attention"] = _median_ms(module_part(attn, lambda mod, x: mod(x, cos, sin)), sync, reps)
    if m.n_moe_layers:
        block = MoEBlock(cfg, rngs=rngs)
        out["moe block"] = _median_ms(module_part(block, lambda mod, x: mod(x)[0]), sync, reps)
        if cfg.moe.n_shared_experts:
            sh = SwiGLU(d, cfg.moe.n_shared_experts * cfg.moe.expert_ffn_dim, m.init_std, rngs=rngs)
            out["shared experts"] = _median_ms(module_part(sh, lambda mod, x: mod(x)), sync, reps)
    if m.first_k_dense:
        mlp = SwiGLU(d, m.dense_ffn_dim, m.init_std, rngs=rngs)
        out["dense mlp"] = _median_ms(module_part(mlp, lambda mod, x: mod(x)), sync, reps)

    batch = ts.cfg_batch(cfg)
    targets, mask = jnp.asarray(batch["targets"]), jnp.asarray(batch["mask"])
    head = jnp.asarray((rng.standard_normal((d, m.vocab_size)) * m.init_std).astype(np.float32))
    norm_w = jnp.ones((d,), jnp.float32)
    chunk = cfg.compute.ce_chunk_tokens

    def ce(xh, head, norm_w):
        h = xh * jax.lax.rsqrt(jnp.mean(xh * xh, -1, keepdims=True) + m.rms_norm_eps) * norm_w
        if chunk:
            return chunked_cross_entropy(h, head, targets, mask, chunk_tokens=chunk)
        return cross_entropy(jnp.einsum("bsd,dv->bsv", h, head), targets, mask)

    g_ce = jax.jit(jax.grad(lambda *a: ce(*a)[0], argnums=(0, 1, 2)))  # (ce, z) or (loss, ce, z): the first
    out["head + CE"] = _median_ms(lambda: g_ce(x, head, norm_w), sync, reps)

    params, _ = init_params(cfg, 0)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def opt(params, opt_state):  # the optimizer half of jaxmoe.train.step.make_train_step
        gn = global_norm(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        finite = jnp.isfinite(gn) & jax.tree.reduce(jnp.logical_and,
                                                    jax.tree.map(lambda u: jnp.isfinite(u).all(), updates))
        new = optax.apply_updates(params, updates)
        keep = lambda n, o: jax.tree.map(lambda a, c: jnp.where(finite, a, c), n, o)  # noqa: E731
        return keep(new, params), keep(new_opt, opt_state)

    box = {"s": (params, tx.init(params))}
    step = jax.jit(opt, donate_argnums=(0, 1))

    def run_opt():
        box["s"] = step(*box["s"])
        return box["s"]

    out["optimizer"] = _median_ms(run_opt, sync, reps)
    run, wsync = ts.make_jaxmoe(cfg)
    out["whole step"] = _median_ms(run, wsync, reps)
    out["matmul peak GFLOP/s"] = ts.matmul_peak() / 1e9  # XLA's fp32 2048^3 (jaxmoe.train.step)
    return out


def titan_parts(cfg, reps: int) -> dict:
    import torch
    from torchtitan.components.loss import CrossEntropyLoss

    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model

    torch.set_num_threads(os.cpu_count() or 1)
    spec = cfg.model.name.removeprefix("titan:")
    m = cfg.model
    b, s, d = cfg.train.batch_size, cfg.train.seq_len, m.d_model
    torch.manual_seed(0)
    model = build_titan_model(titan_model_config(spec), fp32_experts=True)
    model.init_states(buffer_device=torch.device("cpu"))
    model.train()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(b, s, d, generator=g)
    r = torch.randn(b, s, d, generator=g)

    def module_part(call, module):
        x = x0.clone().requires_grad_(True)

        def run():
            module.zero_grad(set_to_none=True)
            x.grad = None
            (call(x) * r).sum().backward()
            return x.grad

        return run

    layers = list(model.layers.values())
    moe_layer = next((layer for layer in layers if getattr(layer, "moe_enabled", False)), None)
    dense_layer = next((layer for layer in layers if not getattr(layer, "moe_enabled", False)), None)
    out = {}
    la = layers[0].attention
    out["attention"] = _median_ms(module_part(lambda x: la(x, None, None), la), lambda _: None, reps)
    if moe_layer is not None:
        moe = moe_layer.moe
        out["moe block"] = _median_ms(module_part(moe, moe), lambda _: None, reps)
        if getattr(moe, "shared_experts", None) is not None:
            sh = moe.shared_experts
            out["shared experts"] = _median_ms(module_part(sh, sh), lambda _: None, reps)
    if dense_layer is not None:
        ff = dense_layer.feed_forward
        out["dense mlp"] = _median_ms(module_part(ff, ff), lambda _: None, reps)

    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    labels = torch.from_numpy(ts.cfg_batch(cfg)["targets"].astype("int64"))
    n_valid = (labels != -100).sum()
    norm, head = model.norm, model.lm_head
    xh = x0.clone().requires_grad_(True)

    def run_ce():
        norm.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        xh.grad = None
        loss, _ = loss_fn(head(norm(xh)), labels, n_valid)
        loss.backward()
        return xh.grad

    out["head + CE"] = _median_ms(run_ce, lambda _: None, reps)

    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    from torchtitan.distributed import utils as dist_utils

    o = cfg.optim
    optimizers = OptimizersContainer(default_adamw(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                                   weight_decay=o.weight_decay), model_parts=[model])
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 1e-3)

    def run_opt():
        dist_utils.clip_grad_norm_(params, o.grad_clip, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()

    out["optimizer"] = _median_ms(run_opt, lambda _: None, reps)
    optimizers = model = params = None  # free the model before the whole-step build
    run, wsync = ts.make_titan(cfg)
    out["whole step"] = _median_ms(run, wsync, reps)
    out["matmul peak GFLOP/s"] = torch_matmul_peak()
    return out


def torch_matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """torch's fp32 ``n^3`` matmul rate (best of ``reps``), GFLOP/s: the same measure as jaxmoe's
    :func:`jaxmoe.train.step.measure_matmul_peak`."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _worker(kind: str, spec: str, sets, reps: int, conn) -> None:
    try:
        from jaxmoe.train.host_alloc import keep_freed_memory

        keep_freed_memory()  # as bench/train_step.py: every process gets jaxmoe's allocator setting
        cfg = ts.jax_config("titan:" + spec, sets)
        conn.send(("ok", (jax_parts if kind == "jaxmoe" else titan_parts)(cfg, reps)))
    except Exception as e:  # noqa: BLE001 - reported
        conn.send(("error", f"{kind}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))


def _in_process(ctx, kind, spec, sets, reps) -> dict:
    conn, child = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(kind, spec, tuple(sets), reps, child), daemon=True)
    p.start()
    child.close()
    try:
        status, val = conn.recv()
    except EOFError:
        status, val = "error", f"{kind}: worker exited with code {p.join(5) or p.exitcode}"
    p.join(30)
    if status == "error":
        raise RuntimeError(val)
    return val


def profile(spec: str, rounds: int, reps: int, sets=(), log=print) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    cfg = ts.jax_config("titan:" + spec, sets)
    runs = {"jaxmoe": [], "torchtitan": []}
    for i in range(rounds):
        for kind in (("jaxmoe", "torchtitan") if i % 2 == 0 else ("torchtitan", "jaxmoe")):
            runs[kind].append(_in_process(ctx, kind, spec, sets, reps))
            log(f"round {i + 1} {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[kind][-1].items()) + " ms")
    n = counts(cfg)
    table = []
    for part in PARTS:
        row = {"part": part, "count": n[part]}
        for kind, rs in runs.items():
            v = [r[part] for r in rs if part in r]
            row[f"{kind}_ms"] = statistics.median(v) if v else None
        if row["jaxmoe_ms"] is not None and row["torchtitan_ms"] is not None:
            row["ratio"] = row["jaxmoe_ms"] / row["torchtitan_ms"]
        table.append(row)
    whole = {k: next(r for r in table if r["part"] == "whole step")[f"{k}_ms"] for k in runs}
    rest = {"part": "rest (whole - parts)", "count": 1}
    for k in runs:
        parts = sum((r[f"{k}_ms"] or 0) * r["count"] for r in table
                    if r["part"] not in ("whole step", "shared experts"))
        rest[f"{k}_ms"] = whole[k] - parts
    rest["ratio"] = rest["jaxmoe_ms"] / rest["torchtitan_ms"] if rest["torchtitan_ms"] else None
    table.append(rest)
    from jaxmoe.config.autoconf import auto_choices
    from jaxmoe.config.counting import flops_per_token

    fpt = flops_per_token(cfg)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    limit = {}
    for k in runs:
        peak = statistics.median(r["matmul peak GFLOP/s"] for r in runs[k])
        limit[k] = {"matmul_peak_gflops": peak, "ideal_step_ms": fpt * tokens / (peak * 1e9) * 1e3,
                    "step_ms": whole[k], "fraction_of_ideal": fpt * tokens / (peak * 1e9) * 1e3 / whole[k]}
    return {"flavor": spec, "flops_per_token": fpt, "limit": limit,
            "shape": f"{cfg.train.batch_size}x{cfg.train.seq_len}", "rounds": rounds, "reps": reps,
            "jaxmoe_resolved": auto_choices(cfg, "cpu"), "parts": table,
            "load_avg": os.getloadavg(), "handicaps": ts.TITAN_HANDICAPS.format(cores=os.cpu_count())}


def render(res: dict) -> str:
    lines = [f"{res['flavor']} ({res['shape']}, fp32, CPU), jaxmoe resolved {res['jaxmoe_resolved']}",
             f"{'part':22s} {'count':>5s} {'jaxmoe ms':>10s} {'titan ms':>10s} {'jax/step':>9s} "
             f"{'titan/step':>10s} {'ratio':>6s}"]
    for r in res["parts"]:
        j, t, c = r["jaxmoe_ms"], r["torchtitan_ms"], r["count"]
        if j is None and t is None:
            continue
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        per = lambda v: "-" if v is None else f"{v * c:.1f}"  # noqa: E731
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['part']:22s} {c:5d} {f(j):>10s} {f(t):>10s} {per(j):>9s} {per(t):>10s} {ratio:>6s}")
    for k, v in res["limit"].items():
        lines.append(f"{k}: matmul peak {v['matmul_peak_gflops']:.0f} GFLOP/s (fp32 2048^3), "
                     f"{res['flops_per_token'] / 1e6:.1f} MFLOP/token -> ideal step {v['ideal_step_ms']:.0f} ms; "
                     f"measured {v['step_ms']:.0f} ms = {v['fraction_of_ideal']:.2f} of ideal")
    lines.append("(ratio = jaxmoe time / torchtitan time: below 1 is jaxmoe faster; shared experts are "
                 "inside the moe block, not added again)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--titan", required=True, metavar="FAMILY/FLAVOR")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from jaxmoe.config.titan import parse_name
    from jaxmoe.errors import UserError

    try:
        parse_name(args.titan)
        res = profile(args.titan, args.rounds, args.reps, args.set,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    except (UserError, RuntimeError) as e:
        print(f"step_parts.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
