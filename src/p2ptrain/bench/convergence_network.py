"""Our network on the convergence bench's task: the demo's network as real processes.

A seed, a reducer, 3 validators (any 2 certify) and ``task.workers`` trainers run DiLoCo with
the demo's settings for ``task.windows`` windows of ``task.inner_steps`` steps: 4-bit (int4)
updates, the default robust rule, each window's aggregate rounded to 4 bits (what trainers
download), outer Nesterov lr 1.0 momentum 0.5 -- or, with ``task.sparse``, the sparse recipe
(:func:`sparse_recipe`) -- and the workload's inner AdamW at a rate that decays along a
cosine to a tenth over the run, as the DiLoCo recipe's inner schedule does (the DDP ranks
keep the workload's constant rate). Each node runs in its host's network namespace
when the placement is a lab (serving on its lab address; trainers, as in the demo, serve
nothing and push their updates), else on loopback.

:func:`run_network` returns when each head was certified (the seed adopting it, on the
bench's clock), each trainer's ``trained`` events (its compute utilisation) and, after every
node stopped cleanly, their data directories: the certified heads are read back from the
seed's store for evaluation, and each node's ``status.json`` holds the bytes its
connections carried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from p2ptrain.bench.convergence_task import Placement, Task
from p2ptrain.errors import LocalError
from p2ptrain.node.local_network import LocalNetwork, experiment_toml
from p2ptrain.observe.events import Exited, HeadAdopted, RoleFailure, Trained
from p2ptrain.torch.char_gpt import (
    DEMO_AGGREGATE_PRECISION,
    DEMO_CODEC,
    DEMO_DEFAULTS,
    demo_inner_schedule,
)

__all__ = ["NETWORK_NODES", "CertifiedHead", "NetworkRun", "network_hosts", "run_network"]

#: The nodes besides the trainers, as in the demo.
NETWORK_NODES = ("seed", "reducer", "validator-0", "validator-1", "validator-2")
QUORUM = 2
PROPOSAL_S = 10.0


def network_hosts(task: Task) -> list[str]:
    """The host of every node of the network: the trainers first."""
    return [*(f"trainer-{i}" for i in range(task.workers)), *NETWORK_NODES]


@dataclass(frozen=True)
class CertifiedHead:
    """A head the seed adopted: when (``time.time()``), its height and id, how many updates
    it accepted, and the blob of its weights in the seed's store."""

    at: float
    height: int
    head_id: str
    accepted: int
    weights_blob: str


@dataclass
class NetworkRun:
    """What one run of our network left."""

    launched: float
    ended: float = 0.0
    #: Every certified head, as the seed adopted it.
    heads: list[CertifiedHead] = field(default_factory=list)
    trained: dict[str, list[Trained]] = field(default_factory=dict)
    workdir: Path = Path()

    @property
    def seed_dir(self) -> Path:
        return self.workdir / "seed"


DENSE_RECIPE: Final[dict[str, Any]] = {
    "outer_lr": float(DEMO_DEFAULTS["outer_lr"]),
    "outer_momentum": float(DEMO_DEFAULTS["outer_momentum"]),
    "aggregate_precision": DEMO_AGGREGATE_PRECISION,
    "codec": DEMO_CODEC,
}
"""The demo's updates: dense int4 up and down, outer Nesterov."""

#: Inner steps of dense int4 updates before the sparse ones start (whole windows: 4 of 25
#: steps, 2 of 50).
SPARSE_WARM_UP_STEPS = 100


def sparse_warm_up(inner_steps: int) -> int:
    """The dense warm-up's windows at ``inner_steps`` a window: the nearest whole number to
    :data:`SPARSE_WARM_UP_STEPS` steps, at least one."""
    return max(1, round(SPARSE_WARM_UP_STEPS / inner_steps))


def sparse_recipe(fraction: float, inner_steps: int) -> dict[str, Any]:
    """SparseLoCo's recipe at ``fraction``: chunked top-k updates after a dense warm-up
    (:func:`sparse_warm_up`), each coordinate averaged over its senders, the error feedback in
    place of outer momentum (plain SGD at lr 1), the aggregate rounded to int4 (sparse: its
    stored values alone)."""
    return {
        "outer": "sgd",
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "aggregate_precision": "int4",
        "codec": "sparseloco",
        "codec_config": {"fraction": fraction, "dense_windows": sparse_warm_up(inner_steps)},
        "rule": "contributor_mean",
    }


def run_network(
    task: Task,
    workdir: Path,
    placement: Placement,
    *,
    deadline_s: float,
    timeout_s: float,
    stop: Callable[[], bool] = lambda: False,
    certified: Callable[[CertifiedHead], None] = lambda head: None,
) -> NetworkRun:
    """Run the network until the seed adopted ``task.windows`` heads or ``stop()`` says so
    (or ``timeout_s`` passed: LocalError), then stop every node cleanly. ``certified`` is
    told of each head as the seed adopts it."""
    # new interpreters, as DDP's and hivemind's: the bench counts the CPU time of the
    # processes it waited for (not those of a fork server, p2ptrain.node.forked)
    network = LocalNetwork(workdir)
    trainers = [f"trainer-{i}" for i in range(task.workers)]
    run = NetworkRun(launched=time.time(), workdir=workdir)
    toml = experiment_toml(
        validators=[network.identity(f"validator-{i}") for i in range(3)],
        reducers=[network.identity("reducer")],
        quorum=QUORUM,
        workload={"name": "char-gpt", "config": task.config},
        inner_steps=task.inner_steps,
        deadline_s=deadline_s,
        proposal_s=PROPOSAL_S,
        min_updates=max(1, task.workers // 2),
        max_updates=task.workers,
        inner_lr=task.lr,
        inner_schedule=demo_inner_schedule(task.schedule_windows or task.windows),
        **(sparse_recipe(task.sparse, task.inner_steps) if task.sparse else DENSE_RECIPE),
        study="bench",
        name="convergence",
        staleness=task.staleness,
    )
    path = network.write_experiment(toml)

    def start(name: str, role: str, args: list[str]) -> None:
        program = [*placement.command_prefix(name), network.python, "-m", "p2ptrain"]
        if role != "trainer":  # the last --listen wins over LocalNetwork's loopback one
            args = [*args, "--listen", f"{placement.host_address(name)}:0"]
        network.start(name, role, args=args, program=program)

    try:
        # --archive: the seed keeps every certified head's weights, evaluated afterwards
        start("seed", "seed", ["--experiment-toml", str(path), "--archive"])
        network.wait_ready(["seed"])
        start("reducer", "reducer", [])
        for i in range(3):
            start(f"validator-{i}", "validator", [])
        for name in trainers:
            start(name, "trainer", [])
        network.wait_ready([n for n in network.nodes if n != "seed"])
        left_s = timeout_s - (time.time() - run.launched)
        _follow(network, run, task.windows, left_s, stop=stop, certified=certified)
    finally:
        # the trainers first: one still adopting the last head when the nodes that serve
        # its aggregate go would fall back to downloading the whole state
        network.stop(trainers)
        network.stop()
        run.ended = time.time()
    return run


def _follow(
    network: LocalNetwork,
    run: NetworkRun,
    windows: int,
    timeout_s: float,
    *,
    stop: Callable[[], bool],
    certified: Callable[[CertifiedHead], None],
) -> None:
    failures: list[str] = []

    def reached() -> int:
        return max((head.height for head in run.heads), default=0)

    def done() -> bool:
        return reached() >= windows or (bool(run.heads) and stop())

    for name, event in network.next_events(timeout_s, until=done):
        if isinstance(event, HeadAdopted) and name == "seed":
            head = CertifiedHead(
                time.time(), event.height, event.head_id, event.accepted, event.weights_blob
            )
            run.heads.append(head)
            certified(head)
        elif isinstance(event, Trained):
            run.trained.setdefault(name, []).append(event)
        elif isinstance(event, RoleFailure):
            failures.append(f"{name}: {event.role} window {event.window}: {event.message}")
        elif isinstance(event, Exited):
            raise LocalError(
                f"{name} exited (code {event.returncode}) before window {windows} was "
                f"certified; see {network.nodes[name].log}"
            )
    if reached() < windows and not stop():
        said = "; ".join(failures[-3:]) or "no role failed"
        raise LocalError(
            f"our network certified {reached()} of {windows} windows in {timeout_s:.0f} s "
            f"({said}); see the logs in {network.workdir / 'logs'}"
        )
