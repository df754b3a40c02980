"""Data parallel training with DistributedDataParallel (DDP), on CPU (gloo).

Every rank holds the whole model, a 64-32-10 MLP, and learns a made-up classification task
(random features labelled by a random linear teacher, both from a fixed seed: nothing to
download, nothing to install but torch). A DistributedSampler gives each rank its own part
of every epoch, and DDP averages the gradients across ranks during backward, so the replicas
take the same optimizer steps and stay identical. Each rank prints one JSON line per step,
``{"rank": 0, "step": 3, "loss": 1.9}``, and at the end ``{"rank": 0, "first_loss": ..,
"last_loss": .., "checksum": ..}``: the mean loss of its first and last 5 steps, and the sum
of its weights (the same on every rank). Run it with two ranks on one machine::

    torchrun --standalone --nproc-per-node 2 examples/collectives/ddp.py

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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0
DATA_SEED = 1234
STEPS = 30
BATCH = 32  # per rank
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


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def batches(loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch; each epoch reshuffled the same way on all ranks."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train(group: dist.ProcessGroup) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = teacher_task()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(mlp(), process_group=group)  # rank 0's weights everywhere
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step, (x, y) in zip(range(STEPS), batches(loader, sampler), strict=False):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # the gradients are all-reduced (averaged) across ranks here
        optimizer.step()
        losses.append(loss.item())
        report(rank=rank, step=step, loss=losses[-1])
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    report(
        rank=rank,
        first_loss=sum(losses[:AVERAGE_OVER]) / AVERAGE_OVER,
        last_loss=sum(losses[-AVERAGE_OVER:]) / AVERAGE_OVER,
        checksum=checksum,
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD  # inside a pod: the group p2ptrain gives your code
        assert group is not None
        train(group)
        # every rank is done with the group before either tears it down: gloo aborts a
        # rank whose peer left mid-collective
        dist.barrier(group)
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
