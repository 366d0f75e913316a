#!/usr/bin/env bash
# The Python 3.12 lane, on CPU (issue 43): a venv with the GPU image's jax (0.11.2 by default) and
# tokamax from PyPI, this project installed into it (`pip install -e .`: the core dependencies, no
# torch), then
#   * tests/test_tokamax.py: tokamax.ragged_dot (its xla implementation: what it executes on CPU)
#     against lax.ragged_dot, forward and both gradients, empty and uneven groups; the empty-group
#     gradient guard; the ragged SwiGLU through tokamax against xla; the whole bf16 train step with
#     moe.ragged_kernel=tokamax lowered for CUDA (tokamax's Mosaic GPU custom calls, no dense
#     [G, R, K] operand) and its moe.ragged_kernel=xla counter-example;
#   * tests/test_gpu_lowering.py: the suite's GPU lowering tests, under this jax.
# Its last line is `lane312: N passed` (N summed over the jax versions). Not in .ci/run: it
# creates a venv and installs from PyPI (docs/MEASUREMENTS.md, "Python 3.12 lane", has its time).
#
#   bench/lane312.sh                        # jax 0.11.2, venv in ~/.cache/jaxmoe/lane312-jax0.11.2
#   LANE312_JAX="0.11.2 0.12.1" bench/lane312.sh   # one venv and one run per jax version
#   LANE312_PYTHON=/path/to/python3.12 LANE312_DIR=/tmp/lanes bench/lane312.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
py="${LANE312_PYTHON:-}"
if [[ -z "$py" ]]; then
  for c in /root/.pyenv/versions/3.12*/bin/python3 "$(command -v python3.12 || true)"; do
    [[ -n "$c" && -x "$c" ]] && py="$c" && break
  done
fi
[[ -n "$py" ]] || { echo "lane312: no Python 3.12 found; set LANE312_PYTHON=/path/to/python3.12" >&2; exit 2; }
dir="${LANE312_DIR:-$HOME/.cache/jaxmoe}"
total=0
for jv in ${LANE312_JAX:-0.11.2}; do
  venv="$dir/lane312-jax$jv"
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import jax, tokamax, jaxmoe; assert jax.__version__ == '$jv'" 2>/dev/null; then
    echo "lane312: building $venv ($("$py" --version), jax $jv, tokamax)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    # (pip's notes about index locations that do not exist on this machine are left out)
    "${pip[@]}" "jax==$jv" "jaxlib==$jv" tokamax pytest 2>&1 | { grep -v "^WARNING: Location" || true; }
    "${pip[@]}" -e "$root" 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
  "$venv/bin/python" -c "import sys, jax, tokamax; from importlib.metadata import version; \
print(f'lane312: Python {sys.version.split()[0]}, jax {jax.__version__}, tokamax {version(\"tokamax\")}')"
  log="$(mktemp)"
  set +e
  PYTHONPATH="$root" "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs \
    tests/test_tokamax.py tests/test_gpu_lowering.py 2>&1 | grep -v "absl" | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  n=$(grep -Eo "[0-9]+ passed" "$log" | tail -1 | grep -Eo "[0-9]+" || echo 0)
  rm -f "$log"
  [[ $rc == 0 ]] || { echo "lane312: jax $jv: pytest failed (status $rc)"; exit "$rc"; }
  total=$((total + n))
done
echo "lane312: $total passed"
