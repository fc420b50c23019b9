#!/usr/bin/env bash
# Creates .venv in the repository (once) with ftrun and what its tests need.
# torch is pinned: an unpinned torch pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.ftrun-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
    touch "$stamp"
fi
