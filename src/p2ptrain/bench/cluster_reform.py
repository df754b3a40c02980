"""How long a home cluster takes to train again after losing a member or its leader.

:func:`reform_seconds` starts three ``p2ptrain cluster`` members (each in a network
namespace of a :class:`~p2ptrain.bench.netns_lab.NamespaceLab` where this process may make
them, finding each other by mDNS over the lab's bridge; otherwise on loopback, where they
find each other through ``--peer``), waits until all three train, SIGKILLs one (the leader,
or the member of the last rank) and returns the seconds from the kill to the first step a
survivor completes in the next generation: detecting the loss (a collective that breaks or
times out), probing, electing, meeting at the leader's store, broadcasting the state, and
one step.

The members train the built-in ``char-gpt`` at its smallest (one layer, width 16, a batch
of 4) on one thread each, with the command's defaults otherwise (30 s collective timeout,
fp16 compression). Every wait has a deadline; every member is stopped and reaped on every
way out; a member's stderr goes to ``work_dir/<member>.log``, quoted when it fails.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from p2ptrain.bench.children import child_env, log_tail
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.errors import LocalError

__all__ = ["reform_seconds"]

_HOSTS = ("m1", "m2", "m3")
_TINY = ("n_layer=1", "n_embd=16", "n_head=2", "block_size=16", "batch_size=4", "val_blocks=8")
_LOOPBACK = "127.0.0.1"
_WAIT_S = 120.0  # starting, training, and the re-form (a 30 s collective timeout included)
_STOP_S = 10.0
_STEPS_BEFORE_KILL = 5
_MAX_LINE = 1 << 20

Event = dict[str, Any]


class _Members:
    """The members' processes and their JSON lines, merged into one queue."""

    def __init__(self, work_dir: Path, secret: Path) -> None:
        self.work_dir, self.secret = work_dir, secret
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, list[Event]] = {}
        self.killed: set[str] = set()
        self._lines: queue.Queue[tuple[str, bytes]] = queue.Queue()

    def start(self, name: str, prefix: Sequence[str], host: str, *options: str) -> None:
        command = [*prefix, sys.executable, "-m", "p2ptrain", "cluster", "--json"]
        command += ["--dir", str(self.work_dir / name), "--secret-file", str(self.secret)]
        command += ["--host", host, "--wait-for", str(len(_HOSTS)), "--discovery-s", "1"]
        command += [f"--config={pair}" for pair in _TINY] + list(options)
        env = {k: v for k, v in child_env().items() if k != "GLOO_SOCKET_IFNAME"}
        with (self.work_dir / f"{name}.log").open("wb") as log:
            try:
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                    env=env, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                raise LocalError(f"cannot start cluster member {name}: {exc}") from exc
        self.processes[name] = process
        self.events[name] = []
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(name, process.stdout), daemon=True).start()

    def _read(self, name: str, stream: IO[bytes]) -> None:
        with stream:
            for line in iter(lambda: stream.readline(_MAX_LINE), b""):
                self._lines.put((name, line))
        self._lines.put((name, b""))

    def wait_until(self, condition: Callable[[], bool], what: str, deadline: float) -> None:
        while not condition():
            try:
                name, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LocalError(f"cluster bench: no {what} within {_WAIT_S:g} s") from None
            if not line and name in self.killed:
                continue
            if not line:
                code = self.processes[name].wait()
                raise LocalError(
                    f"cluster member {name} exited ({code}) before {what}; "
                    f"{log_tail(self.work_dir / f'{name}.log')}"
                )
            try:
                self.events[name].append(json.loads(line))
            except ValueError:
                raise LocalError(f"cluster member {name} printed {line[:200]!r}") from None

    def of(self, name: str, kind: str) -> list[Event]:
        return [e for e in self.events[name] if e.get("event") == kind]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=_STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def reform_seconds(kill: Literal["member", "leader"], *, work_dir: Path) -> float:
    """Seconds from SIGKILLing a member (``kill="member"``: the last rank's) or the leader
    of a training three-member cluster to the first step the survivors complete after."""
    if kill not in ("member", "leader"):
        raise LocalError(f"kill must be 'member' or 'leader', got {kill!r}")
    work_dir.mkdir(parents=True, exist_ok=True)
    secret = work_dir / "cluster.secret"
    secret.write_text("p2ptrain cluster bench secret, not a real one\n")
    members = _Members(work_dir, secret)
    if namespaces_unavailable() is not None:
        try:
            _start_on_loopback(members)
            return _measure(members, kill)
        finally:
            members.stop()
    try:
        lab = NamespaceLab(_HOSTS)
    except OSError as exc:
        raise LocalError(f"cannot build the namespace lab: {exc}") from exc
    with lab:
        try:
            for name in _HOSTS:
                members.start(name, lab.command_prefix(name), lab.address[name])
            return _measure(members, kill)
        finally:
            members.stop()  # before the lab goes, with the namespaces they run in


def _start_on_loopback(members: _Members) -> None:
    """The first member on a free port, the others told where it is (``--peer``)."""
    first, *others = _HOSTS
    members.start(first, (), _LOOPBACK, "--no-mdns")
    deadline = time.monotonic() + _WAIT_S
    members.wait_until(lambda: bool(members.of(first, "started")), "first member up", deadline)
    address = members.of(first, "started")[0]["address"]
    for name in others:
        members.start(name, (), _LOOPBACK, "--no-mdns", "--peer", address)


def _measure(members: _Members, kill: Literal["member", "leader"]) -> float:
    deadline = time.monotonic() + _WAIT_S
    names = list(members.processes)
    members.wait_until(
        lambda: all(members.of(n, "generation_formed") for n in names), "generation", deadline
    )
    formed = members.of(names[0], "generation_formed")[-1]
    generation = formed["generation"]

    def trained(name: str) -> int:
        return sum(1 for e in members.of(name, "step") if e["generation"] == generation)

    members.wait_until(
        lambda: all(trained(n) >= _STEPS_BEFORE_KILL for n in names), "training", deadline
    )
    peers = {members.of(n, "started")[0]["peer"]: n for n in names}
    target = formed["leader"] if kill == "leader" else formed["members"][-1]
    victim = peers[target]
    survivors = [n for n in names if n != victim]
    members.killed.add(victim)
    members.processes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()

    def stepped_again() -> bool:
        return any(e["generation"] > generation for n in survivors for e in members.of(n, "step"))

    members.wait_until(stepped_again, "step after the kill", killed + _WAIT_S)
    return time.monotonic() - killed
