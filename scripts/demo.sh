#!/usr/bin/env bash
# The main demo: sets up .venv, then runs a 2-node x 2-rank CPU/gloo job under ftrun (two agents on
# this machine over loopback), SIGKILLs one rank mid-run and shows ftrun replacing only that rank
# (process-level recovery: the other three keep running, the new rank gets the state from a healthy
# one, no step is redone) and the job reaching its final step. Node 0 hosts the controller and shows
# the live status view on this terminal (plain lines when it is not one); node 1's output goes to a
# log file so that it cannot tear the view. Exits with ftrun's exit code.
#   DEMO_STEPS (60), DEMO_STEP_SLEEP (0.1), DEMO_LOG_DIR (a temporary folder) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

work=$(mktemp -d)
logs=${DEMO_LOG_DIR:-$work/logs}
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# the job's secret: both agents sign their control messages with it (see "Security" in README.md)
(umask 077 && head -c 32 /dev/urandom | base64 > "$work/token")
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -rf "$work"' EXIT

node() {
    .venv/bin/ftrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint "127.0.0.1:$port" --run-id demo \
        --max-restarts 3 --recovery process --log-dir "$logs" --token-file "$work/token" "$@" \
        scripts/examples/train_ddp_elastic.py --steps "${DEMO_STEPS:-60}" --ckpt-dir "$work/ckpt" --ckpt-every 10 \
        --kill-rank 3 --kill-at-step 25 --step-sleep "${DEMO_STEP_SLEEP:-0.1}"
}

echo "ftrun demo: 2 nodes x 2 ranks, --recovery process; rank 3 (on node 1) is SIGKILLed after step 25"
node --node-rank 1 --rdzv-conf is_host=0 --status off > "$work/node1.log" 2>&1 &
node --node-rank 0 --rdzv-conf is_host=1 && status=0 || status=$?
wait || true
echo "node 1's own output was:"
sed 's/^/  [node 1] /' "$work/node1.log"
echo "the event log: $logs/demo/events.jsonl (ftrun report $logs/demo/events.jsonl --html report.html)"
[ -n "${DEMO_LOG_DIR:-}" ] || echo "(kept only with DEMO_LOG_DIR set)"
exit "$status"
