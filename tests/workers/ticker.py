"""A worker that prints "rank R tick N" every TICK seconds (default 0.2) until OUT_DIR/finish exists, then
exits 0: a job that lasts until the test has done its part, and then ends at once (exit 1 after 300 s)."""

import os
import sys
import time

rank = os.environ["RANK"]
finish = os.path.join(os.environ["OUT_DIR"], "finish")
deadline = time.monotonic() + 300
tick = 0
while not os.path.exists(finish):
    if time.monotonic() > deadline:
        sys.exit(1)
    print(f"rank {rank} tick {tick}", flush=True)
    tick += 1
    time.sleep(float(os.environ.get("TICK", "0.2")))
print(f"rank {rank} finished", flush=True)
