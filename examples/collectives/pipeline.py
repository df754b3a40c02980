"""Pipeline parallel training with ``torch.distributed.pipelining``, on CPU (gloo).

The model and data of ddp.py (a 64-32-10 MLP, a made-up classification task from a fixed
seed), split in two stages, one per rank: rank 0 runs ``Linear(64, 32)`` and ``ReLU``, rank
1 runs ``Linear(32, 10)`` and the loss. Each batch of 32 is cut into 4 microbatches, and the
GPipe schedule (``ScheduleGPipe``) sends their activations forward from stage 0 to stage 1
and their gradients back, so the two stages work on different microbatches at the same
time; each rank then steps the optimizer of its own stage. Both ranks read the same batches
(a seeded shuffle): stage 0 takes the features, the last stage the labels. Only the last
stage sees the loss: it prints one JSON line per step, ``{"rank": 1, "stage": 1, "step": 3,
"loss": 1.9}`` (the mean over the microbatches), and at the end ``{"rank": 1, "stage": 1,
"first_loss": .., "last_loss": ..}``, the mean loss of its first and last 5 steps; stage 0
prints ``{"rank": 0, "stage": 0, "steps": 30}``. Run it with two ranks on one machine::

    torchrun --standalone --nproc-per-node 2 examples/collectives/pipeline.py

Inside a p2ptrain pod or home cluster the process groups are already formed when your code
runs: use the group your code is given where this example uses ``group``, and leave out
``init_process_group`` and ``destroy_process_group``. docs/collectives.md has the rest.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

SEED = 0
DATA_SEED = 1234
STEPS = 30
BATCH = 32
MICROBATCHES = 4
LR = 0.02
AVERAGE_OVER = 5  # steps in first_loss and last_loss


def report(**fields: Any) -> None:
    """One JSON line on stdout, written at once: the ranks share stdout, and print() would
    write the text and its newline apart, letting another rank's line in between."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def teacher_task(samples: int = 2048) -> TensorDataset:
    """A classification task made on the spot, the same on every rank (seeded): 64 random
    features per sample, labelled 0-9 by a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(samples, 64, generator=generator)
    y = (x @ torch.randn(64, 10, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)


def stage_module(stage: int) -> nn.Sequential:
    """This rank's part of the MLP. Every rank builds the whole (tiny) model from the same seed
    and keeps its part; a large model would build only its own layers (or on the meta device)."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return nn.Sequential(model[0], model[1]) if stage == 0 else nn.Sequential(model[2])


def batches(loader: DataLoader[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch; the seeded shuffle is the same on both ranks."""
    while True:
        yield from loader


def train(group: dist.ProcessGroup) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    assert world == 2, "this example splits the model in two stages: run it with 2 ranks"
    shuffle = torch.Generator().manual_seed(SEED)
    data = teacher_task()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=shuffle, drop_last=True)
    module = stage_module(rank)
    cpu = torch.device("cpu")
    stage = PipelineStage(module, stage_index=rank, num_stages=world, device=cpu, group=group)
    schedule = ScheduleGPipe(
        stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.cross_entropy
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    last_stage = rank == world - 1
    losses = []
    for step, (x, y) in zip(range(STEPS), batches(loader), strict=False):
        optimizer.zero_grad()
        if last_stage:
            microbatch_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=microbatch_losses)
            losses.append(torch.stack(microbatch_losses).mean().item())
            report(rank=rank, stage=rank, step=step, loss=losses[-1])
        else:
            schedule.step(x)
        optimizer.step()
    if last_stage:
        report(
            rank=rank,
            stage=rank,
            first_loss=sum(losses[:AVERAGE_OVER]) / AVERAGE_OVER,
            last_loss=sum(losses[-AVERAGE_OVER:]) / AVERAGE_OVER,
        )
    else:
        report(rank=rank, stage=rank, steps=STEPS)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD  # inside a pod: the group p2ptrain gives your code
        assert group is not None
        train(group)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # done, the group destroyed: leave without the interpreter's teardown, where a thread
    # of torch's C++ runtime still alive can abort a run that went well (std::terminate,
    # exit status -6 under torchrun)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
