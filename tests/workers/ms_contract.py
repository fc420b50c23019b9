"""msrun's contract, played without MindSpore: a stand-in for a MindSpore script that does what the real one
does with its launcher's variables, and nothing else.

As the scheduler (MS_ROLE=MS_SCHED) it records its environment and waits, as MindSpore's would, until every
worker of its generation is done (then exits 0); as a worker it records its environment, works for
WORK_SECONDS (default 0.5) and says it is done.
Faults, in the first attempt only (TORCHELASTIC_RESTART_COUNT=0): FAULT=worker:R SIGKILLs rank R (MS_NODE_ID),
FAULT=scheduler the scheduler, once the workers have started.
Writes OUT_DIR/scheduler<restart>.json, OUT_DIR/rank<r>.json (the last generation's), OUT_DIR/done<restart>_<r>.
"""

import json
import os
import signal
import time

DEADLINE = 60


def write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    out, restart = os.environ["OUT_DIR"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    env = {name: value for name, value in os.environ.items() if name.startswith(("MS_", "RANK_", "DEVICE_ID"))}
    record = json.dumps({"pid": os.getpid(), "restart": restart, "env": env})
    fault = os.environ.get("FAULT", "") if restart == "0" else ""
    workers = int(os.environ["MS_WORKER_NUM"])
    deadline = time.monotonic() + DEADLINE
    if os.environ["MS_ROLE"] == "MS_SCHED":
        write(os.path.join(out, f"scheduler{restart}.json"), record)
        done = [os.path.join(out, f"done{restart}_{rank}") for rank in range(workers)]
        started = [os.path.join(out, f"started{restart}_{rank}") for rank in range(workers)]
        while not all(map(os.path.exists, done)) and time.monotonic() < deadline:
            if fault == "scheduler" and all(map(os.path.exists, started)):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
        raise SystemExit(0 if all(map(os.path.exists, done)) else 1)
    rank = os.environ["MS_NODE_ID"]
    write(os.path.join(out, f"rank{rank}.json"), record)
    write(os.path.join(out, f"started{restart}_{rank}"), "")
    if fault == f"worker:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("WORK_SECONDS", "0.5")))
    write(os.path.join(out, f"done{restart}_{rank}"), "")


if __name__ == "__main__":
    main()
