#!/bin/sh
# Makes Debian's pyverbs (rdma-core's Python binding) importable from a venv.
#
# Why this way: the PyPI sdist of pyverbs does not build with current Cython and,
# built, needs a newer libibverbs than Debian 12 ships; RDMA hosts get pyverbs from
# their distribution's rdma-core anyway. We expose ONLY the `pyverbs` package folder
# to the venv (a .pth entry naming a folder that holds one symlink), never all of
# /usr/lib/python3/dist-packages, so no other Debian module shadows the venv's.
#
# Usage: mooncaked/transfer/install_pyverbs.sh [VENV]   (default: ./.venv)
# Needs root for apt-get when the Debian packages are missing. Idempotent.
set -eu

VENV=${1:-.venv}
PY="$VENV/bin/python"
SRC=/usr/lib/python3/dist-packages/pyverbs

if [ ! -x "$PY" ]; then
    echo "install_pyverbs: no python at $PY" >&2
    exit 2
fi

if [ ! -d "$SRC" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_pyverbs: $SRC missing and no apt-get; install rdma-core's python3-pyverbs" >&2
        exit 2
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        python3-pyverbs libibverbs1 librdmacm1 ibverbs-providers >/dev/null
fi

VENV_ABS=$(cd "$VENV" && pwd)
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIR="$VENV_ABS/debian-pyverbs"
mkdir -p "$DIR"
ln -sfn "$SRC" "$DIR/pyverbs"
echo "$DIR" > "$SITE/debian_pyverbs.pth"

"$PY" -c 'import pyverbs.device, pyverbs.qp, pyverbs.cq, pyverbs.mr, pyverbs.pd; print("install_pyverbs: pyverbs importable from", pyverbs.__path__[0])'
