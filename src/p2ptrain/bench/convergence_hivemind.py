"""The hivemind system of ``p2ptrain bench convergence``: its peers, started and reaped.

hivemind lives in a virtual environment of its own (``make bench-anchors`` makes
``.venv-anchors``: the same torch, hivemind pinned, this project), so this module never
imports it: it runs :mod:`p2ptrain.bench.hivemind_peer` with that interpreter, one process
per worker, each on its host of a :class:`~p2ptrain.bench.convergence_task.Placement`.

:func:`run_hivemind` starts rank 0, reads the line on which it says it is up (with its
multiaddrs), starts the other ranks with rank 0 as their initial peer, reads theirs, then
says go to every peer at once, so that none trains alone while the others still start. Every
peer gets a session (and process group) of its own, so that ending a peer also ends
hivemind's processes under it and its ``p2pd`` daemon: whatever happens (an error, a peer
that fails, the time limit), every group is killed and every peer reaped before
:func:`run_hivemind` returns or raises, so the caller's ``getrusage(RUSAGE_CHILDREN)``
counts the peers' CPU (all of what a peer reaped itself; a ``p2pd`` that outlived its peer
is killed, not counted).

Whether the peers really averaged is read from what they wrote: at every epoch each peer
records a probe of its weights right after the average
(:func:`~p2ptrain.bench.hivemind_peer.weights_probe`), and :attr:`HivemindRun.averaged_epochs`
counts the epochs at which every peer held the same weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from p2ptrain.bench.children import log_tail
from p2ptrain.bench.convergence_task import (
    Placement,
    Task,
    WorkerRun,
    rank_directory,
    read_done,
)
from p2ptrain.bench.hivemind_peer import EPOCHS_FILE, GO_LINE, PROBE_TOLERANCE, READY_PREFIX
from p2ptrain.errors import LocalError

__all__ = [
    "ANCHORS_VENV",
    "HIVEMIND_VERSION",
    "PYTHON_ENV",
    "HivemindRun",
    "averaged_epochs",
    "hivemind_python",
    "hivemind_python_candidate",
    "hivemind_unavailable",
    "run_hivemind",
]

#: The environment variable naming the anchors interpreter.
PYTHON_ENV: Final = "P2PTRAIN_HIVEMIND_PYTHON"
#: Where ``make bench-anchors`` puts the anchors' virtual environment (under the checkout).
ANCHORS_VENV: Final = ".venv-anchors"
#: The hivemind release the peer is written for (``make bench-anchors`` installs it): the
#: peer reads one of its internals (the progress tracker's throughput estimate).
HIVEMIND_VERSION: Final = "1.1.12"

_MAKE_HINT = "run `make bench-anchors`"
_CHECK_TIMEOUT_S = 120.0
_JOIN_TIMEOUT_S = 5.0
# Imports what a peer imports, and says what failed, as one JSON line.
_CHECK = """
import importlib, json
errors = {}
version = None
for name in ("hivemind", "p2ptrain.bench.hivemind_peer"):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
    else:
        version = getattr(module, "__version__", version)
print(json.dumps({"errors": errors, "version": version}))
"""


def hivemind_python_candidate(explicit: str | None) -> str:
    """The anchors interpreter to try: ``explicit``, else ``$P2PTRAIN_HIVEMIND_PYTHON``,
    else ``.venv-anchors/bin/python`` under the current directory. The path is made
    absolute but not resolved: a virtual environment's ``python`` is a link to the base
    interpreter, and resolving it would leave the environment."""
    chosen = explicit or os.environ.get(PYTHON_ENV) or str(Path(ANCHORS_VENV) / "bin" / "python")
    return os.path.abspath(chosen)


def hivemind_unavailable(python: str) -> str | None:
    """Why ``python`` cannot run a hivemind peer, or None when it can: it must exist and
    import hivemind (:data:`HIVEMIND_VERSION`) and this project."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        return f"the hivemind interpreter {python} does not exist: {_MAKE_HINT}"
    try:
        done = subprocess.run(
            [python, "-c", _CHECK],
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the hivemind interpreter {python} does not run ({exc}): {_MAKE_HINT}"
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        errors: dict[str, str] = report["errors"]
        version = report["version"]
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (done.stderr.strip() or done.stdout.strip())[-300:]
        return (
            f"the hivemind interpreter {python} failed to report what it has (exit "
            f"{done.returncode}: {tail!r}): {_MAKE_HINT}"
        )
    if "hivemind" in errors:
        return f"hivemind is not installed in {python} ({errors['hivemind']}): {_MAKE_HINT}"
    if errors:
        problem = next(iter(errors.values()))
        return f"p2ptrain is not installed in {python} ({problem}): {_MAKE_HINT}"
    if version != HIVEMIND_VERSION:
        return (
            f"{python} has hivemind {version}, the bench's peer is written for "
            f"{HIVEMIND_VERSION}: {_MAKE_HINT}"
        )
    return None


def hivemind_python(explicit: str | None) -> str | None:
    """The anchors interpreter (see :func:`hivemind_python_candidate`) if it can run a peer,
    else None; :func:`hivemind_unavailable` of the candidate says why."""
    candidate = hivemind_python_candidate(explicit)
    return candidate if hivemind_unavailable(candidate) is None else None


@dataclass(frozen=True)
class HivemindRun(WorkerRun):
    """What one run of the hivemind peers left (rank 0's snapshots: genesis, then every
    epoch; ``inner_seconds`` include hivemind's averaging), and per rank:"""

    #: The epoch each rank ended at.
    epochs: list[int]
    #: Local steps each rank took.
    steps: list[int]
    #: Epochs at whose end every peer held the same weights (averaged, see the module).
    averaged_epochs: int


class _Peers:
    """The peer processes of one run. Per peer, one thread forwards its stdout lines to
    :attr:`events` as ``(rank, line, None)`` and another waits for it to exit and puts
    ``(rank, None, status)``."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen[str]] = {}
        self.events: queue.Queue[tuple[int, str | None, int | None]] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self, rank: int, argv: list[str], log: Path) -> None:
        with log.open("w") as log_file:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        self.processes[rank] = process
        for target in (self._forward, self._wait):
            thread = threading.Thread(
                target=target, args=(rank, process), daemon=True, name=f"hivemind-rank{rank}"
            )
            thread.start()
            self._threads.append(thread)

    def _forward(self, rank: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.events.put((rank, line.rstrip("\n"), None))

    def _wait(self, rank: int, process: subprocess.Popen[str]) -> None:
        self.events.put((rank, None, process.wait()))

    def next_event(self, deadline: float) -> tuple[int, str | None, int | None] | None:
        """The next line or exit of any peer, or None once ``deadline`` has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            return self.events.get(timeout=remaining)
        except queue.Empty:
            return None

    def say_go(self) -> None:
        for process in self.processes.values():
            assert process.stdin is not None
            # A peer that died since it said ready: its exit event tells.
            with contextlib.suppress(BrokenPipeError):
                process.stdin.write(GO_LINE + "\n")
                process.stdin.close()

    def end_all(self) -> None:
        """Kill what is left of every peer's process group and reap every peer."""
        for process in self.processes.values():
            # ProcessLookupError: the whole group has exited already.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes.values():
            process.wait()
        for thread in self._threads:
            # Bounded: a reader waits for the end of its peer's stdout, which a process
            # that left the peer's group could still hold.
            thread.join(timeout=_JOIN_TIMEOUT_S)
        for process in self.processes.values():
            for stream in (process.stdin, process.stdout):
                if stream is not None and not stream.closed:
                    with contextlib.suppress(OSError):
                        stream.close()


class _Launch:
    """One run of the peers: where each runs, its command line, its log, the deadline."""

    def __init__(
        self,
        task: Task,
        workdir: Path,
        placement: Placement,
        hosts: Sequence[str],
        *,
        python: str,
        timeout_s: float,
        verbose: bool,
    ) -> None:
        self.task, self.workdir, self.placement, self.hosts = task, workdir, placement, hosts
        self.python, self.timeout_s, self.verbose = python, timeout_s, verbose
        self.logs = [workdir / f"rank{rank}.log" for rank in range(task.workers)]
        self.addresses = [placement.host_address(host) for host in hosts]
        self.peers = _Peers()
        self.deadline = time.monotonic() + timeout_s

    def where(self, rank: int) -> str:
        return f"hivemind peer rank {rank} (host {self.hosts[rank]}, {self.addresses[rank]})"

    def failed(self, rank: int, problem: str) -> LocalError:
        return LocalError(f"{self.where(rank)} {problem}; {log_tail(self.logs[rank])}")

    def start(self, rank: int, initial: Sequence[str]) -> None:
        argv = [*self.placement.command_prefix(self.hosts[rank]), self.python]
        argv += ["-m", "p2ptrain.bench.hivemind_peer", "--task", self.task.to_json()]
        argv += ["--rank", str(rank), "--host", self.addresses[rank]]
        argv += ["--out", str(self.workdir), "--wait-for-go"]
        if initial:
            argv += ["--initial-peers", *initial]
        if self.verbose:
            argv.append("--verbose")
        try:
            self.peers.start(rank, argv, self.logs[rank])
        except OSError as exc:
            raise LocalError(
                f"{self.where(rank)} did not start ({' '.join(argv[:3])} ...): {exc}; check "
                f"that {self.python} exists (`make bench-anchors`) and the placement's tools"
            ) from exc

    def await_ready(self, ranks: set[int]) -> dict[int, list[str]]:
        """Each of ``ranks``' multiaddrs, once it says it is up."""
        ready: dict[int, list[str]] = {}
        while len(ready) < len(ranks):
            event = self.peers.next_event(self.deadline)
            if event is None:
                late = min(ranks - ready.keys())
                raise self.failed(late, f"did not come up within the run's {self.timeout_s:.0f} s")
            rank, line, code = event
            if line is None:
                raise self.failed(rank, f"exited (status {code}) before it was up")
            if rank not in ranks or not line.startswith(READY_PREFIX):
                continue
            try:
                maddrs = json.loads(line[len(READY_PREFIX) :])
            except ValueError:
                maddrs = None
            if not isinstance(maddrs, list) or not maddrs:
                raise self.failed(rank, f"said it was up without a multiaddr to dial: {line!r}")
            ready[rank] = [str(maddr) for maddr in maddrs]
        return ready

    def await_exit(self) -> None:
        """Until every peer has exited with status 0."""
        running = set(self.peers.processes)
        while running:
            event = self.peers.next_event(self.deadline)
            if event is None:
                others = f" (and {len(running) - 1} more)" if len(running) > 1 else ""
                raise self.failed(
                    min(running), f"had not finished{others} within {self.timeout_s:.0f} s"
                )
            rank, line, code = event
            if line is not None:
                continue
            running.discard(rank)
            if code != 0:
                raise self.failed(rank, f"failed (status {code})")

    def collect(self, launched: float, ended: float) -> HivemindRun:
        rank_dirs = [rank_directory(self.workdir, rank) for rank in range(self.task.workers)]
        done = []
        records = []
        for rank, directory in enumerate(rank_dirs):
            record = read_done(directory)
            epochs_path = directory / EPOCHS_FILE
            if record is None or not epochs_path.is_file():
                raise self.failed(
                    rank, f"exited without writing {directory}/done.json and {EPOCHS_FILE}"
                )
            done.append(record)
            records.append(json.loads(epochs_path.read_text()))
        return HivemindRun(
            launched=launched,
            ended=ended,
            snapshots=rank_dirs[0],
            rank_dirs=rank_dirs,
            logs=self.logs,
            inner_seconds=[float(record["inner_seconds"]) for record in done],
            epochs=[int(record["epochs"]) for record in done],
            steps=[int(record["steps"]) for record in done],
            averaged_epochs=averaged_epochs(records),
        )


def run_hivemind(
    task: Task,
    workdir: Path,
    placement: Placement,
    hosts: Sequence[str],
    *,
    python: str,
    timeout_s: float,
    verbose: bool = False,
) -> HivemindRun:
    """Train ``task`` with hivemind: rank ``r`` on ``hosts[r]`` of ``placement``, everything
    under ``workdir`` (``rank<r>/`` and ``rank<r>.log``). Returns once every peer exited;
    raises :class:`LocalError` naming the peer and the end of its log if one failed, or if
    the peers had not finished after ``timeout_s`` seconds (start-up included). With
    ``verbose``, hivemind logs every epoch and averaging round to the peers' logs."""
    if len(hosts) != task.workers:
        raise LocalError(
            f"the hivemind run needs one host per worker: {task.workers} workers, "
            f"{len(hosts)} hosts ({', '.join(hosts)})"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    launch = _Launch(
        task, workdir, placement, hosts, python=python, timeout_s=timeout_s, verbose=verbose
    )
    launched = time.time()
    try:
        launch.start(0, [])
        first = launch.await_ready({0})[0]
        for rank in range(1, task.workers):
            launch.start(rank, first)
        launch.await_ready(set(range(1, task.workers)))
        launch.peers.say_go()
        launch.await_exit()
    finally:
        launch.peers.end_all()
    return launch.collect(launched, time.time())


def averaged_epochs(records: Sequence[Sequence[dict[str, Any]]]) -> int:
    """How many epochs every rank recorded with the same weights (probes within
    :data:`~p2ptrain.bench.hivemind_peer.PROBE_TOLERANCE` of rank 0's); ``records[r]`` is
    rank ``r``'s ``epochs.json``."""
    by_rank = [{int(entry["epoch"]): entry["probe"] for entry in entries} for entries in records]
    if not by_rank:
        return 0
    count = 0
    for epoch, reference in by_rank[0].items():
        probes = [ranked.get(epoch) for ranked in by_rank[1:]]
        if all(
            probe is not None
            and len(probe) == len(reference)
            and all(abs(a - b) <= PROBE_TOLERANCE for a, b in zip(probe, reference, strict=True))
            for probe in probes
        ):
            count += 1
    return count
