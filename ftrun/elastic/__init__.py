"""ftrun.elastic: the worker library that lets healthy ranks survive the loss of others.

Add a few lines to an ordinary DDP script::

    import ftrun.elastic

    job = ftrun.elastic.init()                      # instead of dist.init_process_group(...)
    model = job.ddp(MyModel())                      # instead of DistributedDataParallel(...)
    optimizer = torch.optim.AdamW(model.parameters())
    job.register(model=model, optimizer=optimizer)  # the state a replacement rank receives
    for step in job.steps(total_steps):             # the step number is the data position
        with job.guard():                           # a fault elsewhere is caught here
            loss = model(batch_for(step)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

Under ``ftrun --recovery process`` a failed rank is respawned, every rank joins the
next generation's process group, the highest step a healthy replica fully committed
is chosen, its holder sends the registered state to the ranks that lack it, and the
loop goes on from that step. A loop that is not a ``for`` (a framework's callbacks) makes the same steps
with ``job.start_steps()``, ``job.begin_step()`` and ``job.end_step(error)``, which answers a
:class:`StepOutcome`. With ``ftrun --snapshot-every K`` each rank also snapshots its
registered state into its node's shared memory every K steps, and a job-level restart resumes
from there. Under plain torchrun the same script runs as usual.
"""

from ftrun.contract import WorkerEnv
from ftrun.elastic.ddp import ElasticDDP
from ftrun.elastic.job import ElasticJob, StepGuard
from ftrun.elastic.repair import RepairError
from ftrun.steps import Ending, StepOutcome


def init(backend: str | None = None, **options) -> ElasticJob:
    """Join the job: form this generation's process group and start the heartbeat.

    ``backend``: torch's name (gloo, nccl, hccl); by default nccl with CUDA, hccl with
    torch_npu, else gloo. ``collective_timeout`` (seconds) bounds every group formation.
    ``sharded=True``: every rank holds its own part of the state, so a repair restores each
    rank's own snapshot (``--snapshot-every``) instead of copying a healthy replica's, unless the
    state shows replicas all the same (DTensors ``Replicate`` over a dimension, as HSDP's are; the
    first step's gradients all-reduced over a group): those come first.
    ``snapshot_overlap=False``: copy all of a snapshot before the step commits (for scripts that
    change parameters outside the optimizer's ``step()``).
    """
    return ElasticJob(backend, **options)


__all__ = ["init", "ElasticJob", "ElasticDDP", "StepGuard", "StepOutcome", "Ending", "RepairError", "WorkerEnv"]
