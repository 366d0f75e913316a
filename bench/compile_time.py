"""Compile time of the train step against depth: a 61-layer config vs a 2-layer config.

    python bench/compile_time.py [--preset tiny-mla] [--layers 2,61] [--rounds 2] [--json]

Layers are scanned (one layer module per stack, ``jax.lax.scan``), so compile time should not grow
with depth; the target (issue 16 item 4) is ``compile(61) <= 1.3 x compile(2)``. Each measurement
runs in a fresh subprocess (no in-process jit cache) with the persistent compilation cache off,
and times tracing+lowering and XLA compilation of the AOT-compiled train step
(``make_train_step(...).lower(state, batch).compile()``), as ``jaxmoe train`` does: wall time and
the process's CPU time (``time.process_time``, all threads: far less sensitive to other load on a
shared machine than wall time), plus the compiled HLO's size (lines, while loops) as a
deterministic check that depth does not unroll. The layer
counts alternate order between rounds; the figure is the median over rounds (range beside it).
Both configs keep ``first_k_dense`` (one dense layer, as Kimi-K2/DeepSeek-V3) so the dense and
the MoE stacks are both present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
from jaxmoe.config import load_config
from jaxmoe.model.transformer import Model, abstract_params, declared_groups
from jaxmoe.train.optim import build_optimizer
from jaxmoe.train.step import init_state, make_train_step
preset, layers, dense = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(preset, overrides=[f"model.n_layers={layers}", f"model.first_k_dense={dense}"])
params, buffers = abstract_params(cfg)
tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
state = jax.eval_shape(lambda p, b: init_state(cfg, tx, p, b), params, buffers)
b, s = cfg.train.batch_size, cfg.train.seq_len
batch = {"inputs": jax.ShapeDtypeStruct((b, s), jax.numpy.int32),
         "targets": jax.ShapeDtypeStruct((b, s), jax.numpy.int32),
         "mask": jax.ShapeDtypeStruct((b, s), jax.numpy.float32)}
step = make_train_step(Model(cfg), tx)
t1, c1 = time.perf_counter(), time.process_time()
lowered = step.lower(state, batch)
t2, c2 = time.perf_counter(), time.process_time()
compiled = lowered.compile()
t3, c3 = time.perf_counter(), time.process_time()
hlo = compiled.as_text()
print(json.dumps({"lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t1,
                  "lower_cpu_s": c2 - c1, "compile_cpu_s": c3 - c2, "total_cpu_s": c3 - c1,
                  "hlo_lines": hlo.count("\n"), "while_loops": hlo.count(" while(")}))
"""


def measure(preset: str, layers: int, dense: int) -> dict:
    env = dict(os.environ, JAXMOE_COMPILE_CACHE="0", JAX_COMPILATION_CACHE_DIR="", JAX_ENABLE_COMPILATION_CACHE="false")
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", CHILD, preset, str(layers), str(dense)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"compile-time child failed ({preset}, {layers} layers):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(preset: str, layer_counts: list[int], rounds: int, dense: int, log) -> dict:
    times: dict[int, list[dict]] = {n: [] for n in layer_counts}
    for r in range(rounds):
        order = layer_counts if r % 2 == 0 else list(reversed(layer_counts))
        for n in order:
            t = time.perf_counter()
            times[n].append(measure(preset, n, dense))
            m = times[n][-1]
            log(f"round {r + 1}: {n} layers: lower {m['lower_s']:.2f}s, compile {m['compile_s']:.2f}s, "
                f"CPU {m['total_cpu_s']:.2f}s, HLO {m['hlo_lines']} lines (child {time.perf_counter() - t:.1f}s)")
    res = {"preset": preset, "first_k_dense": dense, "rounds": rounds, "layers": {}}
    for n, v in times.items():
        tot = [x["total_s"] for x in v]
        cpu = [x["total_cpu_s"] for x in v]
        res["layers"][str(n)] = {"total_s": statistics.median(tot), "total_s_range": [min(tot), max(tot)],
                                 "total_cpu_s": statistics.median(cpu), "total_cpu_s_range": [min(cpu), max(cpu)],
                                 "lower_s": statistics.median(x["lower_s"] for x in v),
                                 "compile_s": statistics.median(x["compile_s"] for x in v),
                                 "hlo_lines": v[0]["hlo_lines"], "while_loops": v[0]["while_loops"]}
    lo, hi = min(layer_counts), max(layer_counts)
    for key, field in (("ratio", "total_s"), ("cpu_ratio", "total_cpu_s")):
        ratios = [b[field] / a[field] for a, b in zip(times[lo], times[hi])]
        res[key] = statistics.median(ratios)
        res[key + "_range"] = [min(ratios), max(ratios)]
    res["target"] = 1.3
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-mla")
    p.add_argument("--layers", default="2,61", help="comma-separated layer counts (first and last compared)")
    p.add_argument("--first-k-dense", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.layers.split(",")]
    res = run(a.preset, counts, a.rounds, a.first_k_dense, lambda m: print(m, file=sys.stderr, flush=True))
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for n, v in res["layers"].items():
            print(f"{n:>3} layers: {v['total_s']:.2f}s [{v['total_s_range'][0]:.2f}-{v['total_s_range'][1]:.2f}] "
                  f"(lower {v['lower_s']:.2f}s, compile {v['compile_s']:.2f}s)")
        for n, v in res["layers"].items():
            print(f"{n:>3} layers: CPU {v['total_cpu_s']:.2f}s [{v['total_cpu_s_range'][0]:.2f}-"
                  f"{v['total_cpu_s_range'][1]:.2f}], HLO {v['hlo_lines']} lines, {v['while_loops']} while loops")
        print(f"ratio {max(counts)}/{min(counts)} layers: wall {res['ratio']:.2f} "
              f"[{res['ratio_range'][0]:.2f}-{res['ratio_range'][1]:.2f}], CPU {res['cpu_ratio']:.2f} "
              f"[{res['cpu_ratio_range'][0]:.2f}-{res['cpu_ratio_range'][1]:.2f}] (target <= {res['target']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
