"""``p2ptrain bench roles-memory``: a node of several roles against a trainer, in memory.

One live network on loopback, every node its own fresh interpreter (so each peak is its
own): a seed, three friends that each run ``--role trainer --role validator`` (quorum 2:
they propose, judge and certify every window) and one node that only trains. All train the
same model on the same experiment for ``windows`` windows; then each node's status says its
peak resident memory (``VmHWM``, :mod:`p2ptrain.observe.memory`) and what following the chain
cost it (chains, heads adopted, outer steps, certificate checks).

The figure is the friends' highest peak over the trainer's: what validating costs a trainer
on top of training. A node whose roles keep one chain (one copy of the weights and
outer-optimizer state, one outer step per head) stays within :data:`MAX_RATIO` of the
trainer; one that kept a chain per role held a second copy of the model and its momentum.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from p2ptrain.errors import LocalError
from p2ptrain.node.local_network import LocalNetwork
from p2ptrain.observe.events import Exited
from p2ptrain.observe.status import NodeStatus, read_status

__all__ = ["FRIENDS", "MAX_RATIO", "run_roles_memory_bench"]

#: The requirement: a trainer+validator node's peak RSS within this multiple of a trainer's.
MAX_RATIO: Final = 1.15
FRIENDS: Final = ("friend-0", "friend-1", "friend-2")
_TRAINER: Final = "trainer"


def run_roles_memory_bench(
    experiment_toml: Callable[[list[str]], str],
    *,
    windows: int,
    trainer_args: Sequence[str] = (),
    timeout_s: float = 1800.0,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run the network until every node holds height ``windows``; return the figures.
    ``experiment_toml(validator_keys)``: the definition the seed signs (the friends are its
    validators, quorum 2, at most four updates a window); ``trainer_args``: what every
    training node adds to its command (``--workload REF``)."""
    with tempfile.TemporaryDirectory(prefix="p2ptrain-roles-memory-", dir=workdir) as tmp:
        network = LocalNetwork(Path(tmp))
        started = time.monotonic()
        with network:
            keys = [network.identity(name) for name in FRIENDS]
            path = network.write_experiment(experiment_toml(keys))
            network.start("seed", "seed", args=["--experiment-toml", str(path), *trainer_args])
            network.wait_ready(["seed"])
            for name in FRIENDS:
                network.start(name, ("trainer", "validator"), windows=windows, args=trainer_args)
            network.start(_TRAINER, "trainer", windows=windows, args=trainer_args)
            names = [*FRIENDS, _TRAINER]
            network.wait_ready(names)
            _wait_exits(network, names, timeout_s)
            statuses = {name: read_status(network.workdir / name) for name in names}
        seconds = time.monotonic() - started
    return _figures(statuses, windows, seconds)


def _wait_exits(network: LocalNetwork, names: Sequence[str], timeout_s: float) -> None:
    """Each node stops by itself at the height asked; a failure says where to look."""
    running = set(names)
    for name, event in network.next_events(timeout_s, until=lambda: not running):
        if isinstance(event, Exited) and name in running:
            running.discard(name)
            if event.returncode != 0:
                log = network.nodes[name].log
                raise LocalError(f"node {name} exited with {event.returncode}; see {log}")
    if running:
        raise LocalError(f"nodes {sorted(running)} did not reach the height in {timeout_s:.0f} s")


def _figures(statuses: dict[str, NodeStatus], windows: int, seconds: float) -> dict[str, Any]:
    def costs(status: NodeStatus) -> dict[str, Any]:
        return {
            "peak_rss_mib": status.peak_rss_mib,
            "chains": status.chains,
            "heads_adopted": status.heads_adopted,
            "outer_steps": status.outer_steps,
            "certificate_checks": status.certificate_checks,
        }

    trainer = statuses[_TRAINER].peak_rss_mib
    multi = max(statuses[name].peak_rss_mib for name in FRIENDS)
    if trainer <= 0 or multi <= 0:
        raise LocalError("a node's status says no peak memory (no /proc on this system?)")
    ratio = multi / trainer
    return {
        "windows": windows,
        "nodes": {name: costs(status) for name, status in statuses.items()},
        "trainer_validator_peak_rss_mib": round(multi, 1),
        "trainer_peak_rss_mib": round(trainer, 1),
        "ratio": round(ratio, 3),
        "max_ratio": MAX_RATIO,
        "passed": ratio <= MAX_RATIO,
        "seconds": round(seconds, 1),
    }
