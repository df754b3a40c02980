"""One hivemind peer of ``p2ptrain bench convergence``: the bench's task trained with
``hivemind.Optimizer``, as a program the bench runs with the anchors interpreter::

    python -m p2ptrain.bench.hivemind_peer --task JSON --rank R --host ADDR --out DIR \\
        [--initial-peers MULTIADDR ...] [--wait-for-go] [--verbose]

hivemind is the published reference for training over the internet, so the bench runs it
as its authors intend, in its own virtual environment (``make bench-anchors``): it pins its
own dependencies, and the main environment never imports it.

What a peer does:

* starts a ``hivemind.DHT`` listening on ``/ip4/ADDR/tcp/0`` (rank 0 alone; the others with
  rank 0's multiaddr as initial peer). The peer listens on that one address, so the
  multiaddrs it sees itself at are the ones the others dial. NAT traversal is off (no UPnP
  port mapping, no AutoNAT, no relay): in the bench every peer reaches every other directly,
  and their probes would only add bytes on the wire;
* prints ``READY_PREFIX`` and its multiaddrs as JSON on one stdout line, then, with
  ``--wait-for-go``, waits for one line on stdin: the launcher says go when every peer is
  up, so that no peer trains alone while the others still start;
  after its first step, a peer also waits until hivemind's progress tracker has seen every
  peer's progress (otherwise a fast peer ends its first epoch alone);
* trains on its :func:`~p2ptrain.bench.convergence_task.worker_batches` as
  :func:`p2ptrain.torch.batch_loss.inner_step` does (forward, backward, clip the gradient
  norm, step) with the workload's AdamW hyper-parameters, through ``hivemind.Optimizer``
  with ``use_local_updates=True``: each peer steps its own AdamW on its own gradients, and
  every time the swarm has drawn ``target_batch_size`` samples (one window of every peer:
  ``workers x inner_steps x batch_size``) the epoch advances and the peers average their
  parameters. That is hivemind's closest mode to DiLoCo (which would apply the averaged
  change through an outer Nesterov step instead of taking the average itself). The settings
  are :data:`OPTIMIZER_SETTINGS`, explained there;
* stops when its epoch reaches ``task.windows``, or the epoch the launcher wrote to
  ``DIR/stop-epoch`` (a run to target that reached it; the launcher names an epoch no peer
  has reached, so that they all stop at the same average): right after the swarm's last average, the
  task's samples in all (``task.steps`` local steps for a peer that keeps pace; a faster peer
  takes more, a slower one fewer, as hivemind intends). Stopping after a fixed number of
  local steps instead would leave the last peer to finish alone at the last epoch, waiting
  out ``averaging_timeout`` for peers that have gone, and every final model un-averaged;
* rank 0 writes a weights snapshot at genesis and each time its epoch advances (after the
  average: the model at the end of the epoch; its ``samples`` are the swarm's, ``epoch x
  target_batch_size``); every rank writes ``done.json`` (``inner_seconds``: time in its
  steps, averaging included; ``steps``; ``samples``: its own; ``epochs``) and ``epochs.json``
  (for every epoch it reached: the step, the time, and a probe of its weights right after
  the epoch's average, so that the launcher can tell whether the peers really ended the
  epoch with the same weights: :func:`weights_probe`) under ``DIR/rank<R>``;
* shuts the optimizer and the DHT down, so that hivemind's background processes and its
  ``p2pd`` daemon exit.

Nothing here unpickles what a peer sent; hivemind's own messages between peers are protobuf
and msgpack (hivemind 1.1.12 does not use pickle on the wire).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import torch

from p2ptrain.bench.convergence_task import (
    SnapshotWriter,
    Task,
    build_workload,
    rank_directory,
    stop_epoch,
    worker_batches,
    worker_weights,
)
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import inner_step
from p2ptrain.torch.workload import TorchWorkload

__all__ = [
    "EPOCHS_FILE",
    "GO_LINE",
    "OPTIMIZER_SETTINGS",
    "PROBE_SIZE",
    "PROBE_TOLERANCE",
    "READY_PREFIX",
    "RUN_ID",
    "main",
    "weights_probe",
]

#: The start of the stdout line on which a peer says it is up; its multiaddrs follow as JSON.
READY_PREFIX: Final = "hivemind-peer-ready "
#: What the launcher writes to a ``--wait-for-go`` peer's stdin once every peer is up.
GO_LINE: Final = "go"
#: Per rank: the epochs it reached, with a probe of its weights right after each average.
EPOCHS_FILE: Final = "epochs.json"
#: A peer stops after this many times ``task.steps`` local steps even if the swarm has not
#: finished ``task.windows`` epochs by then (a swarm that lost its peers).
MAX_STEPS_FACTOR: Final = 3
#: How long a peer waits, after its first step, to see every other peer's progress.
SWARM_TIMEOUT_S: Final = 60.0
#: How many weights an epoch's probe holds (see :func:`weights_probe`).
PROBE_SIZE: Final = 256
#: Two peers ended an epoch with the same weights when their probes differ by at most this.
PROBE_TOLERANCE: Final = 1e-5
#: The prefix of every DHT key of the run (the swarm is private to one bench run).
RUN_ID: Final = "p2ptrain-convergence"

#: ``hivemind.Optimizer`` settings besides the task's sizes, for a handful of peers on one
#: LAN (hivemind's defaults are tuned for dozens of peers over the internet).
OPTIMIZER_SETTINGS: Final[dict[str, Any]] = {
    # Each peer steps its own AdamW; the swarm averages parameters once per epoch.
    "use_local_updates": True,
    # Average inside the step that ends the epoch, rather than in the background while the
    # next epoch's steps run (hivemind's default applies the average later by the delta
    # rule): the model after the epoch is then the average, as in DiLoCo, and the snapshot
    # taken there is what the swarm agreed on.
    "delay_state_averaging": False,
    # Parameters every epoch (hivemind's default too).
    "average_state_every": 1,
    # Wait up to 5 s for the other peers to join an averaging round: hivemind's docs say
    # 3-5 s for small local runs. The round starts as soon as all peers are in (see
    # target_group_size below), so this only bounds the wait for a late peer (on a loaded
    # machine a peer's processes can be off the CPU for seconds).
    "matchmaking_time": 5.0,
    # A peer that sends no chunk of an all-reduce for this long is excluded from the round
    # (hivemind's default is matchmaking_time). The round then ends with the peers holding
    # different weights, so the bound is generous: a stalled round is still cut short by
    # averaging_timeout, and on an idle LAN no chunk comes anywhere near it.
    "next_chunk_timeout": 10.0,
    # Give up on an all-reduce after 30 s: hivemind suggests about twice what one takes;
    # one of the default 238k-parameter model (1 MB of fp32; with 4 peers each sends and
    # receives 3/4 of it) takes about a second at 10 Mbit/s per link, and a 30 s bound
    # keeps a stuck round from stalling the bench for long.
    "averaging_timeout": 30.0,
    # Compression stays hivemind's default, none: fp32 on the wire.
    "verbose": False,
}

#: ``averager_opts`` besides the group size: a join request gives up after 2 s (hivemind
#: warns when this is not below matchmaking_time; its default is 3 s), so a peer can try
#: twice within one matchmaking period.
REQUEST_TIMEOUT_S: Final = 2.0

#: ``tracker_opts``: how often a peer reads the swarm's progress from the DHT. hivemind's
#: defaults (every 3 s until it has seen a peer, then at least 0.5 s apart) let a peer run a
#: whole epoch of a small model before it learns that the others exist; a few small DHT reads
#: a second cost nothing on a LAN.
TRACKER_OPTS: Final[dict[str, float]] = {
    "min_refresh_period": 0.1,
    "default_refresh_period": 0.2,
}


def weights_probe(weights: dict[str, torch.Tensor], count: int = PROBE_SIZE) -> list[float]:
    """The weights at ``count`` fixed positions, evenly spread over all of them (names in
    sorted order, each tensor flattened). hivemind's all-reduce leaves each peer the average
    up to float32 rounding (a peer adds ``average - own`` to its own weights), so two peers
    that averaged agree here to about 1e-7, while two that did not differ by far more than
    :data:`PROBE_TOLERANCE`."""
    flat = torch.cat(
        [weights[name].detach().to("cpu", torch.float32).reshape(-1) for name in sorted(weights)]
    )
    positions = torch.linspace(0, flat.numel() - 1, min(count, flat.numel())).round().long()
    return [float(value) for value in flat[positions]]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m p2ptrain.bench.hivemind_peer",
        description="One hivemind peer of `p2ptrain bench convergence`.",
    )
    parser.add_argument("--task", required=True, help="the bench task as JSON (Task.to_json)")
    parser.add_argument("--rank", required=True, type=int, help="this peer's rank, 0..workers-1")
    parser.add_argument("--host", required=True, help="the IPv4 address to listen on")
    parser.add_argument("--out", required=True, type=Path, help="where to write rank<R>/")
    parser.add_argument(
        "--initial-peers", nargs="*", default=[], help="multiaddrs of peers already up"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="let hivemind log every epoch and averaging round"
    )
    parser.add_argument(
        "--wait-for-go",
        action="store_true",
        help=f"after saying ready, wait for a {GO_LINE!r} line on stdin before training",
    )
    return parser.parse_args(argv)


def _start_dht(host: str, initial_peers: Sequence[str], where: str) -> Any:
    import hivemind

    try:
        return hivemind.DHT(
            start=True,
            host_maddrs=[f"/ip4/{host}/tcp/0"],
            initial_peers=list(initial_peers) or None,
            auto_nat=False,
            nat_port_map=False,
            use_relay=False,
        )
    except Exception as exc:
        joining = f" joining {', '.join(initial_peers)}" if initial_peers else ""
        raise LocalError(
            f"{where}: its hivemind DHT did not start on {host}{joining}: {exc!r}; check that "
            f"{host} is an address of this host (or of its network namespace) and that the "
            "initial peer is up and reachable from it"
        ) from exc


def _make_optimizer(dht: Any, workload: TorchWorkload, task: Task, *, verbose: bool) -> Any:
    """``hivemind.Optimizer`` over the workload's parameter groups (each group keeps its
    weight decay) with an AdamW of the workload optimizer's hyper-parameters."""
    import hivemind

    groups = workload.optimizer.param_groups
    first = groups[0]
    param_groups = [
        {"params": list(group["params"]), "weight_decay": group["weight_decay"]} for group in groups
    ]

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params,
            lr=first["lr"],
            betas=first["betas"],
            eps=first["eps"],
            weight_decay=first["weight_decay"],
        )

    return hivemind.Optimizer(
        dht=dht,
        run_id=RUN_ID,
        params=param_groups,
        optimizer=adamw,
        batch_size_per_step=workload.batch_size,
        target_batch_size=task.workers * task.inner_steps * workload.batch_size,
        averager_opts={"target_group_size": task.workers, "request_timeout": REQUEST_TIMEOUT_S},
        tracker_opts=dict(TRACKER_OPTS),
        **{**OPTIMIZER_SETTINGS, "verbose": verbose},
    )


def _announce(dht: Any) -> list[str]:
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
    print(READY_PREFIX + json.dumps(maddrs), flush=True)
    return maddrs


def _wait_for_go(where: str) -> None:
    line = sys.stdin.readline()
    if line.strip() != GO_LINE:
        raise LocalError(
            f"{where}: expected {GO_LINE!r} on stdin, got {line.strip()[:80]!r}"
            + (" (stdin closed: the launcher is gone)" if not line else "")
            + "; run it from `p2ptrain bench convergence`, or without --wait-for-go"
        )


def _await_swarm(optimizer: Any, workers: int, where: str) -> None:
    """Until this peer's progress tracker has read the progress of all ``workers`` peers
    from the DHT: each of its reads sets ``fetched_global_progress_this_epoch``."""
    tracker = optimizer.tracker
    deadline = time.monotonic() + SWARM_TIMEOUT_S
    fetched = tracker.fetched_global_progress_this_epoch
    while (seen := tracker.global_progress.num_peers) < workers:
        fetched.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not fetched.wait(remaining):
            raise LocalError(
                f"{where}: after {SWARM_TIMEOUT_S:.0f} s its hivemind progress tracker sees "
                f"{seen} of the {workers} peers; check that the peers reach each other (their "
                "logs say which did not start or join)"
            )


def _train(
    workload: TorchWorkload,
    optimizer: Any,
    *,
    where: str,
    task: Task,
    rank: int,
    directory: Path,
    genesis: dict[str, torch.Tensor],
    go: Callable[[], None],
) -> None:
    target = task.workers * task.inner_steps * workload.batch_size
    # A peer that outpaces the others draws more than task.steps batches before the swarm
    # has drawn task.windows epochs: its stream goes on as the task's would (the same
    # batches first), up to MAX_STEPS_FACTOR times as many.
    longer = replace(task, windows=task.windows * MAX_STEPS_FACTOR)
    go()
    writer = SnapshotWriter(directory)
    # hivemind estimates each peer's samples per second from the time between its reports,
    # counted from when the optimizer was made: without this the wait for go would count
    # as training time, and the peers' first estimates of when the epoch ends would be
    # seconds late.
    optimizer.tracker.performance_ema.reset_timer()
    if rank == 0:
        writer.save(0, 0, genesis)
    epochs: list[dict[str, Any]] = []
    epoch = optimizer.local_epoch
    step = at_epoch = 0
    inner = 0.0
    workload.model.train()
    for step, indices in enumerate(worker_batches(workload, longer, rank), start=1):
        began = time.perf_counter()
        # hivemind.Optimizer is a torch optimizer: one step as our trainers take it
        inner_step(
            workload.model,
            optimizer,
            workload.collate(indices),
            workload.batch_loss,
            workload.autocast_dtype,
        )
        inner += time.perf_counter() - began
        if step == 1:
            # A peer shows up in the others' progress trackers once it has reported samples,
            # and hivemind ends an epoch by the samples the tracker sees: a peer that trained
            # on before it saw the others would end its first epoch alone (and the swarm's
            # epochs would then drift apart). So every peer waits here, after its first
            # step, until it sees them all.
            _await_swarm(optimizer, task.workers, where)
            optimizer.tracker.performance_ema.reset_timer()
        if optimizer.local_epoch == epoch:
            continue
        epoch, at_epoch = optimizer.local_epoch, step
        weights = worker_weights(workload)
        epochs.append(
            {"epoch": epoch, "step": step, "time": time.time(), "probe": weights_probe(weights)}
        )
        if rank == 0:
            writer.save(step, epoch * target, weights)
        asked = stop_epoch(directory.parent)  # a run to target that reached it
        if epoch >= task.windows or (asked is not None and epoch >= asked):
            break
    if rank == 0 and at_epoch != step:
        # Out of batches before the swarm's last epoch: the model as it is, its samples
        # estimated at this peer's pace.
        samples = epoch * target + (step - at_epoch) * task.workers * workload.batch_size
        writer.save(step, samples, worker_weights(workload))
    (directory / EPOCHS_FILE).write_text(json.dumps(epochs, indent=1))
    writer.finish(
        inner_seconds=inner,
        steps=step,
        samples=step * workload.batch_size,
        epochs=int(optimizer.local_epoch),
    )


def run_peer(
    task: Task,
    rank: int,
    host: str,
    out: Path,
    *,
    initial_peers: Sequence[str] = (),
    wait_for_go: bool = False,
    verbose: bool = False,
) -> None:
    """Run one peer to the end (see the module's docstring)."""
    where = f"hivemind peer rank {rank} on {host}"
    if not 0 <= rank < task.workers:
        raise LocalError(f"{where}: rank {rank} is not in 0..{task.workers - 1}")
    workload = build_workload(task, threads=1)
    # Genesis as every system starts from it: hivemind.Optimizer runs one AdamW step on zero
    # gradients to create the optimizer's state, which decays the weights a little.
    genesis = worker_weights(workload)
    dht = _start_dht(host, initial_peers, where)
    try:
        optimizer = _make_optimizer(dht, workload, task, verbose=verbose)
        try:
            _announce(dht)
            go = (lambda: _wait_for_go(where)) if wait_for_go else (lambda: None)
            _train(
                workload,
                optimizer,
                where=where,
                task=task,
                rank=rank,
                directory=rank_directory(out, rank),
                genesis=genesis,
                go=go,
            )
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    where = f"hivemind peer rank {args.rank} on {args.host}"
    try:
        task = Task.from_json(args.task)
        run_peer(
            task,
            args.rank,
            args.host,
            args.out,
            initial_peers=args.initial_peers,
            wait_for_go=args.wait_for_go,
            verbose=args.verbose,
        )
    except LocalError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:
        traceback.print_exc()
        print(
            f"error: {where} failed: {exc!r}; the traceback above and hivemind's messages "
            "before it say where",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
