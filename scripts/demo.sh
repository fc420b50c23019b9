#!/usr/bin/env bash
# The main demo: sets up .venv, then runs a 2-node x 2-rank CPU/gloo job under ftrun (two agents on
# this machine over loopback), SIGKILLs one rank mid-run and shows ftrun replacing only that rank
# (process-level recovery: the other three keep running, the new rank gets the state from a healthy
# one, no step is redone) and the job reaching its final step. Exits with ftrun's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

work=$(mktemp -d)
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -rf "$work"' EXIT

node() {
    .venv/bin/ftrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint "127.0.0.1:$port" --run-id demo \
        --max-restarts 3 --recovery process \
        scripts/examples/train_ddp_elastic.py --steps 60 --ckpt-dir "$work/ckpt" --ckpt-every 10 \
        --kill-rank 3 --kill-at-step 25 --step-sleep 0.05 2>&1 | sed -u "s/^/[node $1] /"
    return "${PIPESTATUS[0]}"
}

echo "ftrun demo: 2 nodes x 2 ranks, --recovery process; rank 3 is SIGKILLed after step 25"
node b &
node a && status=0 || status=$?
wait || true
exit "$status"
