"""One small model trained the way large ones are, under ftrun.elastic: LAYOUT picks how (4 ranks).

  ddp      torch's DistributedDataParallel (with a BatchNorm: its buffers travel too)
  fsdp     FSDP2 ``fully_shard`` over a 1-D mesh: every rank holds its own shard (snapshots restore it)
  hsdp     FSDP2 over a 2-D mesh (replicate 2 x shard 2): HSDP
  tp       DTensor tensor parallel (tp 2) x ``job.ddp`` data parallel (dp 2)
  pp       a 2-stage ``torch.distributed.pipelining`` GPipe schedule x ``job.ddp`` data parallel (dp 2),
           the gradients of both microbatches averaged once after the schedule

Faults as in elastic_train.py (FAULT=rank:step:kind, original ranks only; FAULT_REPLACEMENT=rank: that
rank's first replacement dies during the repair, once it has made its groups). SHARDED=1: the script
says init(sharded=True) (fsdp always does). Each step sleeps STEP_SLEEP (default 0.05). Writes
OUT_DIR/pid-start-rank<r>-<pid> at start, appends each committed step to OUT_DIR/commits-rank<r>, and
writes OUT_DIR/rank<r>.json at the end: the final step, the pid, whether it is a replacement, the layout
a repair goes by, and a digest of every local tensor of the model's parameters and buffers and of the
optimizer's state (bit for bit).
"""

import json
import os
import time

import faults
import teardown
import torch
from digests import digest

import ftrun.elastic

DIM = 8


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, DIM))


def batch(step: int, seed: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(1000 * step + seed))


def build(job, layout: str):
    """(the module to train, a function running one step's forward and backward on it)"""
    rank = job.rank
    if layout == "ddp":
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, DIM))
        model = torch.nn.parallel.DistributedDataParallel(inner)
        # the inner module is what is registered, as most scripts do: ftrun finds the DDP around it
        return inner, lambda step: model(batch(step, rank)).pow(2).mean().backward()
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = job.mesh({"shard": 4})
        model = mlp()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, lambda step: model(batch(step, rank)).pow(2).mean().backward()
    if layout == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = job.mesh({"replicate": 2, "shard": 2})
        model = mlp()
        fully_shard(model, mesh=mesh)
        seed = mesh[mesh.mesh_dim_names[0]].get_local_rank()
        return model, lambda step: model(batch(step, seed)).pow(2).mean().backward()
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = job.mesh({"dp": 2, "tp": 2})
        model = parallelize_module(mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        wrapped = job.ddp(model, mesh["dp"])
        seed = mesh["dp"].get_local_rank()  # the TP peers of a DP rank see the same batch
        return model, lambda step: wrapped(batch(step, seed)).pow(2).mean().backward()
    if layout == "pp":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        mesh = job.mesh({"pp": 2, "dp": 2})
        stage_index = mesh["pp"].get_local_rank()
        full = mlp()
        part = torch.nn.Sequential(full[0], full[1]) if stage_index == 0 else torch.nn.Sequential(full[2])
        model = job.ddp(part, mesh["dp"])
        # example inputs and (first stage) outputs: no shape inference at the first step, which a
        # replacement would run alone (8 rows in 2 microbatches)
        shapes = {"input_args": (torch.zeros(4, DIM),), "output_args": (torch.zeros(4, 16),)} if stage_index == 0 \
            else {"input_args": (torch.zeros(4, 16),)}
        stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group(), **shapes)
        loss = lambda out, target: out.pow(2).mean()  # noqa: E731
        schedules = [ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)]
        # the schedule warms its peers up at its first step: after a repair, every rank makes a new one
        # (the replacement's is new anyway), so that they warm up together
        job.after_repair(lambda: schedules.append(ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)))
        seed = mesh["dp"].get_local_rank()

        def run(step):
            data = batch(step, seed)
            with model.no_sync():
                if stage_index == 0:
                    schedules[-1].step(data)
                else:
                    schedules[-1].step(target=torch.zeros_like(data))
            model.sync_gradients()

        return model, run
    raise SystemExit(f"unknown LAYOUT {layout!r}")


def main(build=build) -> None:
    """Train ``build(job, LAYOUT)``'s module (another script's builder: tests/workers/torchtitan_train.py)."""
    layout = os.environ["LAYOUT"]
    steps = int(os.environ.get("STEPS", "12"))
    out_dir = os.environ["OUT_DIR"]
    sleep = float(os.environ.get("STEP_SLEEP", "0.05"))
    job = ftrun.elastic.init(sharded=layout == "fsdp" or os.environ.get("SHARDED") == "1")
    rank = job.rank
    with open(os.path.join(out_dir, f"pid-start-rank{rank}-{os.getpid()}"), "w"):
        pass
    model, forward_backward = build(job, layout)
    if os.environ.get("FTRUN_REPLACEMENT") == "1" and os.environ.get("FAULT_REPLACEMENT") == str(rank):
        if faults.claim(rank, -1, "sigkill"):  # the first replacement only
            faults.trigger("sigkill", -1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job.register(model=model, optimizer=optimizer)
    for step in job.steps(steps):
        with job.guard():
            if os.environ.get("FTRUN_REPLACEMENT") != "1" and faults.due(rank, step) and job.generation == 0:
                faults.trigger(faults.due(rank, step), step)
            optimizer.zero_grad()
            forward_backward(step)
            optimizer.step()
            time.sleep(sleep)
        if job.step == step + 1:  # committed (a step a fault interrupted is run again)
            with open(os.path.join(out_dir, f"commits-rank{rank}"), "a") as f:
                f.write(f"{step}\n")
    torch.distributed.barrier()  # as many scripts end (torch passes the barrier's options by name)
    result = {"step": job.step, "rank": rank, "pid": os.getpid(), "generation": job.generation,
              "replacement": os.environ.get("FTRUN_REPLACEMENT"), "layout": job.layout.describe(),
              "digest": digest(model.state_dict(), optimizer.state_dict())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank} finished step {job.step}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
    teardown.leave()
