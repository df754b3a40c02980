"""The network of one chaos run: real node processes, what they say, and the faults.

:class:`ChaosNetwork` starts the run's nodes (:data:`~.chaos_plan.NODES`) with
:class:`~p2ptrain.node.local_network.LocalNetwork` on a tiny char-GPT experiment (a window
takes about a second once every update is in): on loopback, or each node in its own network
namespace of a :class:`~.netns_lab.NamespaceLab` (``ip netns exec`` in front of ``python -m
p2ptrain``), serving on its lab address, which is what it advertises and peers dial.

It reads the nodes' events as they come: the heads each node adopted, and the moment each
height was first adopted anywhere -- the network's certificates, the clock of the recovery
figures. It kills and restarts (a restarted node comes back on its data directory and at
the address it had), pauses and resumes, cuts off and heals, starts a late joiner
(:data:`~.chaos_plan.JOINER`, a viewer on an empty data directory), and at the end stops
every node cleanly so that its data directory can be read back. :meth:`ChaosNetwork.diagnose`
says what each node was doing (its ``status.json`` and the tail of its log) when a fault did
not heal.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from p2ptrain.bench.chaos_plan import JOINER, NODES
from p2ptrain.bench.netns_lab import NamespaceLab
from p2ptrain.errors import LocalError
from p2ptrain.node.forked import fork_launcher
from p2ptrain.node.local_network import LocalNetwork, NodeProcess, experiment_toml
from p2ptrain.observe.events import (
    Exited,
    HeadAdopted,
    NodeEvent,
    PeerReported,
    Ready,
    RoleFailure,
)
from p2ptrain.observe.status import NodeStatus, read_status
from p2ptrain.torch.char_gpt import DEFAULT_CONFIG

__all__ = ["TINY_WORKLOAD", "ChaosNetwork"]

#: A char-GPT of ~16k parameters: ten inner steps take a few hundredths of a second.
TINY_WORKLOAD: dict[str, Any] = {
    **DEFAULT_CONFIG,
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "block_size": 32,
    "batch_size": 8,
    "val_blocks": 64,
}
#: What the peer book logs for each strike and ban (net/peers.py): a strike for a transport
#: fault shows only there, not as a ``reported`` event.
_STRIKE = re.compile(r" WARNING p2ptrain\.net\.peers: peer \S+: (.*) \(strike \d+ of \d+\)$")
_BAN = re.compile(r" WARNING p2ptrain\.net\.peers: peer \S+ banned for ")
REASON_CHARS = 120
INNER_STEPS = 10
QUORUM = 2
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 4
LINE_CHARS = 240
#: The shortest wait at the end for the nodes to settle on one height (sub-second windows).
SETTLE_MIN_S = 10.0


def _role(name: str) -> str:
    return name.split("-", maxsplit=1)[0]


class ChaosNetwork:
    """The processes of one run, and what they said."""

    #: Every node a run may start: the network, then the joiner a long run starts late.
    NAMES = (*NODES, JOINER)

    def __init__(
        self,
        workdir: Path,
        *,
        lab: NamespaceLab | None,
        deadline_s: float,
        proposal_s: float,
        debug_logs: bool = False,
    ) -> None:
        self.workdir = workdir
        self.lab = lab
        self.debug_logs = debug_logs
        self.deadline_s = deadline_s
        self.proposal_s = proposal_s
        self.network = LocalNetwork(workdir, launch=fork_launcher())
        #: (height, head id) of every head each node said it adopted, over all its lives.
        self.adopted: dict[str, set[tuple[int, str]]] = defaultdict(set)
        #: The highest height each node said it holds (ready or adopted).
        self.heights: dict[str, int] = {}
        #: (time.monotonic(), height) of each head each node adopted, in order.
        self.adoptions: dict[str, list[tuple[float, int]]] = defaultdict(list)
        #: When each height was first adopted by any node (time.monotonic()).
        self.certified: dict[int, float] = {}
        self.reports: list[str] = []
        self.role_failures: list[str] = []
        #: (node, what happened) for each node that exited without being told to.
        self.crashed: list[tuple[str, str]] = []
        self.notes: list[str] = []
        self.paused: set[str] = set()
        #: Nodes that were ready at least once (whose data directories hold a store).
        self.started: set[str] = set()
        self._exited: set[str] = set()
        self._leaving: set[str] = set()
        self._processes: list[NodeProcess] = []

    @property
    def height(self) -> int:
        """The highest height certified anywhere so far."""
        return max(self.certified, default=0)

    @property
    def nodes(self) -> dict[str, NodeProcess]:
        return self.network.nodes

    def height_of(self, name: str) -> int:
        """The highest height ``name`` said it holds (0: none yet)."""
        return self.heights.get(name, 0)

    # -- starting -------------------------------------------------------------------------

    def launch(self) -> None:
        """Write the experiment, start the seed, then every other node at once (so that the
        trainers publish before window 1's deadline), and wait until all are ready."""
        toml = experiment_toml(
            validators=[self.network.identity(n) for n in NODES if _role(n) == "validator"],
            reducers=[self.network.identity(n) for n in NODES if _role(n) == "reducer"],
            quorum=QUORUM,
            workload={"name": "char-gpt", "config": TINY_WORKLOAD},
            inner_steps=INNER_STEPS,
            deadline_s=self.deadline_s,
            proposal_s=self.proposal_s,
            min_updates=1,
            max_updates=sum(1 for n in NODES if _role(n) == "trainer"),
            inner_lr=float(TINY_WORKLOAD["lr"]),
        )
        path = self.network.write_experiment(toml)
        self._start("seed", args=["--experiment-toml", str(path)])
        self._require_ready(["seed"])
        others = [n for n in NODES if n != "seed"]
        for name in others:
            self._start(name)
        self._require_ready(others)

    def _start(self, name: str, *, args: Sequence[str] = (), port: int = 0) -> NodeProcess:
        role = _role(name)
        extra = list(args)
        program = [self.network.python, "-m", "p2ptrain", *(["-v"] if self.debug_logs else [])]
        if self.lab is not None:
            program = [*self.lab.command_prefix(name), *program]
        if role != "trainer":  # the last --listen wins over LocalNetwork's loopback one
            host = "127.0.0.1" if self.lab is None else self.lab.address[name]
            extra += ["--listen", f"{host}:{port}"]
        self._exited.discard(name)
        self._leaving.discard(name)
        node = self.network.start(name, role, args=extra, program=program)
        self._processes.append(node)
        return node

    def _wait_ready(self, names: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> list[str]:
        """Wait until every named node is ready or has exited; return those that exited."""
        nodes = self.nodes
        settled = self.pump(
            timeout_s,
            until=lambda: all(nodes[n].ready is not None or n in self._exited for n in names),
        )
        if not settled:
            waiting = [n for n in names if nodes[n].ready is None]
            raise LocalError(f"{', '.join(waiting)} not ready after {timeout_s:.0f} s")
        return [n for n in names if nodes[n].ready is None]

    def _require_ready(self, names: Sequence[str]) -> None:
        failed = self._wait_ready(names)
        if failed:
            raise LocalError(f"{', '.join(failed)} exited before it was ready")

    # -- events ---------------------------------------------------------------------------

    def pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> bool:
        """Take events for ``timeout_s`` or until ``until()`` holds; return whether it does."""
        check = until or (lambda: False)
        for name, event in self.network.next_events(timeout_s, until=check):
            self._take(name, event)
        return check()

    def _take(self, name: str, event: NodeEvent) -> None:
        if isinstance(event, Ready):
            self.nodes[name].ready = event
            self.started.add(name)
            if name == "seed":
                self.network.experiment_id = event.experiment_id
            self.heights[name] = max(self.heights.get(name, 0), event.height)
        elif isinstance(event, HeadAdopted):
            self.adopted[name].add((event.height, event.head_id))
            self.adoptions[name].append((time.monotonic(), event.height))
            self.heights[name] = max(self.heights.get(name, 0), event.height)
            self.certified.setdefault(event.height, time.monotonic())
        elif isinstance(event, PeerReported):
            self.reports.append(f"{name}: {event.peer[:12]} {event.reason}")
        elif isinstance(event, RoleFailure):
            self.role_failures.append(
                f"{name} {event.role} window {event.window} {event.step}: {event.error}: "
                f"{event.message} ({event.failures}/{event.limit})"
            )
        elif isinstance(event, Exited):
            self._exited.add(name)
            if name not in self._leaving:
                self.crashed.append(
                    (name, f"exited by itself (code {event.returncode}): {self._last_log(name)}")
                )

    def wait_certified_above(self, height: int, timeout_s: float) -> float | None:
        """When a height above ``height`` was first certified (waiting up to ``timeout_s``)."""
        self.pump(timeout_s, until=lambda: self.height > height)
        return min((t for h, t in self.certified.items() if h > height), default=None)

    def rejoined_at(self, name: str, height: int, since: float) -> float | None:
        """When ``name`` first adopted a head at ``height`` or above since ``since``."""
        return next((t for t, h in self.adoptions[name] if t >= since and h >= height), None)

    def wait_rejoined(
        self, names: Sequence[str], height: int, since: float, timeout_s: float
    ) -> dict[str, float | None]:
        """Wait up to ``timeout_s`` until each of ``names`` adopted a head at ``height`` or
        above since ``since``; return when each did (None: not yet)."""
        self.pump(
            timeout_s,
            until=lambda: all(self.rejoined_at(n, height, since) is not None for n in names),
        )
        return {name: self.rejoined_at(name, height, since) for name in names}

    # -- faults ---------------------------------------------------------------------------

    def kill(self, names: Sequence[str]) -> None:
        for name in names:
            self._leaving.add(name)
            self.nodes[name].kill()
            self.paused.discard(name)
        self.pump(10.0, until=lambda: self._exited.issuperset(names))

    def restart(self, names: Sequence[str]) -> list[str]:
        """Start killed nodes again (the seed first) at the address each had; wait until
        they are ready; return what went wrong that the bench must count (a node that came
        back lower than it had been). Raises :class:`LocalError` if one cannot start."""
        lost = []
        before = {name: self.heights.get(name, 0) for name in names}
        for group in ([n for n in names if n == "seed"], [n for n in names if n != "seed"]):
            if not group:
                continue
            for name in group:
                self._start(name, port=self._port(name))
            for name in self._wait_ready(group):  # its address was taken? take another one
                last = max(i for i, (n, _) in enumerate(self.crashed) if n == name)
                _, failure = self.crashed.pop(last)
                self.notes.append(f"{name} did not come back at its address: {failure}")
                self._start(name)
            self._require_ready(group)
        for name in names:
            ready = self.nodes[name].ready
            if ready is not None and ready.height < before[name]:
                lost.append(
                    f"{name} came back at height {ready.height} after a kill, having adopted "
                    f"height {before[name]} before it"
                )
        return lost

    def join(self, names: Sequence[str]) -> None:
        """Start nodes that never ran (viewers, empty data directories) and wait until they
        are ready. Raises :class:`LocalError` if one cannot start."""
        for name in names:
            if name in self.nodes:
                raise LocalError(f"{name} already ran: a joiner starts on an empty directory")
            self._start(name)
        self._require_ready(names)

    def _port(self, name: str) -> int:
        address = self.nodes[name].address
        port = urlsplit(address).port if address else None
        return port or 0

    def pause(self, names: Sequence[str]) -> None:
        for name in names:
            self.nodes[name].signal(signal.SIGSTOP)
            self.paused.add(name)

    def resume(self, names: Sequence[str]) -> None:
        for name in names:
            self.nodes[name].signal(signal.SIGCONT)
            self.paused.discard(name)

    def cut(self, names: Sequence[str]) -> None:
        if self.lab is None:
            raise LocalError("partitions need network namespaces")
        self.lab.cut(names)

    def heal(self) -> None:
        if self.lab is not None:
            self.lab.heal()

    # -- the end --------------------------------------------------------------------------

    def finish(self) -> list[str]:
        """Stop every node cleanly: the trainers first (no window fills after that), then,
        once the others adopted the last certified height (or two deadlines passed), the
        rest. Returns notes on what did not go as planned."""
        notes = []
        self.resume(sorted(self.paused))
        self.heal()
        running = [n for n in self.NAMES if n in self.nodes and self.nodes[n].alive()]
        self._leaving.update(running)
        trainers = [n for n in running if _role(n) == "trainer"]
        others = [n for n in running if _role(n) != "trainer"]
        if trainers:  # (LocalNetwork.stop stops every node when given none)
            self.network.stop(trainers, timeout_s=STOP_TIMEOUT_S)
        target = self.height
        caught_up = self.pump(
            max(2 * self.deadline_s, SETTLE_MIN_S),
            until=lambda: all(self.heights.get(n, 0) >= target for n in others),
        )
        if not caught_up:
            behind = [f"{n} at {self.heights.get(n, 0)}" for n in others
                      if self.heights.get(n, 0) < target]  # fmt: skip
            notes.append(f"not at height {target} when stopped: {', '.join(behind)}")
        if others:
            self.network.stop(others, timeout_s=STOP_TIMEOUT_S)
        for name in running:
            if self.nodes[name].process.poll() == -signal.SIGKILL:
                notes.append(f"{name} did not stop within {STOP_TIMEOUT_S:.0f} s of SIGINT")
        self.pump(10.0, until=lambda: self._exited.issuperset(running))
        return notes

    def close(self) -> None:
        """Kill and reap every process ever started (paused ones included)."""
        for node in self._processes:
            self._leaving.add(node.name)
            if node.alive():
                node.process.send_signal(signal.SIGCONT)
                node.process.send_signal(signal.SIGKILL)
            node.process.wait()
            if node.stdout is not None:
                node.stdout.close()

    # -- diagnosis ------------------------------------------------------------------------

    def diagnose(self, title: str) -> str:
        """What each node was doing: its status and the last lines of its log."""
        lines = [title]
        for name in [n for n in self.NAMES if n in NODES or n in self.nodes]:
            lines.append(f"  {name}: {self._status_line(name)}")
            lines += [f"    | {line[:LINE_CHARS]}" for line in self._log_tail(name)]
        lines += [f"  role failure: {failure}" for failure in self.role_failures[-5:]]
        return "\n".join(lines)

    def _status_line(self, name: str) -> str:
        if name not in self.nodes:
            return "never started"
        if name in self.paused:
            return "paused"
        if not self.nodes[name].alive():
            return "not running"
        try:
            status = read_status(self.nodes[name].data_dir)
        except LocalError as exc:
            return f"no status ({exc})"
        return _describe(status)

    def logged_strikes(self) -> tuple[Counter[str], int]:
        """The strikes the nodes' logs record, by reason (peer ids left out), and the bans."""
        reasons: Counter[str] = Counter()
        bans = 0
        for name in self.NAMES:
            try:
                text = self.nodes[name].log.read_text(errors="replace")
            except (KeyError, OSError):
                continue
            for line in text.splitlines():
                strike = _STRIKE.search(line)
                if strike is not None:
                    reasons[strike.group(1)[:REASON_CHARS]] += 1
                bans += _BAN.search(line) is not None
        return reasons, bans

    def _log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last warnings (or, without any, the last lines but debug ones) of the log."""
        try:
            text = self.nodes[name].log.read_text(errors="replace")
        except (KeyError, OSError):
            return []
        kept = [line for line in text.splitlines() if line.strip() and " DEBUG " not in line]
        worse = [line for line in kept if " WARNING " in line or " ERROR " in line]
        return (worse or kept)[-lines:]

    def _last_log(self, name: str) -> str:
        tail = self._log_tail(name, 1)
        return tail[0][:LINE_CHARS] if tail else "(empty log)"


def _describe(status: NodeStatus) -> str:
    parts = [f"height {status.height}"]
    if status.adopted_head_id != status.head_id:
        parts.append("fetching the tip's weights")
    if status.open_window is not None:
        parts.append(f"window {status.open_window.window}: {status.open_window.reason}")
    parts += [
        f"{state.role}: {state.last_reason}"
        + (f" ({state.failures_in_a_row} failures)" if state.failures_in_a_row else "")
        for state in status.role_states
    ]
    connections = status.connections
    parts.append(f"peers {status.peers}, links {connections.outbound}+{connections.inbound}")
    if status.banned:
        parts.append(f"banned {status.banned}")
    if status.errors:
        parts.append(f"last error {status.errors[-1].describe()}")
    if status.reports:
        parts.append(f"reported {len(status.reports)}: {'; '.join(status.reasons[-2:])}")
    return "; ".join(parts)
