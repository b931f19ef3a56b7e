#!/usr/bin/env bash
# mypy (setup.cfg [mypy]) over the package as it installs: stub/ and shm/ as tritonpy.stub and
# tritonpy.shm. Run on the tree itself, mypy cannot map those two (setup.py's package_dir) and
# reads every `from tritonpy.shm import ...` of the host and the stub as Any, unchecked; so
# this checks a scratch copy with the two linked in place.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp -r tritonpy shm stub setup.cfg "$scratch"/
find "$scratch" -name __pycache__ -prune -exec rm -rf {} +
ln -s ../shm "$scratch/tritonpy/shm"
ln -s ../stub "$scratch/tritonpy/stub"
cd "$scratch"
python -m mypy tritonpy
