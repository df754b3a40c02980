"""A whole network on one machine: every node its own OS process, on loopback.

``p2ptrain demo`` and the integration tests use this. It creates the validators' and
reducers' identities first (the experiment manifest names their keys), writes the
experiment definition, starts a seed that signs it, then starts the other nodes against the
seed. Each node runs ``python -m p2ptrain <role> --json`` (``p2ptrain node --role A --role
B`` for a node of several roles): its stdout is one JSON event per line, read back into
typed events (:mod:`p2ptrain.observe.events`) by a thread per process into one queue, which
ends each process's stream with an :class:`~p2ptrain.observe.events.Exited`; its stderr goes
to ``logs/<name>.log``.
Stopping sends SIGINT (a node stops cleanly) and escalates to SIGKILL only for a node that
does not exit in time. On Linux a node started from the main thread is also SIGKILLed by the
kernel when this process ends without stopping it (killed, crashed): :mod:`.parent_death`.

How a node's process starts is a :data:`Launcher`: by default a new interpreter
(:func:`start_process`); the demo, the chaos bench and the test suite pass
:func:`~p2ptrain.node.forked.fork_launcher`'s, which forks nodes from a server that has
imported torch and the node stack once (the same command, a fraction of the start-up).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from p2ptrain.errors import LocalError
from p2ptrain.node.parent_death import bound_to_this_process
from p2ptrain.observe.events import Exited, NodeEvent, Ready, decode_event
from p2ptrain.store.keyfile import create_identity, identity_path, load_identity

__all__ = [
    "ChildProcess",
    "Launcher",
    "LocalNetwork",
    "NodeProcess",
    "experiment_toml",
    "start_process",
]

_ROLE_COMMAND = {
    "seed": "seed",
    "trainer": "train",
    "validator": "validate",
    "reducer": "reduce",
    "viewer": "view",
}


class ChildProcess(Protocol):
    """What a network needs of a node's process (a :class:`subprocess.Popen` is one)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


#: Starts ``command`` with ``environment``, stdin from /dev/null, stdout to a pipe (returned
#: with the process) and stderr to ``log``, in a session of its own; ends it with this
#: process where it can.
Launcher = Callable[[Sequence[str], Mapping[str, str], IO[bytes]], tuple[ChildProcess, IO[bytes]]]


def start_process(
    command: Sequence[str], environment: Mapping[str, str], log: IO[bytes]
) -> tuple[ChildProcess, IO[bytes]]:
    """The default :data:`Launcher`: a new interpreter running ``command``."""
    process = subprocess.Popen(
        bound_to_this_process(command),  # it dies with us (Linux)
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        env=dict(environment),
        start_new_session=True,  # Ctrl-C in the terminal reaches us, not them
    )
    assert process.stdout is not None
    return process, process.stdout


@dataclass
class NodeProcess:
    name: str
    #: Its roles, the first one naming it (``seed``, ``trainer``, ...).
    roles: tuple[str, ...]
    data_dir: Path
    process: ChildProcess
    log: Path
    #: Its stdout (its JSON events), read by the network's thread for it.
    stdout: IO[bytes] | None = None
    ready: Ready | None = None

    @property
    def role(self) -> str:
        return self.roles[0]

    @property
    def address(self) -> str | None:
        return None if self.ready is None else self.ready.address

    @property
    def peer_id(self) -> str:
        return "" if self.ready is None else self.ready.peer_id

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the node can tell."""
        self.signal(signal.SIGKILL)
        self.process.wait()


def experiment_toml(
    *,
    validators: Sequence[str],
    reducers: Sequence[str],
    quorum: int,
    workload: Mapping[str, Any],
    inner_steps: int,
    deadline_s: float,
    proposal_s: float,
    min_updates: int,
    max_updates: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    inner_lr: float = 1e-3,
    inner_schedule: Mapping[str, Any] | None = None,
    aggregate_precision: str = "fp32",
    codec: str = "int8",
    codec_config: Mapping[str, float] | None = None,
    rule: str | None = None,
    outer: str = "nesterov",
    study: str = "demo",
    name: str = "shakespeare",
    staleness: int = 0,
) -> str:
    """An experiment definition for a registered workload (the seed fills in the dataset,
    schema hash, genesis weights and lease size). ``inner_schedule``: the inner learning
    rate's schedule keys of ``[inner_optimizer]`` (``schedule``, ``decay_windows``, ...);
    ``aggregate_precision``: ``aggregation.precision``; ``codec``: the update codec, with
    ``codec_config`` its settings; ``rule``: the aggregation rule (None: the manifest's
    default); ``outer``: ``nesterov`` or ``sgd`` (then ``outer_momentum`` must be 0)."""
    config = ", ".join(f"{k} = {json.dumps(v)}" for k, v in workload["config"].items())
    schedule = [f"{k} = {json.dumps(v)}" for k, v in (inner_schedule or {}).items()]
    lines = [
        f'study = "{study}"',
        f'name = "{name}"',
        f"inner_steps = {inner_steps}",
        f"validators = {json.dumps(sorted(validators))}",
        f"reducers = {json.dumps(sorted(reducers))}",
        f"quorum = {quorum}",
        "",
        "[workload]",
        f'name = "{workload["name"]}"',
        f"config = {{ {config} }}",
        "",
        "[inner_optimizer]",
        'name = "adamw"',
        f"lr = {inner_lr!r}",
        *schedule,
        "",
        "[outer_optimizer]",
        f'name = "{outer}"',
        f"lr = {outer_lr!r}",
        f"momentum = {outer_momentum!r}",
        "",
        "[window]",
        f"deadline_s = {float(deadline_s)!r}",
        f"proposal_s = {float(proposal_s)!r}",
        f"min_updates = {min_updates}",
        f"max_updates = {max_updates}",
        f"staleness = {staleness}",
        "",
        "[aggregation]",
        f'precision = "{aggregate_precision}"',
        *([] if rule is None else [f'rule = "{rule}"']),
        "",
        "[codec]",
        f'name = "{codec}"',
        *(
            []
            if not codec_config
            else ["config = { " + ", ".join(f"{k} = {v!r}" for k, v in codec_config.items()) + " }"]
        ),
        "",
    ]
    return "\n".join(lines)


def seconds_per_step(workload: Any) -> float:
    """A few inner steps of ``workload`` timed on one thread (one warm-up step first)."""
    import torch

    torch.set_num_threads(1)
    weights = workload.initial_weights()
    samples = workload.dataset_manifest().total_samples
    indices = list(range(max(1, min(workload.batch_size * 4, samples))))
    workload.train_window(weights, indices, steps=1, seed=0)
    started = time.perf_counter()
    workload.train_window(weights, indices, steps=3, seed=1)
    return (time.perf_counter() - started) / 3


def window_seconds(
    step_s: float, inner_steps: int, trainers: int, cores: int = 2
) -> tuple[float, float]:
    """(a window's training seconds, its deadline) for ``trainers`` sharing ``cores``: the
    deadline leaves room for a slow window (three times the training, plus 15 s, at least
    30 s) before the network gives up on a trainer."""
    train_s = inner_steps * step_s * max(1.0, trainers / cores)
    return train_s, round(max(30.0, 3 * train_s + 15), 1)


class LocalNetwork:
    """Processes of one local network, their events, and their orderly end."""

    def __init__(
        self, workdir: Path, *, python: str = sys.executable, launch: Launcher = start_process
    ) -> None:
        self.workdir = workdir
        self.python = python
        self.launch = launch
        self.events: queue.Queue[tuple[str, NodeEvent]] = queue.Queue()
        self.nodes: dict[str, NodeProcess] = {}
        self.seed: NodeProcess | None = None
        self.experiment_id: str | None = None
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    # -- identities and the experiment ---------------------------------------------------

    def identity(self, name: str) -> str:
        """Create (or read) the node's identity; return its public key (hex)."""
        directory = self.workdir / name
        if identity_path(directory).exists():
            return load_identity(directory).public_key.hex()
        return create_identity(directory).public_key.hex()

    def write_experiment(self, text: str) -> Path:
        path = self.workdir / "experiment.toml"
        path.write_text(text)
        return path

    # -- processes ------------------------------------------------------------------------

    def start(
        self,
        name: str,
        role: str | Sequence[str],
        *,
        args: Sequence[str] = (),
        listen: bool | None = None,
        windows: int | None = None,
        env: Mapping[str, str] | None = None,
        program: Sequence[str] | None = None,
        bootstrap: Sequence[str] | None = None,
    ) -> NodeProcess:
        """Start a node (the seed first) of one role or several; it is ready once
        :meth:`wait_ready` says so. ``program`` replaces ``python -m p2ptrain`` (a program
        that takes the same arguments); ``bootstrap`` replaces the seed's address as the
        peers a joining node asks first, in that order."""
        roles = (role,) if isinstance(role, str) else tuple(role)
        command = list(program or [self.python, "-m", "p2ptrain"])
        if len(roles) == 1:
            command += [_ROLE_COMMAND[roles[0]], "--json"]
        else:
            command += ["node", "--json", *(f"--role={r}" for r in roles)]
        command += ["--dir", str(self.workdir / name)]
        if listen is None:
            listen = any(r not in ("trainer", "viewer") for r in roles)
        command += ["--listen", "127.0.0.1:0" if listen else "none"]
        if "seed" not in roles:
            if self.seed is None or self.seed.address is None or self.experiment_id is None:
                raise LocalError("start the seed (and wait until it is ready) first")
            for address in [self.seed.address] if bootstrap is None else bootstrap:
                command += ["--bootstrap", address]
            command += ["--experiment", self.experiment_id]
        if windows is not None:
            command += ["--until-height", str(windows)]
        command += list(args)
        log = self.workdir / "logs" / f"{name}.log"
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "ab") as log_file:
            process, stdout = self.launch(command, environment, log_file)
        node = NodeProcess(name, roles, self.workdir / name, process, log, stdout)
        self.nodes[name] = node
        threading.Thread(
            target=self._read, args=(name, stdout), name=f"events-{name}", daemon=True
        ).start()
        if "seed" in roles:
            self.seed = node
        return node

    def _read(self, name: str, stream: IO[bytes]) -> None:
        for line in stream:
            event = decode_event(line)
            if event is not None:
                self.events.put((name, event))
        code = self.nodes[name].process.wait()
        self.events.put((name, Exited(peer_id=self.nodes[name].peer_id, returncode=code)))

    def wait_ready(self, names: Sequence[str], timeout_s: float = 120.0) -> None:
        """Wait for each named node's ``ready`` event (the seed's also names the experiment)."""
        waiting = {n for n in names if self.nodes[n].ready is None}
        for name, event in self.next_events(timeout_s, until=lambda: not waiting):
            if isinstance(event, Ready) and name in waiting:
                self.nodes[name].ready = event
                waiting.discard(name)
                if "seed" in self.nodes[name].roles:
                    self.experiment_id = event.experiment_id
            elif isinstance(event, Exited) and name in waiting:
                raise LocalError(
                    f"node {name} exited before it was ready; see {self.nodes[name].log}"
                )
        if waiting:
            raise LocalError(f"nodes {sorted(waiting)} not ready after {timeout_s:.0f} s")

    def next_events(self, timeout_s: float, until: Any = None) -> Iterator[tuple[str, NodeEvent]]:
        """Events as they come, until ``until()`` is true (asked at each event, and at least
        every second) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while until is None or not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                yield self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue

    # -- the end --------------------------------------------------------------------------

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 20.0) -> None:
        """SIGINT, then SIGKILL whoever is still running after ``timeout_s``."""
        chosen = [self.nodes[n] for n in (names or list(self.nodes))]
        for node in chosen:
            node.signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for node in chosen:
            try:
                node.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.kill()

    def __enter__(self) -> LocalNetwork:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
