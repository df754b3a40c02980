"""A whole p2ptrain network of real node processes for the integration tests.

:class:`Net` wraps a :class:`~p2ptrain.node.local_network.LocalNetwork`: it writes a tiny
char-GPT experiment (a window takes about a second), starts the seed, reducers, validators
and trainers, and follows their JSON events. Every wait is on events, bounded by a timeout,
and a wait that fails names what it awaited, with the nodes' heights, the last events seen
and the tail of every node's log (``workdir/logs/<name>.log``). A node that exits without
having been told to (no ``stopped`` event and not killed by the test) fails the wait at once.
:meth:`Net.close` stops and reaps every process ever started, killed and restarted ones
included (paused ones are continued first); the :func:`local_net` fixture calls it whether
the test passed or not.

A fault held for a while (a pause, a partition) is held with :meth:`Net.watch`, which keeps
taking the nodes' events meanwhile; a condition on something other than events (a node's
status over HTTP, a log line) is waited on with :meth:`Net.wait_until`, which checks it
again every fraction of a second. :meth:`Net.note` adds a line (a random seed, a fault's
timing) to every failure message.

Set ``P2PTRAIN_TEST_NODE_DEBUG=1`` to run the nodes with ``p2ptrain -v`` (debug logs).

After the nodes stopped, :func:`stored_chain`, :func:`stored_records` and
:func:`genesis_and_tip` read what a data directory holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.records import Head
from p2ptrain.core.tensors import decode_state_dict
from p2ptrain.node.export import canonical_weights
from p2ptrain.node.forked import fork_launcher
from p2ptrain.node.local_network import LocalNetwork, NodeProcess, experiment_toml
from p2ptrain.node.persist import NodeStore
from p2ptrain.observe.events import NodeEvent, Ready
from p2ptrain.store.datadir import DataDir
from p2ptrain.store.state import StateStore
from p2ptrain.torch.char_gpt import DEFAULT_CONFIG

__all__ = [
    "TINY_CONFIG",
    "VERBOSE_ENV",
    "Net",
    "check_one_tip",
    "genesis_and_tip",
    "local_net",
    "stored_chain",
    "stored_records",
]

#: A char-GPT of ~16k parameters: ten inner steps take a few hundredths of a second.
TINY_CONFIG: dict[str, Any] = {
    **DEFAULT_CONFIG,
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "block_size": 32,
    "batch_size": 8,
    "val_blocks": 64,
}
INNER_STEPS = 10
#: A participant opens window 1 as it starts; the trainers, started at the same time but
#: slower to start (they load the data), must publish before its deadline or window 1 never
#: closes. Every later window closes as soon as ``max_updates`` updates arrived, so the
#: deadline only costs time when a trainer is missing.
DEADLINE_S = 20.0
PROPOSAL_S = 3.0
READY_TIMEOUT_S = 90.0
#: What the fork server imports for the tests' nodes, besides the node stack.
FORK_PRELOAD = ("tests.support.faulty_node",)
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 20
EVENTS_KEPT = 40
#: Set (to anything) to run the nodes with ``p2ptrain -v``: debug logs.
VERBOSE_ENV = "P2PTRAIN_TEST_NODE_DEBUG"

Event = dict[str, Any]
R = TypeVar("R")


def _python(workdir: Path, verbose: bool) -> str:
    """The interpreter the nodes run on; ``verbose``: one that passes ``p2ptrain -v``."""
    if not verbose:
        return sys.executable
    workdir.mkdir(parents=True, exist_ok=True)
    wrapper = workdir / "python-verbose.sh"
    # LocalNetwork runs [python, "-m", "p2ptrain", COMMAND, ...]: -v goes before COMMAND
    wrapper.write_text(
        f'#!/bin/sh\nflag="$1"; module="$2"; shift 2\nexec {shlex.quote(sys.executable)} '
        '"$flag" "$module" -v "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def _brief(event: Event) -> str:
    shown = {k: v for k, v in event.items() if k not in ("event", "peer_id", "address")}
    for key in ("head_id", "update_id", "experiment_id", "peer"):
        if isinstance(shown.get(key), str):
            shown[key] = shown[key][:12]
    for key in ("loss_before", "loss_after"):
        if isinstance(shown.get(key), float):
            shown[key] = round(shown[key], 3)
    return f"{event.get('event')} {json.dumps(shown, default=str)}"


class Net:
    """A local network under test, and what its nodes said."""

    def __init__(self, workdir: Path, *, verbose: bool = False) -> None:
        self.workdir = workdir
        self.network = LocalNetwork(
            workdir, python=_python(workdir, verbose), launch=fork_launcher(FORK_PRELOAD)
        )
        self.roles: dict[str, str] = {}
        #: Every process ever started, the replaced ones of restarted nodes included.
        self.processes: list[NodeProcess] = []
        #: Last height each node adopted (its ``ready`` height until it adopts one).
        self.heights: dict[str, int] = {}
        self.peer_ids: dict[str, str] = {}
        self.exited: set[str] = set()
        self.stopped: dict[str, int] = {}
        self.killed: set[str] = set()
        #: (seconds since start, node, event) of every event, in arrival order.
        self.history: list[tuple[float, str, Event]] = []
        self._recent: deque[str] = deque(maxlen=EVENTS_KEPT)
        self._listeners: list[Callable[[str, Event], None]] = []
        self._started_at = time.monotonic()
        self.windows: int | None = None
        #: How many updates a window of the running experiment needs (set by :meth:`launch`).
        self.min_updates = 1
        #: Arguments every node started from now on gets (``launch(extra_args=...)``).
        self.extra_args: tuple[str, ...] = ()
        #: Nodes stopped with SIGSTOP (:meth:`pause`) and not continued yet.
        self.paused: set[str] = set()
        self.notes: list[str] = []

    # -- the experiment and the nodes -----------------------------------------------------

    def launch(
        self,
        *,
        validators: int,
        reducers: int,
        trainers: int,
        quorum: int,
        min_updates: int = 1,
        max_updates: int | None = None,
        windows: int | None = None,
        deadline_s: float = DEADLINE_S,
        proposal_s: float = PROPOSAL_S,
        extra_args: Sequence[str] = (),
    ) -> None:
        """Write the experiment (``max_updates``: ``trainers`` unless given), start every
        node and wait until all are ready. Names: ``seed``, ``reducer-i``, ``validator-i``,
        ``trainer-i``. ``extra_args`` go to every node started from now on (restarted ones
        and later newcomers included), e.g. ``["--heartbeat-s", "2"]``.

        ``windows``: the trainers stop by themselves once they adopted that height, so no
        window after it fills and the network stays at that height; :meth:`finish` then
        stops the others there. (Only the trainers: a validator or reducer stopping at the
        last height takes the only copies of its head's weights with it, and the seed, which
        serves them to the trainers, would never adopt it.)
        """
        validator_names = [f"validator-{i}" for i in range(validators)]
        reducer_names = [f"reducer-{i}" for i in range(reducers)]
        trainer_names = [f"trainer-{i}" for i in range(trainers)]
        path = self.write_experiment(
            validators=validator_names,
            reducers=reducer_names,
            quorum=quorum,
            min_updates=min_updates,
            max_updates=trainers if max_updates is None else max_updates,
            deadline_s=deadline_s,
            proposal_s=proposal_s,
        )
        self.extra_args = tuple(extra_args)
        # the seed keeps every update and proposal: tests read who trained and proposed what
        self.start("seed", "seed", args=["--experiment-toml", str(path), "--archive"])
        self.wait_ready(["seed"])
        self.windows = windows
        self.min_updates = min_updates
        # Everyone else at once, so that the trainers publish before window 1's deadline.
        for name in reducer_names:
            self.start(name, "reducer")
        for name in validator_names:
            self.start(name, "validator")
        for name in trainer_names:
            self.start(name, "trainer", windows=windows)
        self.wait_ready([*reducer_names, *validator_names, *trainer_names])

    def write_experiment(
        self,
        *,
        validators: Sequence[str],
        reducers: Sequence[str] = (),
        quorum: int,
        max_updates: int,
        min_updates: int = 1,
        deadline_s: float = DEADLINE_S,
        proposal_s: float = PROPOSAL_S,
    ) -> Path:
        """Write the tiny char-GPT experiment whose validators and reducers are the keys of
        the nodes named (created now); return its path, for the seed's --experiment-toml."""
        toml = experiment_toml(
            validators=[self.network.identity(n) for n in validators],
            reducers=[self.network.identity(n) for n in reducers],
            quorum=quorum,
            workload={"name": "char-gpt", "config": TINY_CONFIG},
            inner_steps=INNER_STEPS,
            deadline_s=deadline_s,
            proposal_s=proposal_s,
            min_updates=min_updates,
            max_updates=max_updates,
            inner_lr=float(TINY_CONFIG["lr"]),
        )
        return self.network.write_experiment(toml)

    def start(
        self,
        name: str,
        role: str | Sequence[str],
        *,
        windows: int | None = None,
        args: Sequence[str] = (),
        program: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        bootstrap: Sequence[str] | None = None,
    ) -> NodeProcess:
        """Start the node ``name`` (of one role, or several: ``roles[name]`` is then
        ``"trainer+validator"``), or start it again on its data directory once it ended.
        ``program`` replaces ``python -m p2ptrain``; ``bootstrap`` the seed as the peers it
        joins through, in order. The node gets :attr:`extra_args` before ``args``."""
        if name in self.network.nodes and name not in self.exited:
            raise AssertionError(f"{name} is still running; kill or stop it first")
        args = [*self.extra_args, *args]
        node = self.network.start(
            name, role, windows=windows, args=args, program=program, env=env, bootstrap=bootstrap
        )
        self.processes.append(node)
        self.roles[name] = role if isinstance(role, str) else "+".join(role)
        for book in (self.exited, self.killed):
            book.discard(name)
        self.stopped.pop(name, None)
        return node

    def restart(self, name: str) -> NodeProcess:
        """Start a killed node again on its data directory and wait until it is ready."""
        roles = self.network.nodes[name].roles
        node = self.start(
            name,
            roles[0] if len(roles) == 1 else roles,
            windows=self.windows if "trainer" in roles else None,
        )
        self.wait_ready([name])
        return node

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (a crash) and take its events up to the end of its stream."""
        self.killed.add(name)
        self.network.nodes[name].kill()
        self.wait(f"the end of killed {name}'s events", 10, lambda: name in self.exited)

    def pause(self, name: str) -> None:
        """SIGSTOP ``name``: it holds its sockets and answers nothing until :meth:`resume`."""
        self.check(name not in self.exited, f"{name} has ended; it cannot be paused")
        self.paused.add(name)
        self.network.nodes[name].signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT a node :meth:`pause` stopped."""
        self.paused.discard(name)
        self.network.nodes[name].signal(signal.SIGCONT)

    def stop(self, names: Sequence[str]) -> None:
        """SIGINT ``names`` (SIGKILL after a while) and take their events to the end."""
        self.network.stop(names, timeout_s=STOP_TIMEOUT_S)
        self.wait(
            f"the end of {', '.join(names)}'s events", 10, lambda: self.exited.issuperset(names)
        )

    def finish(self, timeout_s: float) -> int:
        """Wait until the trainers stopped by themselves at the ``windows`` height and every
        other running node adopted it, then stop those cleanly; return the height."""
        height = self.windows
        assert height is not None, "launch(windows=...) sets the height to finish at"
        trainers = self.names("trainer")
        others = [n for n in self.roles if n not in trainers and n not in self.exited]
        self.wait(
            f"the trainers to stop at height {height} and {', '.join(others)} to adopt it",
            timeout_s,
            lambda: (
                self.exited.issuperset(trainers)
                and all(self.heights.get(n, 0) >= height for n in others)
            ),
        )
        self.check(
            all(self.stopped.get(n) == height for n in trainers),
            f"every trainer should stop at height {height}: {self.stopped}",
        )
        self.stop(others)
        return height

    def names(self, role: str | None = None) -> list[str]:
        return [n for n, r in self.roles.items() if role is None or r == role]

    def data_dir(self, name: str) -> Path:
        return self.workdir / name

    def status(self, name: str) -> dict[str, Any]:
        """The node's ``status.json``."""
        data: dict[str, Any] = json.loads((self.data_dir(name) / "status.json").read_text())
        return data

    # -- events ---------------------------------------------------------------------------

    def publishers(self) -> dict[int, set[str]]:
        """Which nodes published an update for each window, so far."""
        by_window: dict[int, set[str]] = {}
        for _, name, event in self.history:
            if event["event"] == "published":
                by_window.setdefault(int(event["window"]), set()).add(name)
        return by_window

    def events(self, kind: str, name: str | None = None) -> list[Event]:
        """Every event of ``kind`` seen so far (from ``name`` only, if given)."""
        return [e for _, n, e in self.history if e["event"] == kind and (name is None or n == name)]

    def _take(self, name: str, typed: NodeEvent) -> None:
        event: Event = msgspec.to_builtins(typed)
        kind = event.get("event")
        seconds = time.monotonic() - self._started_at
        self.history.append((seconds, name, event))
        self._recent.append(f"{seconds:6.1f}s {name}: {_brief(event)}")
        if isinstance(typed, Ready):
            self.network.nodes[name].ready = typed
            self.peer_ids[name] = str(event["peer_id"])
            self.heights[name] = max(self.heights.get(name, 0), int(event.get("height", 0)))
            if "seed" in self.network.nodes[name].roles:
                self.network.experiment_id = str(event["experiment_id"])
        elif kind == "adopted":
            self.heights[name] = max(self.heights.get(name, 0), int(event["height"]))
        elif kind == "stopped":
            self.stopped[name] = int(event["height"])
        elif kind == "exited":
            self.exited.add(name)
            if name not in self.killed and name not in self.stopped:
                self.fail(f"{name} exited without stopping cleanly (crashed or was killed)")
        for listener in list(self._listeners):
            listener(name, event)

    def wait(self, what: str, timeout_s: float, until: Callable[[], bool]) -> None:
        """Take events until ``until()`` holds; fail naming ``what`` after ``timeout_s``."""
        for name, event in self.network.next_events(timeout_s, until=until):
            self._take(name, event)
        if not until():
            self.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def wait_until(
        self, what: str, timeout_s: float, until: Callable[[], bool], poll_s: float = 0.25
    ) -> None:
        """:meth:`wait` for a condition on more than the events (a status, a log): it is
        checked again at least every ``poll_s`` seconds, events or not."""
        deadline = time.monotonic() + timeout_s
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
            for name, event in self.network.next_events(min(poll_s, left), until=until):
                self._take(name, event)

    def watch(self, seconds: float) -> None:
        """Take the nodes' events for ``seconds`` (a fault held that long), failing at once
        if a node exits unbidden."""
        end = time.monotonic() + seconds
        for name, event in self.network.next_events(seconds, until=lambda: time.monotonic() >= end):
            self._take(name, event)

    def wait_ready(self, names: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> None:
        nodes = self.network.nodes
        self.wait(
            f"{', '.join(names)} to be ready",
            timeout_s,
            lambda: all(nodes[n].ready is not None for n in names),
        )

    def wait_height(self, name: str, height: int, timeout_s: float) -> None:
        self.wait(
            f"{name} to adopt height {height}",
            timeout_s,
            lambda: self.heights.get(name, 0) >= height,
        )

    def wait_exits(self, names: Sequence[str], timeout_s: float) -> None:
        self.wait(
            f"{', '.join(names)} to stop by themselves",
            timeout_s,
            lambda: self.exited.issuperset(names),
        )

    def wait_event(
        self, what: str, timeout_s: float, match: Callable[[str, Event], bool]
    ) -> tuple[str, Event]:
        """The first event from now on for which ``match(name, event)`` holds."""
        found: list[tuple[str, Event]] = []

        def listener(name: str, event: Event) -> None:
            if not found and match(name, event):
                found.append((name, event))

        self._listeners.append(listener)
        try:
            self.wait(what, timeout_s, lambda: bool(found))
        finally:
            self._listeners.remove(listener)
        return found[0]

    # -- diagnosis ------------------------------------------------------------------------

    def note(self, line: str) -> None:
        """Add ``line`` (a random seed, when a fault began) to every failure message."""
        self.notes.append(line)

    def log(self, name: str) -> list[str]:
        """The lines of ``name``'s log (every life of it) so far."""
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        parts = []
        for log in sorted((self.workdir / "logs").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts)

    def diagnosis(self) -> str:
        heights = ", ".join(f"{n}={h}" for n, h in sorted(self.heights.items()))
        running = [n for n in self.roles if n not in self.exited]
        stopped = ", ".join(f"{n} at {h}" for n, h in sorted(self.stopped.items()))
        notes = "".join(f"{line}\n" for line in self.notes)
        paused = f"; paused: {', '.join(sorted(self.paused))}" if self.paused else ""
        return (
            notes + f"heights adopted: {heights}\n"
            f"running: {', '.join(running) or '-'}; stopped: {stopped or '-'}; "
            f"killed: {', '.join(sorted(self.killed)) or '-'}{paused}\n"
            + self._open_windows()
            + "last events:\n  "
            + "\n  ".join(self._recent)
            + "\n"
            + self.log_tails()
        )

    def _open_windows(self) -> str:
        """What each running node's status.json says about its open window."""
        lines = []
        for name in self.roles:
            if name in self.exited:
                continue
            try:
                status = self.status(name)
            except (OSError, ValueError):
                continue
            window = status.get("open_window") or {}
            reason = str(window.get("reason"))[:300]
            lines.append(f"  {name} at {status.get('height')}: {reason}")
        return "open windows (status.json):\n" + "\n".join(lines) + "\n" if lines else ""

    def fail(self, message: str) -> None:
        raise AssertionError(f"{message}\n{self.diagnosis()}")

    def check(self, condition: bool, message: str) -> None:
        """``assert condition``, with the network's diagnosis when it fails."""
        if not condition:
            self.fail(message)

    # -- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """SIGINT every node, SIGKILL what is left, reap every process ever started."""
        for name in list(self.paused):  # a stopped process would not see the SIGINT
            self.resume(name)
        try:
            self.network.stop(timeout_s=STOP_TIMEOUT_S)
        finally:
            for node in self.processes:
                if node.process.poll() is None:
                    node.process.send_signal(signal.SIGKILL)
            # before the pipes are closed: a straggler holding one open would block it forever
            kill_stragglers(self.workdir)
            for node in self.processes:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                    continue
                if node.stdout is not None:
                    node.stdout.close()


def kill_stragglers(workdir: Path) -> None:
    """SIGKILL the processes that outlived the node that started them, found by ``workdir``
    in their command line: a pod's ranks run in sessions of their own and hold the node's
    stdout pipe open; a rank ends itself once its torchrun is killed, but not a rank a test
    stopped (SIGSTOP) and failed before it let it go."""
    marker = f"{workdir}/".encode()  # its nodes' directories, not a sibling's
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


# -- what a stopped node's data directory holds --------------------------------------------


def stored_chain(data_dir: Path) -> list[tuple[Head, QuorumCertificate]]:
    """The certified heads a stopped node stored, in height order (genesis excluded)."""
    with DataDir(data_dir) as datadir:
        store = NodeStore(datadir)
        experiment_id = store.experiment_id()
        assert experiment_id is not None, f"{data_dir} follows no experiment"
        return store.links(experiment_id)


def stored_records(data_dir: Path, kind: str, record_type: type[R]) -> dict[str, R]:
    """The signed records of ``kind`` (``update``, ``proposal``) a stopped node kept, by id."""
    with StateStore(data_dir / "node.db") as state:
        rows = state.records(kind)
    return {record_id: open_envelope(raw, record_type).record for record_id, raw in rows}


def check_one_tip(net: Net, height: int) -> dict[str, tuple[int, str, str]]:
    """Every node's stored tip agrees with its status.json, and all nodes end on one head
    (and weights) at ``height``; returns each node's (height, head id, weights blob)."""
    tips = {}
    for name in net.names():
        head, _certificate = stored_chain(net.data_dir(name))[-1]
        status = net.status(name)
        net.check(
            (status["height"], status["head_id"]) == (head.height, head.id),
            f"{name}'s status.json and stored chain name other heads",
        )
        tips[name] = (head.height, head.id, head.weights_blob)
    net.check(
        len(set(tips.values())) == 1 and tips["seed"][0] == height,
        f"every node should end on one head (and weights) at height {height}: {tips}",
    )
    return tips


def genesis_and_tip(data_dir: Path) -> tuple[dict[str, torch.Tensor], int, dict[str, torch.Tensor]]:
    """The genesis weights, and the height and weights of the verified tip, of a stopped
    node's data directory."""
    manifest, _experiment, height, _head, weights = canonical_weights(data_dir)
    with DataDir(data_dir) as datadir:
        blob = datadir.blobs.get(manifest.genesis_weights)
        genesis = decode_state_dict(blob, expected_schema=manifest.workload.schema_hash)
    return genesis, height, weights


def new_net(workdir: Path) -> Net:
    return Net(workdir, verbose=bool(os.environ.get(VERBOSE_ENV)))


def lone_seed(workdir: Path) -> Iterator[Net]:
    """The body of a module fixture: a :class:`Net` in ``workdir`` running only the seed of
    a tiny experiment (its data directory ``workdir / "seed"``), stopped and reaped at the
    end (for tests of joining and of data directories, which need nobody else)."""
    net = new_net(workdir)
    try:
        path = net.write_experiment(validators=["validator-0"], quorum=1, max_updates=1)
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        yield net
    finally:
        net.close()


@pytest.fixture
def local_net(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Net]:
    """A :class:`Net` in ``tmp_path``; every process is stopped and reaped at the end, and
    when the test failed the events and the tail of every node's log are printed."""
    yield from reaped(lambda: new_net(tmp_path), request)


def reaped(start: Callable[[], Net], request: pytest.FixtureRequest) -> Iterator[Net]:
    """The body of a network fixture: the :class:`Net` ``start`` gives, stopped and reaped
    at the end, with the events and the tail of every node's log printed when a test of the
    fixture's scope failed."""
    failed_before = request.session.testsfailed
    net = start()
    try:
        yield net
    finally:
        net.close()
        if request.session.testsfailed > failed_before:
            print(f"network of {request.node.name}:\n{net.diagnosis()}")
