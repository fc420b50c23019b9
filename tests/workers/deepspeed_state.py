"""One process (gloo, world size 1): for each ZeRO stage in STAGES (default 1,2,3) a DeepSpeed engine trains,
its state (ftrun's ``EngineState``) goes through a real snapshot file in OUT_DIR and back, and the run from the
snapshot must end bit for bit as the run that went on. Prints one JSON line a stage: the stage, the digests of
the state at the snapshot, after going on and after coming back, and whether a parameter changed meanwhile.
"""

import json
import os
import sys

import torch
from digests import digest


import deepspeed
import deepspeed.ops

from ftrun.elastic.arrays import TorchSnapshotWriter, load_own
from ftrun.elastic.integrations.deepspeed import SHM_OP, EngineState


def train(engine, steps: range) -> None:
    for step in steps:
        for micro in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + micro))
            engine.backward(engine(x).pow(2).mean())
            engine.step()


def state_digest(engine) -> str:
    state = EngineState(engine).state_dict()
    del state["rng"]
    return digest(state)


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # as under ftrun: no compiler run for an op unused here
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in map(int, os.environ.get("STAGES", "1,2,3").split(",")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
                  "zero_optimization": {"stage": stage}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        train(engine, range(2))
        folder = os.path.join(out_dir, f"stage{stage}")
        os.makedirs(folder)
        writer = TorchSnapshotWriter(folder, 0, 1, True, every=1, limit=1 << 30, copies=0)
        writer.write(2, EngineState(engine).state_dict())
        writer.wait()
        at_snapshot = state_digest(engine)
        train(engine, range(2, 5))
        went_on = state_digest(engine)
        EngineState(engine).load_state_dict(load_own(folder, 0, 2))
        back = state_digest(engine)
        train(engine, range(2, 5))
        print(json.dumps({"stage": stage, "at_snapshot": at_snapshot, "back": back, "went_on": went_on,
                          "again": state_digest(engine), "steps": engine.global_steps}), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
