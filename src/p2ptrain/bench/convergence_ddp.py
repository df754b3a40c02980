"""The convergence bench's reference system: real torch DDP (gloo), one process per worker.

:func:`run_ddp` starts ``task.workers`` :mod:`p2ptrain.bench.ddp_rank` processes, rank ``i``
on ``hosts[i]`` of a :class:`~p2ptrain.bench.convergence_task.Placement` (its own network
namespace, or loopback), waits for them all, and returns where they left their snapshots
and how long they spent inside their steps. Every child is reaped, also on an error, a
timeout or an interrupt: the caller measures their CPU time with
``resource.getrusage(RUSAGE_CHILDREN)``, which counts only children that were waited for.

Rank 0 serves the rendezvous store at its host's address. Its port must be known before
rank 0 starts (the others are told it on their command line; torch's ``tcp://HOST:0``
would let rank 0 bind any port but tells nobody which): in this namespace a free port is
found by binding port 0 and closing it; a host in a namespace of its own cannot be probed
from here, and there a random port in 20000..59999 is taken (nothing else listens in a lab
namespace).
"""

from __future__ import annotations

import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.bench.children import child_env, log_tail
from p2ptrain.bench.convergence_task import (
    Placement,
    Task,
    WorkerRun,
    rank_directory,
    read_done,
)
from p2ptrain.errors import LocalError

__all__ = ["DdpRun", "run_ddp"]


@dataclass(frozen=True)
class DdpRun(WorkerRun):
    """What a DDP run left."""


def _master_port(placement: Placement, host: str, address: str) -> int:
    if placement.command_prefix(host):  # its own namespace: nothing listens there yet
        return 20000 + secrets.randbelow(40000)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        port: int = probe.getsockname()[1]
    return port


def _wait_all(processes: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> None:
    """Waits for every process; raises :class:`LocalError` at the first that fails or when
    ``timeout_s`` runs out (the caller kills and reaps the rest)."""
    exited: queue.Queue[int] = queue.Queue()

    def watch(rank: int, process: subprocess.Popen[bytes]) -> None:
        process.wait()
        exited.put(rank)

    for rank, process in enumerate(processes):
        threading.Thread(target=watch, args=(rank, process), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    running = set(range(len(processes)))
    while running:
        try:
            rank = exited.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            ranks = ", ".join(str(rank) for rank in sorted(running))
            raise LocalError(
                f"DDP ranks {ranks} did not finish within {timeout_s:g} s; their logs: "
                f"{', '.join(str(logs[rank]) for rank in sorted(running))}. Give the run a "
                f"longer timeout or a smaller task. Rank {min(running)}: "
                f"{log_tail(logs[min(running)])}"
            ) from None
        running.discard(rank)
        code = processes[rank].returncode
        if code != 0:
            raise LocalError(
                f"DDP rank {rank} exited with status {code}; the other ranks were stopped; "
                f"{log_tail(logs[rank])}"
            )


def run_ddp(
    task: Task,
    workdir: Path,
    placement: Placement,
    hosts: Sequence[str],
    *,
    python: str = sys.executable,
    timeout_s: float,
) -> DdpRun:
    """Trains ``task`` with torch DDP, rank ``i`` on ``hosts[i]``; rank ``i`` writes
    ``workdir/rank<i>/`` and logs to ``workdir/rank<i>.log``. Raises :class:`LocalError`
    naming the rank and quoting its log when one fails, or when they run past
    ``timeout_s``."""
    if len(hosts) < task.workers:
        raise LocalError(
            f"DDP needs a host per worker: the task has {task.workers} workers, "
            f"{len(hosts)} hosts were given"
        )
    world = task.workers
    used = [path for path in (workdir.glob("rank*")) if path.exists()]
    if used:
        raise LocalError(
            f"{workdir} already holds a DDP run ({used[0].name}): give run_ddp an empty "
            "directory, so that no old snapshot or done.json passes for this run's"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    address = placement.host_address(hosts[0])
    port = _master_port(placement, hosts[0], address)
    master = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    rank_dirs = [rank_directory(workdir, rank) for rank in range(world)]
    logs = [workdir / f"rank{rank}.log" for rank in range(world)]
    env = child_env()
    processes: list[subprocess.Popen[bytes]] = []
    launched = time.time()
    try:
        for rank in range(world):
            command = [
                *placement.command_prefix(hosts[rank]), python, "-m", "p2ptrain.bench.ddp_rank",
                "--task", task.to_json(), "--rank", str(rank), "--world", str(world),
                "--master", master, "--out", str(workdir), "--timeout", repr(timeout_s),
            ]  # fmt: skip
            with logs[rank].open("wb") as log:
                try:
                    process = subprocess.Popen(
                        command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env,
                    )  # fmt: skip
                except OSError as exc:
                    raise LocalError(
                        f"cannot start DDP rank {rank} on host {hosts[rank]} "
                        f"({' '.join(command[:6])} ...): {exc}"
                    ) from exc
            processes.append(process)
        _wait_all(processes, logs, timeout_s)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for process in processes:
            process.wait()
    ended = time.time()
    inner_seconds = []
    for rank, directory in enumerate(rank_dirs):
        done = read_done(directory)
        if done is None or "inner_seconds" not in done:
            raise LocalError(
                f"DDP rank {rank} exited cleanly but left no done.json with inner_seconds in "
                f"{directory}; {log_tail(logs[rank])}"
            )
        inner_seconds.append(float(done["inner_seconds"]))
    return DdpRun(launched, ended, rank_dirs[0], rank_dirs, logs, inner_seconds)
