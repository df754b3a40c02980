"""All-reduce, all-gather and broadcast between the ranks of one process group, on CPU (gloo).

Every rank computes what each collective must give from its rank and the world size alone,
asserts it, and prints one JSON line per check, e.g. ``{"rank": 1, "check": "all_reduce",
"result": [3.0, 3.0, 3.0]}``. Run it with two ranks on one machine::

    torchrun --standalone --nproc-per-node 2 examples/collectives/collectives.py

Inside a p2ptrain pod or home cluster the process groups are already formed when your code
runs: make the same calls on the group your code is given (``group=``), and leave out
``init_process_group`` and ``destroy_process_group``. docs/collectives.md has the rest.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def report(**fields: Any) -> None:
    """One JSON line on stdout, written at once: the ranks share stdout, and print() would
    write the text and its newline apart, letting another rank's line in between."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def check_all_reduce(group: dist.ProcessGroup) -> None:
    """Rank r contributes r + 1 everywhere: the sum is 1 + 2 + ... + world on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tensor = torch.full((3,), float(rank + 1))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    expected = world * (world + 1) / 2
    assert torch.equal(tensor, torch.full((3,), expected)), tensor
    report(rank=rank, check="all_reduce", result=tensor.tolist())


def check_all_gather(group: dist.ProcessGroup) -> None:
    """Rank r contributes [r, 10 r]: every rank ends with all of them, in rank order."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor([rank, 10 * rank])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    assert [t.tolist() for t in gathered] == [[r, 10 * r] for r in range(world)], gathered
    report(rank=rank, check="all_gather", result=[t.tolist() for t in gathered])


def check_broadcast(group: dist.ProcessGroup) -> None:
    """Rank 0 draws 4 numbers from seed 1234; the others start from zeros and receive them."""
    rank = dist.get_rank(group)
    expected = torch.randn(4, generator=torch.Generator().manual_seed(1234))
    tensor = expected.clone() if rank == 0 else torch.zeros(4)
    dist.broadcast(tensor, group=group, group_src=0)  # group_src: a rank within group
    assert torch.equal(tensor, expected), tensor
    report(rank=rank, check="broadcast", result=tensor.tolist())


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD  # inside a pod: the group p2ptrain gives your code
        assert group is not None
        check_all_reduce(group)
        check_all_gather(group)
        check_broadcast(group)
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
