"""Benchmark the expert compute paths against a plain matmul of the same FLOPs.

    python bench/experts.py [--json] [--shape small|coarse|fine] [--tokens 2048] [--rounds 5]
                            [--repeats 2] [--block-size B]

Shapes: ``small`` (the default, item 5 of issue 16) is the ``small`` preset's expert layer (D=512,
I=256, E=32, k=4); ``coarse`` (E=8, k=2, I=1024) and ``fine`` (E=64, k=8, I=256) are the expert
layers of ``bench/train_step.py``'s two shapes (D=512). T tokens, random (softmax top-k) routing.
For each path (dense, ragged, blocked) it times forward and
forward+backward (gradients w.r.t. x and all expert weights) and reports *useful* GFLOP/s:

    forward FLOPs  = 2 * T * k * 3 * D * I     (gate, up, down projections of every assignment)
    fwd+bwd FLOPs  = 3 * forward FLOPs

``matmul_gflops`` is a plain ``[T*k, D] @ [D, 3I]`` matmul (the same forward FLOPs) writing into a
donated output buffer (no allocation inside the timing, so the reference is the matmul alone);
``ratio_to_matmul`` = path GFLOP/s (fwd+bwd) / matmul GFLOP/s, ``fwd_ratio_to_matmul`` likewise for
the forward alone.

Two references without any routing are reported beside the paths (``--no-ideal`` skips them):
the same FLOPs on rows already grouped by expert, exactly ``T*k/E`` contiguous rows each, so no
routing, layout, gathers, scatters or masks -- ``ideal_loop``, a loop over experts doing only the
SwiGLU matmuls and their hand-written backward (the gate/up pre-activations saved as the blocked
path saves them), and ``ideal_batched``, the batched ``[E, T*k/E, D]`` einsums under autodiff.
``ideal_ratio_to_matmul`` is the better of their two ``ratio_to_matmul``: what a grouped
computation at this shape reaches with XLA's matmuls when routing costs nothing. A path's
``ratio_to_ideal`` is, per round, the faster ideal's fwd+bwd time over the path's: what its
routing and layout work costs. The dense path runs with capacity_factor 1.0 (its dropless worst case,
capacity = T, is O(T^2 * E) memory); its one-hot einsums are overhead not counted as useful FLOPs.

Side by side: in each of ``--rounds`` rounds every path is timed between two timings of the
matmul (every timing, path or matmul, the best of ``--repeats`` calls after one untimed call);
the mean of those two is that round's reference, and each ratio is the median over rounds of
that round's ratio, with its range. On a shared machine whose speed drifts by 1.5x
within minutes this keeps the reference and the path under the same conditions; GFLOP/s figures
are the best round's. ``--block-size`` defaults to the config default (``MoEConfig.block_size``).
Freed host memory is kept in the process (``jaxmoe/train/host_alloc.py``) unless ``--system-malloc``:
otherwise glibc's mmap/munmap churn makes every figure depend on which path ran before it.
Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmoe.config.schema import MoEConfig
from jaxmoe.model.experts import PATHS, expert_ffn
from jaxmoe.train.host_alloc import keep_freed_memory


def best_of(fn, args, repeats: int) -> float:
    # One untimed call first: the call right after another path's (a 6 s ragged backward, say)
    # measured up to 1.5x slower on the development VM, whatever the allocator settings.
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


# (d_model, expert_ffn_dim, n_experts, top_k)
SHAPES = {"small": (512, 256, 32, 4), "coarse": (512, 1024, 8, 2), "fine": (512, 256, 64, 8)}


def expert_inputs(shape: str, t: int):
    """``x [T, D]``, the expert weights, and random softmax top-k routing ``(topk_idx, topk_w)``
    for ``t`` tokens of ``SHAPES[shape]`` (seed 0; shared with bench/expert_shapes.py)."""
    d, i_dim, e, k = SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32)
    weights = {
        "gate_proj": jax.random.normal(keys[1], (e, d, i_dim)) * 0.02,
        "up_proj": jax.random.normal(keys[2], (e, d, i_dim)) * 0.02,
        "down_proj": jax.random.normal(keys[3], (e, i_dim, d)) * 0.02,
    }
    topk_w, topk_idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[4], (t, e)), axis=-1), k)
    return x, weights, topk_idx, topk_w


def ideal_loop_ffn(n_experts: int):
    """``f(x_grouped [E*R, D], wg, wu, wd) -> [E*R, D]``: rows ``e*R .. (e+1)*R`` through expert
    ``e``'s SwiGLU; a ``fori_loop`` of plain matmuls forward and backward (``jax.custom_vjp``),
    nothing else (its gradients equal autodiff of :func:`ideal_batched_ffn`:
    tests/test_bench_experts.py)."""

    def split(a, e, r):
        return jax.lax.dynamic_slice_in_dim(a, e * r, r, 0)

    def fwd_loop(x, wg, wu, wd):
        r, i_dim = x.shape[0] // n_experts, wg.shape[-1]

        def body(e, c):
            y, gu_all = c
            gu = split(x, e, r) @ jnp.concatenate([wg[e], wu[e]], axis=1)
            h = jax.nn.silu(gu[:, :i_dim]) * gu[:, i_dim:]
            return (jax.lax.dynamic_update_slice_in_dim(y, h @ wd[e], e * r, 0),
                    jax.lax.dynamic_update_slice_in_dim(gu_all, gu, e * r, 0))

        init = (jnp.zeros_like(x), jnp.zeros((x.shape[0], 2 * i_dim), x.dtype))
        return jax.lax.fori_loop(0, n_experts, body, init)

    @jax.custom_vjp
    def f(x, wg, wu, wd):
        return fwd_loop(x, wg, wu, wd)[0]

    def f_fwd(x, wg, wu, wd):
        y, gu_all = fwd_loop(x, wg, wu, wd)
        return y, (x, wg, wu, wd, gu_all)

    def f_bwd(res, dy_all):
        x, wg, wu, wd, gu_all = res
        r, i_dim = x.shape[0] // n_experts, wg.shape[-1]

        def body(e, c):
            dx, dwg, dwu, dwd = c
            xs, dy, gu = split(x, e, r), split(dy_all, e, r), split(gu_all, e, r)
            g, u = gu[:, :i_dim], gu[:, i_dim:]
            sg = jax.nn.sigmoid(g)
            h = g * sg * u
            dh = dy @ wd[e].T
            dgu = jnp.concatenate([dh * u * sg * (1 + g * (1 - sg)), dh * g * sg], axis=1)
            dx = jax.lax.dynamic_update_slice_in_dim(
                dx, dgu @ jnp.concatenate([wg[e], wu[e]], axis=1).T, e * r, 0)
            dwgu = xs.T @ dgu
            return dx, dwg.at[e].set(dwgu[:, :i_dim]), dwu.at[e].set(dwgu[:, i_dim:]), dwd.at[e].set(h.T @ dy)

        init = (jnp.zeros_like(x), jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd))
        return jax.lax.fori_loop(0, n_experts, body, init)

    f.defvjp(f_fwd, f_bwd)
    return f


def ideal_batched_ffn(n_experts: int):
    """The same as :func:`ideal_loop_ffn` as batched ``[E, R, D]`` einsums (autodiff backward)."""

    def f(x, wg, wu, wd):
        xs = x.reshape(n_experts, -1, x.shape[-1])
        g = jnp.einsum("erd,edi->eri", xs, wg)
        u = jnp.einsum("erd,edi->eri", xs, wu)
        return jnp.einsum("eri,eid->erd", jax.nn.silu(g) * u, wd).reshape(x.shape)

    return f


def _results(args, host_alloc, fwd_flops, paths, ideals, secs, ref) -> dict:
    """The figures of every path from its timings and the matmul timed beside it."""
    d, i_dim, e, k = SHAPES[args.shape]
    t = args.tokens
    mm = secs["matmul"]
    out = {
        "shapes": {"name": args.shape, "tokens": t, "d_model": d, "expert_ffn_dim": i_dim, "n_experts": e, "top_k": k,
                   "block_size": args.block_size},
        "rounds": args.rounds,
        "host_alloc": host_alloc,
        "matmul_gflops": fwd_flops / min(mm) / 1e9,
        "paths": {},
    }
    for path in paths:
        fb, fw = secs[f"{path}/fwd_bwd"], secs[f"{path}/fwd"]
        r_fb = [3 * m / s for m, s in zip(ref[path], fb)]  # (3 F / s) / (F / m)
        r_fw = [m / s for m, s in zip(ref[path], fw)]
        out["paths"][path] = {
            "gflops": 3 * fwd_flops / min(fb) / 1e9,
            "ratio_to_matmul": statistics.median(r_fb),
            "ratio_to_matmul_range": [min(r_fb), max(r_fb)],
            "fwd_gflops": fwd_flops / min(fw) / 1e9,
            "fwd_ratio_to_matmul": statistics.median(r_fw),
            "fwd_ms": min(fw) * 1e3,
            "fwd_bwd_ms": min(fb) * 1e3,
        }
    if ideals:
        for name in ideals:
            out[name] = out["paths"].pop(name)
        out["ideal_ratio_to_matmul"] = max(out[name]["ratio_to_matmul"] for name in ideals)
        best_ideal = [min(pair) for pair in zip(*(secs[f"{name}/fwd_bwd"] for name in ideals))]
        for path, r in out["paths"].items():  # per round: the faster ideal's time over the path's
            rr = [i / p for i, p in zip(best_ideal, secs[f"{path}/fwd_bwd"])]
            r["ratio_to_ideal"] = statistics.median(rr)
            r["ratio_to_ideal_range"] = [min(rr), max(rr)]
    return out


def _print(out: dict, args, ideals: list) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
        return
    t, d, i_dim, e, k = (out["shapes"][n] for n in ("tokens", "d_model", "expert_ffn_dim", "n_experts", "top_k"))
    host_alloc = out["host_alloc"]
    print(f"backend={jax.default_backend()} shape={args.shape} T={t} D={d} I={i_dim} E={e} k={k} "
          f"block_size={args.block_size} rounds={args.rounds} host_alloc={host_alloc}")
    print(f"plain matmul: {out['matmul_gflops']:8.1f} GFLOP/s (best timing)")
    rows = list(out["paths"].items()) + [(name, out[name]) for name in ideals]
    for path, r in rows:
        lo, hi = r["ratio_to_matmul_range"]
        extra = (f"   ratio_to_ideal {r['ratio_to_ideal']:.3f} [{r['ratio_to_ideal_range'][0]:.3f}-"
                 f"{r['ratio_to_ideal_range'][1]:.3f}]" if "ratio_to_ideal" in r else "")
        print(
            f"{path:13s} fwd+bwd {r['gflops']:8.1f} GFLOP/s  ratio_to_matmul {r['ratio_to_matmul']:.3f}"
            f" [{lo:.3f}-{hi:.3f}]   fwd {r['fwd_gflops']:8.1f} GFLOP/s  ratio {r['fwd_ratio_to_matmul']:.3f}"
            + extra
        )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--repeats", type=int, default=2, help="calls per round (best one counts)")
    ap.add_argument("--paths", default="dense,ragged,blocked")
    ap.add_argument("--block-size", type=int, default=MoEConfig().block_size)
    ap.add_argument("--no-ideal", action="store_true",
                    help="skip the two no-routing references (ideal_loop, ideal_batched)")
    ap.add_argument("--system-malloc", action="store_true",
                    help="leave glibc's malloc as it is (default: keep freed memory; "
                         "see jaxmoe/train/host_alloc.py)")
    args = ap.parse_args(argv)
    host_alloc = "system" if args.system_malloc or not keep_freed_memory() else "kept"
    paths = args.paths.split(",")
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: unknown path {p!r}; choose from {', '.join(PATHS)}")
    if args.rounds < 1 or args.repeats < 1 or args.tokens < 1 or args.block_size < 1:
        ap.error("--rounds, --repeats, --tokens and --block-size must be >= 1")
    d, i_dim, e, k = SHAPES[args.shape]
    t = args.tokens
    if not args.no_ideal and t * k % e:
        ap.error(f"--tokens {t}: the ideal references need tokens*k ({t}*{k}) divisible by the {e} "
                 "experts (or pass --no-ideal)")

    keys = jax.random.split(jax.random.key(0), 5)
    x, weights, topk_idx, topk_w = expert_inputs(args.shape, t)
    fwd_flops = 2.0 * t * k * 3 * d * i_dim

    a = jax.random.normal(keys[0], (t * k, d))
    b = jax.random.normal(keys[1], (d, 3 * i_dim))
    # The reference writes into a donated buffer: it never allocates, so it runs at the speed of
    # the matmul itself. Without that its 25 MB output lands on fresh pages whenever the allocator
    # has just returned memory to the OS, which on this VM costs it up to a third of its time.
    mm = jax.jit(lambda a, b, out: a @ b, donate_argnums=2)
    mm_state = [jnp.zeros((t * k, 3 * i_dim), jnp.float32)]

    def matmul(a, b):
        mm_state[0] = mm(a, b, mm_state[0])
        return mm_state[0]

    timed = {"matmul": (matmul, (a, b))}
    for path in paths:
        cfg = MoEConfig(n_experts=e, top_k=k, expert_ffn_dim=i_dim, compute_path=path,
                        block_size=args.block_size,
                        capacity_factor=1.0 if path == "dense" else 0.0)

        # routing enters as jit arguments (as in the model), not as constants XLA would fold
        def loss(x, w, idx, gw, cfg=cfg):
            y, _ = expert_ffn(x, idx, gw, w, cfg)
            return jnp.sum(y * y)

        run_args = (x, weights, topk_idx, topk_w)
        timed[f"{path}/fwd"] = (
            jax.jit(lambda x, w, idx, gw, cfg=cfg: expert_ffn(x, idx, gw, w, cfg)[0]), run_args
        )
        timed[f"{path}/fwd_bwd"] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), run_args)
    ideals = [] if args.no_ideal else ["ideal_loop", "ideal_batched"]
    for name in ideals:
        ideal = (ideal_loop_ffn if name == "ideal_loop" else ideal_batched_ffn)(e)
        xg = jax.random.normal(keys[0], (t * k, d), jnp.float32)
        w3 = (weights["gate_proj"], weights["up_proj"], weights["down_proj"])
        timed[f"{name}/fwd"] = (jax.jit(ideal), (xg, *w3))
        timed[f"{name}/fwd_bwd"] = (
            jax.jit(jax.value_and_grad(lambda x, *w, f=ideal: jnp.sum(f(x, *w) ** 2), argnums=(0, 1, 2, 3))),
            (xg, *w3))
    paths = [*paths, *ideals]
    for fn, fn_args in timed.values():  # compile + warm up
        jax.block_until_ready(fn(*fn_args))
    secs = {name: [] for name in timed}
    ref = {path: [] for path in paths}  # the matmul timed right beside each path, per round
    for _ in range(args.rounds):
        for path in paths:
            before = best_of(*timed["matmul"], args.repeats)
            for name in (f"{path}/fwd", f"{path}/fwd_bwd"):
                secs[name].append(best_of(*timed[name], args.repeats))
            after = best_of(*timed["matmul"], args.repeats)
            ref[path].append((before + after) / 2)  # the reference at the path's time
            secs["matmul"] += [before, after]

    out = _results(args, host_alloc, fwd_flops, paths, ideals, secs, ref)
    _print(out, args, ideals)
    return out


if __name__ == "__main__":
    main()
