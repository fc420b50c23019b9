"""A worker that prints "rank R tick N step N" every TICK seconds (default 0.2) until OUT_DIR/finish exists, then
exits 0: a job that lasts until the test has done its part, and then ends at once (exit 1 after 300 s).
BURN=rank:seconds,... makes those ranks burn that many CPU seconds (their own, not the wall's) at each tick: a
plain script's rank that uses more CPU than the others, as ftrun sees it from outside."""

import os
import sys
import time

rank = os.environ["RANK"]
finish = os.path.join(os.environ["OUT_DIR"], "finish")
burn = dict(item.split(":") for item in os.environ.get("BURN", "").split(",") if item).get(rank)
deadline = time.monotonic() + 300
tick = 0
while not os.path.exists(finish):
    if time.monotonic() > deadline:
        sys.exit(1)
    print(f"rank {rank} tick {tick} step {tick}", flush=True)
    tick += 1
    if burn:
        until = time.process_time() + float(burn)
        while time.process_time() < until:
            pass
    time.sleep(float(os.environ.get("TICK", "0.2")))
print(f"rank {rank} finished", flush=True)
