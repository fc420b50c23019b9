#!/usr/bin/env bash
# The CUDA paths of ftrun on a real GPU, once, end to end, in one table: the NVML/nvidia-smi probe,
# CUDA placement, a process-level repair of ranks whose state lives on the GPU, NCCL groups aborted
# and re-formed under DDP and FSDP2, snapshots out of device memory, job.ddp()'s step time against
# torch DDP. Exits non-zero when any check fails. Needs torch with CUDA, one GPU, and ftrun's
# dependencies in the Python that runs it ($PYTHON, default python3); nothing is installed.
#
#   bash scripts/gpu_check.sh [--out DIR] [--parts probe,placement,repair,nccl,snapshot,overhead]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to $PYTHON's torch: nothing to check" >&2
    exit 2
fi
args=("$@")
[[ " $* " == *" --out "* ]] || args+=(--out "${TMPDIR:-/tmp}/ftrun-gpu-check")
exec "$PYTHON" scripts/gpu/check.py "${args[@]}"
