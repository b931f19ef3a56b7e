#!/usr/bin/env bash
# Install the anchor: the real Triton 2.51 server and its Python backend, from the
# nvidia-pytriton 0.7.0 wheel, into its OWN venv (never tritonpy's venv); and NVIDIA's
# perf_analyzer 2.51 as DIR/bin/perf_analyzer (benchmarks/perf_analyzer_bench.py).
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

# perf_analyzer: the binary of the tritonclient 2.51.0 wheel (the anchor venv keeps the newer
# tritonclient that pytriton needs, so the wheel is unpacked, not installed). It needs libb64
# and libcudart 12, which the pytriton wheel bundles under hashed names: links with the names
# it asks for, and a wrapper that puts them on its library path. It runs without a GPU.
PA_DIR="$DIR/perf_analyzer"
if [ ! -x "$PA_DIR/perf_analyzer" ]; then
    mkdir -p "$PA_DIR/lib"
    WHEELS="$(mktemp -d)"
    "$DIR/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --platform manylinux1_x86_64 -d "$WHEELS" "tritonclient==2.51.0"
    "$DIR/bin/python" - "$WHEELS"/tritonclient-2.51.0-*.whl "$PA_DIR/perf_analyzer.part" <<'PY'
import shutil, sys, zipfile
member = "tritonclient-2.51.0.data/data/bin/perf_analyzer"
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open(member) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    rm -rf "$WHEELS"
    chmod +x "$PA_DIR/perf_analyzer.part"
    mv "$PA_DIR/perf_analyzer.part" "$PA_DIR/perf_analyzer"
fi
mkdir -p "$PA_DIR/lib"
for want in libb64.so.0d=libb64-*.so.0d libcudart.so.12=libcudart-*.so.12*; do
    found="$(compgen -G "$SITE/nvidia_pytriton.libs/${want#*=}" | head -n 1 || true)"
    if [ -z "$found" ]; then
        echo "error: perf_analyzer needs ${want%%=*}: no ${want#*=} in $SITE/nvidia_pytriton.libs" >&2
        exit 1
    fi
    ln -sfn "$found" "$PA_DIR/lib/${want%%=*}"
done
cat > "$DIR/bin/perf_analyzer" <<WRAPPER
#!/bin/sh
# perf_analyzer 2.51 with the libraries it needs (written by scripts/install_anchor.sh).
LD_LIBRARY_PATH="$PA_DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$PA_DIR/perf_analyzer" "\$@"
WRAPPER
chmod +x "$DIR/bin/perf_analyzer"

echo "anchor venv:        $DIR"
echo "python:             $PYVER"
echo "tritonserver:       $TS/bin/tritonserver"
echo "backend directory:  $TS/backends"
echo "python stub:        $STUB_DST"
echo "LD_LIBRARY_PATH:    $SITE/nvidia_pytriton.libs"
echo "perf_analyzer:      $DIR/bin/perf_analyzer"
