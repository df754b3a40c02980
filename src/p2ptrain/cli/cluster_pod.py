"""``p2ptrain cluster --experiment ID``: a home cluster that trains in a network as one pod.

The cluster finds its members, proves the secret and elects its leader as always
(:mod:`p2ptrain.cluster.runtime`); what changes is what a generation is. Each generation is
a pod (:mod:`p2ptrain.node.pod`), and each member is the ``torchrun`` agent of its one rank:
it starts ``p2ptrain train --experiment ID ...`` with the variables ``torchrun`` would set
(``RANK`` = its rank in the generation, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT`` = the
generation, and the generation's store on the leader as the agent's store). So the leader's
child is rank 0, the trainer node that speaks for the cluster in the network (identity and
saved state in ``DIR/node``), and the others' children train the windows it commands.

A generation ends when its pod does: a rank's child that dies fails the pod's window and
every child exits; a member that stops answering the cluster's probes, a new member waiting
to join, or a member leaving ends it too (the leader stops its node, which tells the ranks
to stop). Then the members re-form, and the next leader's node trains on. A child that
could not start for a reason a restart does not mend (exit code 2: a wrong experiment id,
an unreachable bootstrap, a workload that does not match) stops the member with its reason.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from p2ptrain.cluster.interfaces import interface_holding
from p2ptrain.cluster.membership import GenerationPlan
from p2ptrain.cluster.settings import ClusterSettings
from p2ptrain.cluster.training import Outcome, StepReport
from p2ptrain.errors import LocalError
from p2ptrain.node.parent_death import bound_to_this_process

__all__ = ["PodNetwork", "PodTrainerGenerations", "pod_generations"]

#: A child's exit code for a usage error (:attr:`LocalError.exit_code`): not mended by a
#: restart.
_USAGE_ERROR = LocalError.exit_code
_POLL_S = 0.2
_STOP_S = 60.0  # how long a child stopped at a re-form may take before it is killed
_TAIL = 20


@dataclass(frozen=True)
class PodNetwork:
    """The network a cluster trains in as one pod trainer, as ``p2ptrain train`` takes it."""

    experiment: str
    bootstrap: tuple[str, ...]
    #: The network's admission secret file (None: an open network).
    secret_file: Path | None = None
    #: The workload reference the ranks build (None: the experiment's own).
    workload: str | None = None
    device: str = "cpu"


class PodTrainerGenerations:
    """Runs each of a member's generations as its rank of a pod (module docstring)."""

    def __init__(
        self,
        settings: ClusterSettings,
        network: PodNetwork,
        interface: str,
        relay: Callable[[str], None] | None,
    ) -> None:
        self.settings, self.network, self.interface, self.relay = (
            settings, network, interface, relay,
        )  # fmt: skip
        #: Windows this member's pods trained.
        self.completed_step = 0

    def command(self) -> list[str]:
        """The ``p2ptrain train`` every rank runs (rank 0 as the node, the others as ranks)."""
        network = self.network
        command = [
            sys.executable, "-m", "p2ptrain", "train", "--json",
            "--dir", str(self.settings.data_dir / "node"),
            "--experiment", network.experiment,
            "--threads", str(self.settings.threads),
            "--device", network.device,
            "--pod-timeout-s", f"{self.settings.collective_timeout_s:g}",
        ]  # fmt: skip
        for address in network.bootstrap:
            command += ["--bootstrap", address]
        if network.secret_file is not None:
            command += ["--secret-file", str(network.secret_file)]
        if network.workload is not None:
            command += ["--workload", network.workload]
        return command

    def environment(self, plan: GenerationPlan, rank: int) -> dict[str, str]:
        """What ``torchrun``'s agent would tell rank ``rank`` of the generation's pod."""
        return {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(plan.world),
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": plan.store_host,
            "MASTER_PORT": str(plan.store_port),
            "TORCHELASTIC_USE_AGENT_STORE": "true",
            "TORCHELASTIC_RESTART_COUNT": str(plan.number),
            "TORCHELASTIC_RUN_ID": f"p2ptrain-cluster-{self.settings.name}",
            "GLOO_SOCKET_IFNAME": self.interface,
        }

    def run(
        self,
        plan: GenerationPlan,
        rank: int,
        *,
        store: Any,
        vote: Callable[[], bool],
        on_step: Callable[[StepReport], None],
    ) -> Outcome:
        """Run this member's rank of generation ``plan``'s pod until the pod ends. ``store``
        (the leader's) stays open meanwhile: the ranks meet in it."""
        del store  # held by the caller for as long as this runs
        child = subprocess.Popen(
            bound_to_this_process(self.command()),  # it dies with this member
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.environment(plan, rank),
            start_new_session=True,  # the terminal's Ctrl-C reaches the member, which decides
        )
        assert child.stdout is not None and child.stderr is not None
        ready = threading.Event()
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        readers = [
            threading.Thread(
                target=self._events, args=(child.stdout, plan, ready, on_step), daemon=True
            ),
            threading.Thread(target=_stderr, args=(child.stderr, tail), daemon=True),
        ]
        for reader in readers:
            reader.start()
        asked = self._wait(child, vote)
        for reader in readers:
            reader.join(timeout=5)
        return self._outcome(child.returncode, rank, asked, ready.is_set(), tail)

    def _wait(self, child: subprocess.Popen[bytes], vote: Callable[[], bool]) -> bool:
        """Wait for the child to end; stop it when the generation is voted to an end.
        Returns whether it was asked to stop."""
        asked = False
        while True:
            try:
                child.wait(timeout=_POLL_S)
                return asked
            except subprocess.TimeoutExpired:
                pass
            if vote() and not asked:
                asked = True
                child.send_signal(signal.SIGTERM)  # rank 0: the node stops and ends the pod
                killer = threading.Timer(_STOP_S, _kill, args=(child,))
                killer.daemon = True
                killer.start()

    def _events(
        self,
        stream: IO[bytes],
        plan: GenerationPlan,
        ready: threading.Event,
        on_step: Callable[[StepReport], None],
    ) -> None:
        """Rank 0's node events: each trained window is a step of the cluster; with
        ``--json`` every event is passed on as it came."""
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            if self.relay is not None:
                self.relay(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event") if isinstance(event, dict) else None
            if kind == "ready":
                ready.set()
            elif kind == "trained":
                self.completed_step += 1
                on_step(StepReport(
                    plan.number, int(event.get("window", 0)),
                    float(event.get("loss_after", 0.0)), float(event.get("seconds", 0.0)),
                ))  # fmt: skip

    def _outcome(
        self, code: int, rank: int, asked: bool, ready: bool, tail: Sequence[str]
    ) -> Outcome:
        last = next((line for line in reversed(tail) if line.strip()), "")
        if code == _USAGE_ERROR and (rank > 0 or not ready):
            raise LocalError(
                f"the pod's rank {rank} (p2ptrain train --experiment "
                f"{self.network.experiment}) could not start: {last or 'see its log lines'}"
            )
        if code == 0:
            if asked or rank > 0:  # rank 0 ended the pod: a re-form
                return Outcome("reform", self.completed_step, "the pod was stopped to re-form")
            return Outcome("done", self.completed_step, "the trainer node stopped")
        why = f"exit code {code}" if code > 0 else f"signal {-code}"
        if asked:
            why += ", stopped to re-form"
        reason = f"the pod's rank {rank} ended ({why})" + (f": {last}" if last else "")
        return Outcome("failed", self.completed_step, reason[:300])


def _stderr(stream: IO[bytes], tail: collections.deque[str]) -> None:
    """The child's log lines, passed on to ours; the last ones kept for its outcome."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        print(line, file=sys.stderr, flush=True)


def _kill(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()


def pod_generations(
    network: PodNetwork, relay: Callable[[str], None] | None
) -> Callable[[ClusterSettings, str], PodTrainerGenerations]:
    """What builds a member's :class:`PodTrainerGenerations` (``ClusterMember``'s build)."""

    def build(settings: ClusterSettings, host: str) -> PodTrainerGenerations:
        interface = settings.gloo_interface or interface_holding(host)
        if interface is None:
            raise LocalError(
                f"no interface of this machine holds --host {host}: give one of its IPv4 "
                "addresses (ip -4 addr shows them), or set GLOO_SOCKET_IFNAME"
            )
        return PodTrainerGenerations(settings, network, interface, relay)

    return build
