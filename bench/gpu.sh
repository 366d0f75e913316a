#!/usr/bin/env bash
# GPU benchmark for one lent GPU (<= 8 minutes): tokens/s, MFU against a measured bf16 matmul peak,
# peak device memory and the top kernels for the coarse/fine shapes at d_model 2048 (ragged and
# blocked paths, cuDNN flash attention, the gpu_overlap XLA flag profile), torchtitan's MoE at the
# same shapes (torch.compile off and on; jaxmoe / torchtitan per shape), then peak memory of a
# europa-shaped slice with/without flash attention, chunked CE and each offload. What each variant
# is: bench/gpu.py's docstring.
#
#   bench/gpu.sh                  # on the GPU machine (e.g. via `device`); writes bench/gpu_results.json
#   bench/gpu.sh --dry-run        # CPU, tiny shapes, seconds (tests/test_bench_gpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
json="bench/gpu_results.json"
dry=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && dry=1 && json="${TMPDIR:-/tmp}/jaxmoe_gpu_dry_run.json"; done
if [[ $dry == 1 ]]; then  # CPU: no budget (a loaded test machine must not skip variants)
  exec python bench/gpu.py --json "$json" --budget-s 1e9 "$@"
fi
# torchtitan (the peer, bench/titan_worker.py) from wheels carried in .whl/ (bench/gpu-requirements.txt)
if ! python -c "import torchtitan" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# 470 s hard stop: the driver's own budget (450 s) skips variants before this is reached
exec timeout 470 python bench/gpu.py --json "$json" "$@"
