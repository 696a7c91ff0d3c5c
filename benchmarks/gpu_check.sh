#!/usr/bin/env bash
# GPU check of the Triton kernels (issue 3): correctness on the real GPU, then the benchmark.
#
#   bash benchmarks/gpu_check.sh        # from the repo root, on a machine with an NVIDIA GPU
#
# 1. prints versions; makes `mooncaked` importable without touching an existing CUDA torch
#    (pip install --no-deps -e ., else pip install -e ., else links inside mooncaked/);
# 2. runs tests/test_kernels_*.py compiled on the GPU (MOONCAKED_KERNEL_TEST_DEVICE=cuda:
#    the interpreter's comparisons plus long contexts and native bf16 tl.dot);
# 3. runs the benchmark, printing its tables and writing $OUT/kernels.json;
# 4. prints the compact summary again at the very end (plain text, narrow columns).
# A failing test does not stop the benchmark. Worst case under 6 minutes (each step has a
# timeout: tests 150 s, benchmark 130 s; the run on an H200 takes about a minute).
set -x
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export COLUMNS=200  # anything that still sizes itself to the terminal gets room in a log
status=0

nvidia-smi || true
"$PY" --version
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" || true

# torch with CUDA already there: never reinstall it. Without it, pip may fetch one (when online).
# SKIP_INSTALL=1 skips every pip step (a dry run of this script on a machine without a GPU).
if [ -z "${SKIP_INSTALL:-}" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA torch found; trying pip install torch" >&2
    timeout 240 "$PY" -m pip install -q --retries 1 --timeout 15 torch || true
fi
"$PY" -c "import triton; print('triton', triton.__version__)" || [ -n "${SKIP_INSTALL:-}" ] || {
    timeout 60 "$PY" -m pip install -q --retries 1 --timeout 15 triton || true; }
"$PY" -c "import pytest" 2>/dev/null || [ -n "${SKIP_INSTALL:-}" ] || timeout 60 "$PY" -m pip install -q --retries 1 --timeout 15 pytest || true

# mooncaked itself: the kernels need only torch, triton (and rich for the tables), so an
# offline --no-deps editable install is enough; a plain `pip install -e .` needs the network.
if [ -z "${SKIP_INSTALL:-}" ] && ! "$PY" -c "import mooncaked.kernels" 2>/dev/null; then
    timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || timeout 30 "$PY" -m pip install -q --retries 0 --timeout 10 -e . \
        || true
fi
if ! "$PY" -c "import mooncaked.kernels" 2>/dev/null; then
    # No build backend either: mirror pyproject's package-dir mapping with links inside
    # mooncaked/ (removed again on exit), so imports from the repo root find the subpackages.
    links=()
    for d in kernels cli benchmarks; do
        if [ ! -e "mooncaked/$d" ]; then ln -s "../$d" "mooncaked/$d"; links+=("mooncaked/$d"); fi
    done
    trap 'rm -f "${links[@]}"' EXIT
fi
"$PY" -c "import mooncaked.kernels, torch, triton; print('mooncaked.kernels from', mooncaked.kernels.__file__)" || status=1
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer not installed (optional baseline)"

# 2. correctness on the GPU (the same comparisons as under the interpreter, compiled).
MOONCAKED_KERNEL_TEST_DEVICE=cuda timeout 150 "$PY" -m pytest -q -rfE -p no:cacheprovider --noconftest \
    tests/test_kernels_triton.py tests/test_kernels_reference.py 2>&1 | tee "$OUT/kernel_tests.log"
test_rc=${PIPESTATUS[0]}
echo "kernel tests exit status: $test_rc"
[ "$test_rc" -eq 0 ] || status=1

# 3. the benchmark: tables on stdout, one JSON object in $OUT/kernels.json.
timeout 130 "$PY" -m mooncaked.kernels.bench --budget 80 --json-file "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark exit status: $bench_rc"
[ "$bench_rc" -eq 0 ] || status=1
ls -l "$OUT"

# 4. the compact summary once more, last in the log.
if [ -s "$OUT/kernels.json" ]; then
    "$PY" -c "import json, sys; from mooncaked.kernels.bench import summary_text; print(summary_text(json.load(open(sys.argv[1]))))" "$OUT/kernels.json" || true
fi
echo "gpu_check exit status: $status"
exit $status
