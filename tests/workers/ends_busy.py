"""One rank that ends, without job.close(), while the worker library's threads are still busy.

Usage: ends_busy.py store-gone|snapshot EXIT_CODE
  store-gone: say "ready" once set up, wait for a line on stdin (the test has stopped the control store
              meanwhile), run on a moment, exit.
  snapshot:   run 2 steps with FTRUN_SNAPSHOT_EVERY=2 and exit as the last snapshot's copy begins.
The interpreter's teardown takes 0.2 s here, as a big script's does: a thread that comes out of a native
torch call meanwhile aborts the process (SIGABRT) instead of letting it exit with EXIT_CODE.
"""

import sys
import time

import torch

import ftrun.elastic


class SlowTeardown:
    def __del__(self, sleep=time.sleep):
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
if mode == "store-gone":
    print("ready", flush=True)
    sys.stdin.readline()
    time.sleep(0.5)
sys.exit(code)
