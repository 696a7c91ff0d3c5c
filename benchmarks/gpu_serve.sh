#!/usr/bin/env bash
# The engine serving on a GPU against transformers on the same GPU (issue 16).
#
#   bash benchmarks/gpu_serve.sh            # from the repo root, on a machine with an NVIDIA GPU
#   bash benchmarks/gpu_serve.sh --dry-run  # the same code on the CPU, tiny dummy config (tests)
#
# Needs CUDA torch, Triton and transformers; no network. What a bare GPU machine lacks is
# prepared where pip works (docs/gpu/serve.md), into .gpu_pack/ (ignored by git, carried):
#   python -m mooncaked.benchmarks.gpu_pack --wheels   # bundled.gguf (the bundled model cut
#                                                      # to 8 layers) + wheels/ (orjson, gguf)
# 1. prints versions; installs .gpu_pack/wheels into a private --target dir when orjson
#    or gguf are missing; makes `mooncaked` importable (links inside mooncaked/, as
#    gpu_check.sh does);
# 2. runs benchmarks/gpu_serve.py: correctness (logits and greedy tokens against
#    transformers in fp32, the engine with CUDA graphs, one HTTP request), then speed
#    (dummy Llama-3-8B weights, bf16: decode batch 1 and 64, TTFT of 4,096 tokens, ours
#    and transformers generate with a static cache, ratios, HBM roofline shares); writes
#    $OUT/gpu_serve.json (after each part) and $OUT/gpu_serve.log;
# 3. prints the compact summary again as the last lines.
# Worst case under 8 minutes: GPU unit tests 60 s and the Python step 400 s at most, each
# with a timeout (an H200 should need about 3 minutes in all: Triton compiles, an 8B model
# built twice, CUDA graph capture).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export COLUMNS=200
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
status=0

if [ -z "$DRY" ]; then
    nvidia-smi || true
fi
"$PY" --version
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'transformers', transformers.__version__)" || status=1
[ -n "$DRY" ] || "$PY" -c "import triton; print('triton', triton.__version__)" || status=1

# Runtime packages the GPU image lacks, from wheels prepared elsewhere (never the network).
if ! "$PY" -c "import orjson, gguf" 2>/dev/null; then
    if ls .gpu_pack/wheels/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu_serve_site .gpu_pack/wheels/*.whl || status=1
        export PYTHONPATH="/tmp/gpu_serve_site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "orjson or gguf missing and no .gpu_pack/wheels (see docs/gpu/serve.md)" >&2
    fi
fi
# mooncaked imports from the checkout: a temporary directory holding only a link to
# mooncaked/ goes on the path (not the repo root, whose kernels/ would shadow the
# `kernels` package transformers >= 5.25 imports), kernels/cli/benchmarks through links
# inside mooncaked/ (pyproject's package-dir mapping); all removed again on exit.
site_dir="$(mktemp -d)"
ln -s "$PWD/mooncaked" "$site_dir/mooncaked"
export PYTHONPATH="$site_dir${PYTHONPATH:+:$PYTHONPATH}"
links=()
trap 'rm -f "${links[@]}" "$site_dir/mooncaked"; rmdir "$site_dir"' EXIT
if ! "$PY" -c "import mooncaked.benchmarks.gpu_serve" 2>/dev/null; then
    for d in kernels cli benchmarks; do
        if [ ! -e "mooncaked/$d" ]; then ln -s "../$d" "mooncaked/$d"; links+=("mooncaked/$d"); fi
    done
fi
"$PY" -c "import mooncaked.benchmarks.gpu_serve as g; print('mooncaked from', g.__file__)" || status=1

# The GPU unit checks first (CUDA graph replay = eager, staging order); quick, and they
# point at the piece that broke if the run below fails. --noconftest: no Triton interpreter.
if [ -z "$DRY" ]; then
    timeout 60 "$PY" -m pytest -q -rfE -p no:cacheprovider -p no:randomly --noconftest -m gpu \
        tests/test_gpu_path.py 2>&1 | tee "$OUT/gpu_unit_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

timeout 400 "$PY" -m mooncaked.benchmarks.gpu_serve $DRY --json-file "$OUT/gpu_serve.json" 2>&1 \
    | tee "$OUT/gpu_serve.log"
rc=${PIPESTATUS[0]}
echo "gpu_serve.py exit status: $rc"
[ "$rc" -eq 0 ] || status=1
ls -l "$OUT"

# The compact summary once more, last in the log (also after a timeout: the JSON is
# written after each part).
if [ -s "$OUT/gpu_serve.json" ]; then
    "$PY" -c "import json, sys; from mooncaked.benchmarks.gpu_serve import summary_text; print(summary_text(json.load(open(sys.argv[1]))))" "$OUT/gpu_serve.json" || true
fi
echo "gpu_serve exit status: $status"
exit $status
