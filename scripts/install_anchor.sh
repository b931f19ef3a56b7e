#!/usr/bin/env bash
# Install the anchor: the real Triton 2.51 server and its Python backend, from the
# nvidia-pytriton 0.7.0 wheel, into its OWN venv (never tritonpy's venv).
#
# Usage: scripts/install_anchor.sh [DIR]     (default: .anchor/ in the repo root)
# Idempotent: an existing venv is reused, pip skips what is installed, and the stub copy
# is refreshed only when it differs.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO_ROOT/.anchor}"
PYTHON="${ANCHOR_PYTHON:-python3}"

if [ ! -x "$DIR/bin/python" ]; then
    echo "creating venv in $DIR"
    "$PYTHON" -m venv "$DIR"
fi
DIR="$(cd "$DIR" && pwd)"

# Quiet pip; it is a no-op when the versions are already there.
"$DIR/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nvidia-pytriton==0.7.0" numpy

SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PYVER="$("$DIR/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
TS="$SITE/pytriton/tritonserver"
STUB_SRC="$TS/python_backend_stubs/$PYVER/triton_python_backend_stub"
STUB_DST="$TS/backends/python/triton_python_backend_stub"

if [ ! -f "$STUB_SRC" ]; then
    echo "error: no Python backend stub for Python $PYVER in $TS/python_backend_stubs" >&2
    ls "$TS/python_backend_stubs" >&2 || true
    exit 1
fi
# The backend looks for its stub beside libtriton_python.so; the stub must match the
# Python version of the venv whose bin/ goes first on PATH when the server runs.
if ! cmp -s "$STUB_SRC" "$STUB_DST"; then
    cp "$STUB_SRC" "$STUB_DST"
    chmod +x "$STUB_DST"
fi

echo "anchor venv:        $DIR"
echo "python:             $PYVER"
echo "tritonserver:       $TS/bin/tritonserver"
echo "backend directory:  $TS/backends"
echo "python stub:        $STUB_DST"
echo "LD_LIBRARY_PATH:    $SITE/nvidia_pytriton.libs"
