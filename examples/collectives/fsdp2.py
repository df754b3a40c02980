"""Model sharding with FSDP2 (``torch.distributed.fsdp.fully_shard``), on CPU (gloo).

The model and data of ddp.py (a 64-32-10 MLP, a made-up classification task from a fixed
seed), but each rank keeps only its shard of every parameter (a DTensor, split along dim 0):
a layer's whole weights are all-gathered for its forward and backward and freed again, and
the gradients are reduce-scattered, so each rank's optimizer steps only its own shard. The
optimizer is built after sharding, on the sharded parameters. Each rank prints one JSON line
per step, ``{"rank": 0, "step": 3, "loss": 1.9}``, and at the end ``{"rank": 0,
"first_loss": .., "last_loss": .., "local_numel": .., "numel": .., "checksum": ..}``: the
mean loss of its first and last 5 steps, how many parameter elements it holds against the
whole model's, and the sum of the whole (gathered) weights, the same on every rank. Run it
with two ranks on one machine::

    torchrun --standalone --nproc-per-node 2 examples/collectives/fsdp2.py

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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
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


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def batches(loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch; each epoch reshuffled the same way on all ranks."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def sharded_mlp(group: dist.ProcessGroup) -> nn.Sequential:
    """The MLP with each Linear sharded on its own (gathered only while it runs), then the root,
    over a one-dimensional mesh of the group's ranks ("cuda" on GPUs)."""
    mesh = DeviceMesh.from_group(group, "cpu")
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(group: dist.ProcessGroup) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = teacher_task()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    model = sharded_mlp(group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: on the shards
    losses = []
    for step, (x, y) in zip(range(STEPS), batches(loader, sampler), strict=False):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # the gradients are reduce-scattered (averaged) across ranks here
        optimizer.step()
        losses.append(loss.item())
        report(rank=rank, step=step, loss=losses[-1])
    parameters = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert len(parameters) == 4, "every weight and bias is a sharded DTensor"
    report(
        rank=rank,
        first_loss=sum(losses[:AVERAGE_OVER]) / AVERAGE_OVER,
        last_loss=sum(losses[-AVERAGE_OVER:]) / AVERAGE_OVER,
        local_numel=sum(p.to_local().numel() for p in parameters),
        numel=sum(p.numel() for p in parameters),
        checksum=sum(p.full_tensor().double().sum().item() for p in parameters),  # all-gathers
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD  # inside a pod: the group p2ptrain gives your code
        assert group is not None
        train(group)
        # every rank is done with the group (FSDP's last all-gathers included) before
        # either tears it down: gloo aborts a rank whose peer left mid-collective
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
