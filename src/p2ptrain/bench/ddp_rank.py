"""One rank of real synchronous data parallel training (torch DDP over gloo) on the bench task.

``p2ptrain bench convergence`` compares our network and hivemind with what everyone would
otherwise run: :class:`torch.nn.parallel.DistributedDataParallel`, one process per worker,
gradients all-reduced by gloo over TCP at every step. This program is one such rank::

    python -m p2ptrain.bench.ddp_rank --task JSON --rank R --world N --master HOST:PORT --out DIR

It builds the task's workload (one torch thread), joins the process group whose rendezvous
store rank 0 serves at ``HOST:PORT`` (rank 0's own address), wraps the workload's model in
DDP and takes ``task.steps`` steps with the workload's own optimizer (AdamW at the task's
lr: DDP is not tuned down) on :func:`~p2ptrain.bench.convergence_task.worker_batches` for
its rank. A DDP step consumes every rank's minibatch: the global batch is ``N x
batch_size``, the same samples in all as the other systems.

Everything a rank writes goes in ``DIR/rank<R>``: rank 0 a snapshot before training, every
``task.snapshot_steps`` steps and at the end (their ``samples`` count the whole group's:
``step x N x batch_size``); every other rank only its final weights (one snapshot at the
last step, which must equal rank 0's: that is what DDP's all-reduce guarantees); every rank
``done.json`` with ``inner_seconds`` (wall time inside its optimizer steps, all-reduces
included) and ``steps``.

Gloo does not bind where the store is: unless ``GLOO_SOCKET_IFNAME`` names an interface, it
resolves the machine's hostname, which here is 127.0.0.1 also inside a lab namespace, so
the ranks would advertise loopback addresses to each other. A rank therefore asks the kernel
which local address it reaches the master from (a connected UDP socket sends nothing) and
sets ``GLOO_SOCKET_IFNAME`` to the interface holding that address: ``lo`` on loopback, the
host's veth inside a :class:`~p2ptrain.bench.netns_lab.NamespaceLab`. A
``GLOO_SOCKET_IFNAME`` already in the environment is left alone.

Failures (a rank that cannot join, a peer lost during a step) print what went wrong, at
which rank and address, to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from p2ptrain.bench.convergence_task import (
    SnapshotWriter,
    Task,
    build_workload,
    rank_directory,
    worker_batches,
    worker_weights,
)
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import inner_step
from p2ptrain.torch.workload import TorchWorkload

__all__ = ["gloo_interface", "main", "parse_master", "run_rank"]

#: How long a rank waits for the others to join, and for any one collective, by default.
DEFAULT_TIMEOUT_S = 600.0

_SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address


def parse_master(text: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[v6]:PORT`` too), or a :class:`LocalError`."""
    host, colon, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LocalError(f"--master must be HOST:PORT with a port in 1..65535, got {text!r}")
    return host, int(port)


def _ipv4_of(probe: socket.socket, interface: str) -> str | None:
    request = struct.pack("256s", interface.encode()[:15])
    try:
        reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
    except OSError:  # no IPv4 address on it
        return None
    return socket.inet_ntoa(reply[20:24])


def gloo_interface(master_host: str, master_port: int) -> tuple[str, str]:
    """``(interface, address)``: the local IPv4 address this host reaches the master from
    and the interface that holds it (Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, master_port))  # picks a route; sends nothing
            address = str(probe.getsockname()[0])
            for _, interface in socket.if_nameindex():
                if _ipv4_of(probe, interface) == address:
                    return interface, address
    except OSError as exc:
        raise LocalError(
            f"no route from this host to the master {master_host}:{master_port} ({exc}): "
            "pass rank 0's IPv4 address as --master"
        ) from exc
    raise LocalError(
        f"this host reaches the master {master_host}:{master_port} from {address}, but no "
        "interface holds that address as its first IPv4 address: set GLOO_SOCKET_IFNAME to "
        "the interface gloo should use"
    )


def _join(rank: int, world: int, host: str, port: int, timeout_s: float) -> str:
    """Joins the process group; returns where this rank talks from, for messages."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        where = f"interface {os.environ['GLOO_SOCKET_IFNAME']} (from GLOO_SOCKET_IFNAME)"
    else:
        interface, address = gloo_interface(host, port)
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        where = f"{address} on {interface}"
    print(f"DDP rank {rank} of {world}: joining tcp://{host}:{port} from {where}", flush=True)
    url_host = f"[{host}]" if ":" in host else host
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{url_host}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError, OSError) as exc:
        role = "serving" if rank == 0 else "joining"
        raise LocalError(
            f"DDP rank {rank} of {world} ({where}) failed {role} the rendezvous at "
            f"{host}:{port} within {timeout_s:g} s: "
            f"{exc}; check that every rank started, that rank 0's port is free and that "
            f"{host} is reachable from every rank"
        ) from exc
    return where


def run_rank(
    task: Task, *, rank: int, world: int, master: str, out: Path, timeout_s: float
) -> None:
    """Trains rank ``rank`` of ``world`` on ``task`` (see the module docstring)."""
    if world < 1 or not 0 <= rank < world:
        raise LocalError(f"--rank must be in 0..{world - 1} and --world at least 1")
    if world != task.workers:
        raise LocalError(f"--world {world} differs from the task's {task.workers} workers")
    host, port = parse_master(master)
    workload = build_workload(task, threads=1)
    where = _join(rank, world, host, port, timeout_s)
    print(f"DDP rank {rank} of {world}: joined; {task.steps} steps", flush=True)
    try:
        _train(
            workload, task, rank=rank, world=world, directory=rank_directory(out, rank), where=where
        )
    finally:
        dist.destroy_process_group()


def _train(
    workload: TorchWorkload, task: Task, *, rank: int, world: int, directory: Path, where: str
) -> None:
    workload.model.train()
    try:  # DDP broadcasts rank 0's weights to every rank
        model = torch.nn.parallel.DistributedDataParallel(workload.model)
    except RuntimeError as exc:
        raise LocalError(
            f"DDP rank {rank} of {world} ({where}) failed while rank 0's weights were "
            f"broadcast: {exc}; see the other ranks' logs for the one that stopped first"
        ) from exc
    writer = SnapshotWriter(directory)
    group_batch = world * workload.batch_size
    if rank == 0:
        writer.save(0, 0, worker_weights(workload))
    inner_seconds = 0.0
    step = 0
    for step, indices in enumerate(worker_batches(workload, task, rank), start=1):
        batch = workload.collate(indices)
        started = time.perf_counter()
        try:
            inner_step(
                model, workload.optimizer, batch, workload.batch_loss, workload.autocast_dtype
            )
        except RuntimeError as exc:  # gloo: a peer went away or timed out
            raise LocalError(
                f"DDP rank {rank} of {world} ({where}) failed in step {step} of {task.steps}: "
                f"{exc}; see the other ranks' logs for the one that stopped first"
            ) from exc
        inner_seconds += time.perf_counter() - started
        if (rank == 0 and step % task.snapshot_steps == 0) or step == task.steps:
            writer.save(step, step * group_batch, worker_weights(workload))
    writer.finish(inner_seconds=inner_seconds, steps=step, rank=rank)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2ptrain.bench.ddp_rank",
        description="One rank of torch DDP (gloo) on the convergence bench's task.",
    )
    parser.add_argument("--task", required=True, help="the Task as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    parser.add_argument("--master", required=True, help="rank 0's HOST:PORT")
    parser.add_argument("--out", type=Path, required=True, help="writes DIR/rank<R>/")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for peers"
    )
    args = parser.parse_args(argv)
    try:
        run_rank(
            Task.from_json(args.task),
            rank=args.rank,
            world=args.world,
            master=args.master,
            out=args.out,
            timeout_s=args.timeout,
        )
    except LocalError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
