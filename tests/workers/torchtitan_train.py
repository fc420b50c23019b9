"""torchtitan's way of laying a model out, over torch's own meshes and with no job.mesh(): ftrun reads
which ranks hold copies from the registered state and from the first step (4 ranks, 3d 8; LAYOUT picks).

  hsdp      FSDP2 over init_device_mesh (rep 2 x shard 2): HSDP, its replica dimension named nothing
            ftrun knows; the placements (Replicate over rep) show it
  tp-dp     tensor parallelism over mesh["tp"] by parallelize_module, and the gradients averaged by hand
            over mesh["dp"].get_group() (dp 2 x tp 2): the first step's reduction shows dp
  tp-alone  the same mesh and tensor parallelism with no reduction over dp: each dp rank trains on its own
            batches, nothing shows which ranks hold copies, and ftrun says so
  3d        torchtitan's 3-D mesh (dp_replicate 2 x dp_shard 2 x tp 2, 8 ranks): tensor parallelism over
            mesh["tp"], then FSDP2 over mesh["dp_replicate", "dp_shard"] (HSDP); the placements (Replicate
            over dp_replicate) show the copies
  pp-dp     a 2-stage torch.distributed.pipelining GPipe schedule over mesh["pp"], each stage in torch's
            DistributedDataParallel over mesh["dp"] (pp 2 x dp 2): plain parameters, and the first step's
            gradient all-reduce over dp shows the copies

hsdp trains what layouts_train.py's hsdp does and tp-dp what its tp does, bit for bit. The rest (faults,
SHARDED=1 for init(sharded=True), the step loop, the files written) is layouts_train.py's.
"""

from dataclasses import dataclass

import teardown
import torch
import torch.distributed as dist
from layouts_train import DIM, batch, main, mlp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


@dataclass(frozen=True)
class ParallelDims:
    """torchtitan's ParallelDims, cut down: how many ranks each kind of parallelism spans, and what this
    script calls each dimension of its mesh (torchtitan's names are dp_replicate, dp_shard and tp)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    names: tuple[str, str, str] = ("dp_replicate", "dp_shard", "tp")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        dims = [(name, size) for name, size in zip(self.names, (self.dp_replicate, self.dp_shard, self.tp)) if size > 1]
        return init_device_mesh(device_type, tuple(size for _, size in dims),
                                mesh_dim_names=tuple(name for name, _ in dims))

    @property
    def dp_names(self) -> tuple[str, ...]:
        """The data-parallel dimensions FSDP2 spans (HSDP: replicate and shard)."""
        return tuple(name for name, size in zip(self.names[:2], (self.dp_replicate, self.dp_shard)) if size > 1)


def parallelize(model: torch.nn.Module, world_mesh: DeviceMesh, parallel_dims: ParallelDims) -> torch.nn.Module:
    """torchtitan's parallelize step, cut down: tensor parallelism over the tp dimension, then FSDP2 over
    the data-parallel ones where they shard (HSDP where they replicate too)."""
    if parallel_dims.tp > 1:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(model, world_mesh[parallel_dims.names[2]], plan)
    if parallel_dims.dp_shard > 1:
        fully_shard(model, mesh=world_mesh[parallel_dims.dp_names])
    return model


def average_gradients(model: torch.nn.Module, group) -> None:
    """Data parallelism by hand, as DDP averages (each local gradient divided, then summed over ``group``)."""
    size = dist.get_world_size(group)
    for param in model.parameters():
        grad = param.grad.to_local()
        grad.div_(size)
        dist.all_reduce(grad, group=group)


def pipeline(job, world_mesh: DeviceMesh):
    """torchtitan's pipeline_llama, cut down: a stage of the model per mesh["pp"] coordinate, each in torch's
    DistributedDataParallel over mesh["dp"], run by a GPipe schedule of 2 microbatches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_index = world_mesh["pp"].get_local_rank()
    full = mlp()
    part = torch.nn.Sequential(full[0], full[1]) if stage_index == 0 else torch.nn.Sequential(full[2])
    model = torch.nn.parallel.DistributedDataParallel(part, process_group=world_mesh["dp"].get_group())
    # every stage's example input and output (a microbatch: 4 rows), and what of them requires a gradient:
    # no shape inference, whose forward runs outside DDP's no_sync(), so that the first microbatch's
    # backward all-reduces too at the first step of each schedule (every rank's new one after a repair)
    width = (DIM, 16, DIM)
    shapes = {"input_args": (torch.zeros(4, width[stage_index], requires_grad=stage_index > 0),),
              "output_args": (torch.zeros(4, width[stage_index + 1], requires_grad=True),)}
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=world_mesh["pp"].get_group(), **shapes)
    loss = lambda out, target: out.pow(2).mean()  # noqa: E731
    schedules = [ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)]
    # the schedule warms its peers up at its first step: after a repair every rank makes a new one
    job.after_repair(lambda: schedules.append(ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)))
    seed = world_mesh["dp"].get_local_rank()

    def forward_backward(step: int) -> None:
        # the stage runs its microbatches' backward under DDP's no_sync() but the last's, which all-reduces
        data = batch(step, seed)
        if stage_index == 0:
            schedules[-1].step(data)
        else:
            schedules[-1].step(target=torch.zeros_like(data))

    return part, forward_backward  # the stage itself is registered, as with DDP


def build(job, layout: str):
    """(the module to train, a function running one step's forward and backward on it)"""
    if layout == "pp-dp":
        return pipeline(job, init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    if layout == "3d":
        dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    elif layout == "hsdp":
        dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1, names=("rep", "shard", "tp"))
    elif layout in ("tp-dp", "tp-alone"):
        dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=2, names=("dp", "dp_shard", "tp"))
    else:
        raise SystemExit(f"unknown LAYOUT {layout!r}")
    world_mesh = dims.build_mesh("cpu")
    model = parallelize(mlp(), world_mesh, dims)
    data_parallel = world_mesh[dims.names[0]]
    seed = data_parallel.get_local_rank()  # the shards, or TP peers, of a replica see the same batch
    if layout == "3d":  # each data-parallel rank its own batch, its TP peers the same
        seed = seed * dims.dp_shard + world_mesh[dims.names[1]].get_local_rank()

    def forward_backward(step: int) -> None:
        model(batch(step, seed)).pow(2).mean().backward()
        if layout == "tp-dp":
            average_gradients(model, data_parallel.get_group())

    return model, forward_backward


if __name__ == "__main__":
    main(build)
    teardown.leave()
