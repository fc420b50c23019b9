"""One rank that ends, without job.close(), while the worker library's threads are still busy.

Usage: ends_busy.py store-gone|snapshot|teardown EXIT_CODE
  store-gone: say "ready" once set up, wait for a line on stdin (the test has stopped the control store
              meanwhile), run on a moment, exit.
  snapshot:   run 2 steps with FTRUN_SNAPSHOT_EVERY=2 and exit as the last snapshot's copy begins.
  teardown:   say "ready", wait for a line on stdin, exit; the interpreter's teardown SIGKILLs the
              control store's host (the pid in STORE_PID) and waits for the store's connections to break.
The interpreter's teardown takes 0.2 s here, as a big script's does: a thread that comes out of a native
torch call meanwhile aborts the process (SIGABRT) instead of letting it exit with EXIT_CODE.
"""

import os
import signal
import sys
import time

import torch

import ftrun.elastic


class SlowTeardown:
    def __del__(self, sleep=time.sleep, kill=os.kill, store_pid=int(os.environ.get("STORE_PID", "0"))):
        if store_pid:
            kill(store_pid, signal.SIGKILL)
            sleep(0.5)
        sleep(0.2)


teardown = SlowTeardown()
mode, code = sys.argv[1], int(sys.argv[2])
job = ftrun.elastic.init()
# the parameters and Adam's state are copied behind the loop: 3 x 64 MB
model = torch.nn.Linear(4096, 4096, bias=False) if mode == "snapshot" else torch.nn.Linear(4, 4)
optimizer = torch.optim.Adam(model.parameters())
job.register(model=model, optimizer=optimizer)
for step in job.steps(2):
    with job.guard():
        model(torch.ones(1, model.in_features)).sum().backward()
        optimizer.step()
if mode in ("store-gone", "teardown"):
    print("ready", flush=True)
    sys.stdin.readline()
    time.sleep(0.5 if mode == "store-gone" else 0)
sys.exit(code)
