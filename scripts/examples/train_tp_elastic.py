"""The reference job split across ranks Megatron-style under ftrun.elastic: tensor or pipeline parallel x DP.

The model, the data and the options are train_ddp_elastic.py's; the loop and the per-rank sharded
checkpoint are train_fsdp_elastic.py's. What differs is the layout:

  --layout tp   tensor parallel 2 x data parallel N/2 (``job.mesh({"dp": N/2, "tp": 2})``): the hidden
                layers are split column-wise then row-wise over tp (DTensor ``parallelize_module``), and
                ``job.ddp(model, mesh["dp"])`` averages the gradients over dp. The TP peers of a DP
                rank see the same batch.
  --layout pp   a 2-stage ``torch.distributed.pipelining`` GPipe schedule (2 microbatches) x data
                parallel N/2 (``job.mesh({"pp": 2, "dp": N/2})``): the first stage holds the first two
                hidden layers, the second the rest and the loss. ``job.ddp(stage, mesh["dp"])``
                averages the gradients once after the schedule (``no_sync`` + ``sync_gradients``).
                A pipeline schedule warms its peers up at its first step, so after a repair every
                rank makes a new one (``job.after_repair``).

Either way a lost rank gets its state from its DP peer (same tp coordinate, or same stage) under
``ftrun --recovery process``: nothing is redone but the step in flight.

    ftrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo --max-restarts 3 \\
        --recovery process scripts/examples/train_tp_elastic.py --layout tp \\
        --ckpt-dir /tmp/ckpt --kill-rank 3 --kill-at-step 25

Under torchrun the same file runs as an ordinary TP (or PP) x DP script and resumes from its disk
checkpoint: every rank's own shards, as train_fsdp_elastic.py writes them.
"""

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from train_ddp_elastic import BATCH_SIZE, WIDTH, build_model, make_parser, synthetic_batch
from train_fsdp_elastic import ForwardBackward, train

import ftrun.elastic

MICROBATCHES = 2


def data_parallel_size() -> int:
    world_size = dist.get_world_size()
    if world_size % 2:
        raise SystemExit(f"a 2-way tp or pp layout needs an even number of ranks, not {world_size}")
    return world_size // 2


def build_tp(job) -> tuple[torch.nn.Module, ForwardBackward]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = job.mesh({"dp": data_parallel_size(), "tp": 2})
    # Linear layers 0, 2, 4, 6 are the hidden ones (ReLUs between): column- then row-wise in pairs, so
    # the activations between a pair stay split and one all-reduce ends each pair. The last layer
    # (1024 x 16) is replicated over tp.
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
    model = parallelize_module(build_model(), mesh["tp"], plan)
    wrapped = job.ddp(model, mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()

    def forward_backward(step: int) -> torch.Tensor:
        inputs, labels = synthetic_batch(step, dp_rank)
        loss = torch.nn.functional.cross_entropy(wrapped(inputs), labels)
        loss.backward()  # the gradients are averaged over dp here
        return loss

    return model, forward_backward


def build_pp(job) -> tuple[torch.nn.Module, ForwardBackward]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = job.mesh({"pp": 2, "dp": data_parallel_size()})
    stage_index = mesh["pp"].get_local_rank()
    full = build_model()
    part = full[:4] if stage_index == 0 else full[4:]  # two hidden layers (with their ReLUs), then the rest
    model = job.ddp(part, mesh["dp"])
    # the shapes given, not inferred at the first step, which a replacement would run alone
    microbatch = torch.zeros(BATCH_SIZE // MICROBATCHES, WIDTH)
    shapes = {"input_args": (microbatch,), "output_args": (microbatch,)} if stage_index == 0 \
        else {"input_args": (microbatch,)}
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group(), **shapes)
    loss_fn = torch.nn.functional.cross_entropy
    schedules = [ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)]
    job.after_repair(lambda: schedules.append(ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)))
    dp_rank = mesh["dp"].get_local_rank()

    def forward_backward(step: int) -> torch.Tensor | None:
        inputs, labels = synthetic_batch(step, dp_rank)
        losses: list[torch.Tensor] = []
        with model.no_sync():  # the microbatches' gradients add up locally
            if stage_index == 0:
                schedules[-1].step(inputs)
            else:
                schedules[-1].step(target=labels, losses=losses)
        model.sync_gradients()  # then one average over dp
        return torch.stack(losses).mean() if losses else None

    return part, forward_backward


@record  # on a crash, torchrun and ftrun report this rank's traceback as the root cause
def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--layout", choices=("tp", "pp"), default="tp",
                        help="tensor parallel, or pipeline stages, x data parallel (default tp)")
    args = parser.parse_args()
    job = ftrun.elastic.init("gloo")
    model, forward_backward = (build_tp if args.layout == "tp" else build_pp)(job)
    train(job, args, model, forward_backward)


if __name__ == "__main__":
    main()
