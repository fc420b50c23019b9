#!/usr/bin/env bash
# The Ascend recovery paths of ftrun's torch workers on a real node, once, end to end, in one table: an idle
# chip stopped, checked for a UCE and restarted; an HCCL group of two chips released and re-formed as a repair
# does it (watchdogs paused, then cleared and resumed); a rank SIGKILLed under --recovery process on two chips.
# Exits non-zero when any check fails. Needs torch with torch_npu, two visible NPUs, and ftrun's dependencies in
# the Python that runs it ($PYTHON, default python3); nothing is installed.
#
#   bash scripts/npu_check.sh [--out DIR] [--parts device,hccl,process]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PYTHON" -c 'import sys, torch, torch_npu; sys.exit(0 if torch.npu.is_available() else 1)' 2>/dev/null; then
    echo "npu_check: no NPU visible to $PYTHON's torch_npu: nothing to check" >&2
    exit 2
fi
args=("$@")
[[ " $* " == *" --out "* ]] || args+=(--out "${TMPDIR:-/tmp}/ftrun-npu-check")
exec "$PYTHON" scripts/npu/check.py "${args[@]}"
