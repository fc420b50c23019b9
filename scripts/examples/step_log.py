"""What the framework examples (train_hf_trainer.py, train_lightning.py) share for demos and benchmarks:
scripts/bench_recovery.py's options and its progress file, written from the framework's callback.

  --kill-rank R --kill-at-step S   rank R SIGKILLs itself after finishing step S, only in the first
                                   attempt (TORCHELASTIC_RESTART_COUNT=0) and never in a replacement
  --step-sleep SECONDS             sleep after every step
  --progress FILE                  every rank appends "<unix time> <rank> <step> <pid> <restart count>"
                                   for every finished step (steps numbered from 1)
"""

import argparse
import os
import signal
import time
from pathlib import Path


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="save every K steps (default 10)")
    parser.add_argument("--progress", type=Path, help="append one line per finished step to this file")
    parser.add_argument("--kill-rank", type=int, help="rank that SIGKILLs itself (with --kill-at-step)")
    parser.add_argument("--kill-at-step", type=int, help="step after which --kill-rank SIGKILLs itself")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every step")


class StepLog:
    """One line per finished step, and the benchmark's fault."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.file = open(args.progress or os.devnull, "a")

    def finished(self, step: int) -> None:
        self.file.write(f"{time.time():.6f} {self.rank} {step} {os.getpid()} {self.restarts}\n")
        self.file.flush()  # the line is out before a kill below, and readable while the job runs
        if (self.rank == self.args.kill_rank and step == self.args.kill_at_step and self.restarts == 0
                and os.environ.get("FTRUN_REPLACEMENT", "0") != "1"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
