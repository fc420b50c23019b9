"""The NPU check's training script (under ftrun, --device npu): a small MLP whose parameters and Adam state
live on the rank's chip, job.ddp() over the backend ftrun picks (HCCL). KILL_RANK/KILL_STEP: that rank
SIGKILLs itself during that step (generation 0, never a replacement).

Each rank writes OUT_DIR/rank<r>.json at the end: the final step, a digest of the parameters and the
optimizer's state bit for bit, whether it is a replacement, and the TORCH_HCCL_ASYNC_ERROR_HANDLING it ran
with. STEPS (default 30), WIDTH (default 1024), BATCH (default 256).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "workers"))  # the test workers' digest
from digests import digest  # noqa: E402

OUT_DIR = Path(os.environ["OUT_DIR"])
STEPS = int(os.environ.get("STEPS", "30"))
WIDTH = int(os.environ.get("WIDTH", "1024"))
BATCH = int(os.environ.get("BATCH", "256"))


def mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)).to(device)


def batch_for(step: int, rank: int, device: torch.device) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)


def main() -> None:
    import ftrun.elastic

    job = ftrun.elastic.init()
    model = job.ddp(mlp(job.device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    job.register(model=model, optimizer=optimizer)
    kill_rank, kill_step = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_STEP", "-1"))
    replacement = os.environ.get("FTRUN_REPLACEMENT") == "1"
    for step in job.steps(STEPS):
        with job.guard():
            if job.rank == kill_rank and step == kill_step and job.generation == 0 and not replacement:
                (OUT_DIR / f"killed-rank{job.rank}.json").write_text(json.dumps({"step": step}))
                os.kill(os.getpid(), signal.SIGKILL)
            model(batch_for(step, job.rank, job.device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.npu.synchronize()
    (OUT_DIR / f"rank{job.rank}.json").write_text(json.dumps({
        "rank": job.rank, "step": job.step, "replacement": replacement, "generation": job.generation,
        "async_error_handling": os.environ.get("TORCH_HCCL_ASYNC_ERROR_HANDLING"),
        "digest": digest(model.state_dict(), optimizer.state_dict())}))
    job.close()


if __name__ == "__main__":
    main()
