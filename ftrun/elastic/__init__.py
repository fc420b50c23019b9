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
loop goes on from that step. Under plain torchrun the same script runs as usual.
"""

from ftrun.elastic.job import ElasticDDP, ElasticJob, RepairError, StepGuard, WorkerEnv


def init(backend: str | None = None, **options) -> ElasticJob:
    """Join the job: form this generation's process group and start the heartbeat.

    ``backend``: torch's name (gloo, nccl, hccl); by default nccl with CUDA, hccl with
    torch_npu, else gloo. ``collective_timeout`` (seconds) bounds every group formation.
    """
    return ElasticJob(backend, **options)


__all__ = ["init", "ElasticJob", "ElasticDDP", "StepGuard", "RepairError", "WorkerEnv"]
