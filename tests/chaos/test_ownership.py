"""Owning what you start: one node per data directory, and a demo that takes its nodes with it.

* A running node holds its data directory: a second node on it exits 2 with one line naming
  the holder's pid, and ``p2ptrain demo`` refuses to wipe a work dir where a node runs.
* ``p2ptrain demo`` stopped by SIGTERM once its nodes are ready stops them before it exits;
  SIGKILLed, it takes them with it (it forks them from a server of its own, and each
  watches a pipe only the demo holds: :mod:`p2ptrain.node.forked`): either way no node of
  it is alive 10 s later.
* A seed restarted with another experiment definition, and a node given a read-only data
  directory, exit 2 with one line saying what to do.
* A child bound to its parent (:func:`~p2ptrain.node.parent_death.bound_to_this_process`)
  dies when the parent is SIGKILLed.

Every process started here is reaped by a fixture, and every wait is for an event (a line
read, a pidfd that became readable) bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.node.parent_death import guards_children
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, prepare
from p2ptrain.store.datadir import DataDir, check_not_in_use
from tests.support.local_net import Net, lone_seed, new_net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

#: A demo that would run for long: it is stopped once its nodes are ready.
DEMO_ARGS = ["--windows", "1000", "--trainers", "2", "--inner-steps", "1", "--no-baseline"]
#: A seed, a reducer, 3 validators and 2 trainers.
DEMO_NODES = 7
DEMO_READY_S = 120.0
#: The figure to meet: no node of a stopped or killed demo is alive this long after.
GONE_WITHIN_S = 10.0
COMMAND_TIMEOUT_S = 60.0
EXPERIMENT_ID = re.compile(r"[0-9a-f]{64}")

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal and pidfds are Linux's"
)


def p2ptrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if k != "P2PTRAIN_DIR"},
        check=False,
    )


def the_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed: it exited 2, without a traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (
        f"rc {result.returncode}, stderr:\n{result.stderr}"
    )
    assert lines[0].startswith("p2ptrain: error: "), lines[0]
    return lines[0]


def wait_gone(pidfds: dict[int, int], timeout_s: float) -> list[int]:
    """Wait until every process (pid -> pidfd) ended; return the pids still alive then."""
    waiting = dict(pidfds)
    deadline = time.monotonic() + timeout_s
    while waiting and (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select(list(waiting.values()), [], [], left)
        waiting = {pid: fd for pid, fd in waiting.items() if fd not in readable}
    return sorted(waiting)


def kill_and_close(pidfds: dict[int, int]) -> None:
    for fd in pidfds.values():
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)


# -- one node per data directory ------------------------------------------------------------


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    """A running seed of a tiny experiment, in ``net.workdir / "seed"``."""
    yield from lone_seed(tmp_path_factory.mktemp("ownership"))


def test_a_second_node_on_a_data_directory_in_use_exits_2_naming_the_holder(seed: Net) -> None:
    holder = seed.network.nodes["seed"]
    assert holder.address is not None and seed.network.experiment_id is not None
    result = p2ptrain(
        "train",
        "--dir",
        str(holder.data_dir),
        "--experiment",
        seed.network.experiment_id,
        "--bootstrap",
        holder.address,
    )
    assert the_error(result) == (
        f"p2ptrain: error: data directory {holder.data_dir} is in use by pid "
        f"{holder.process.pid} (another p2ptrain node); stop it or use another --dir"
    )
    assert holder.alive()


def test_the_demo_refuses_a_work_dir_where_a_node_runs(seed: Net) -> None:
    holder = seed.network.nodes["seed"]
    result = p2ptrain("demo", "--workdir", str(seed.workdir), *DEMO_ARGS)
    assert the_error(result) == (
        f"p2ptrain: error: the work dir {seed.workdir} holds the data directory "
        f"{holder.data_dir}, in use by pid {holder.process.pid} (a running node); stop it or "
        "use another --workdir"
    )
    assert holder.alive() and (holder.data_dir / "node.db").exists()  # nothing wiped


def test_a_seed_restarted_with_another_experiment_exits_2_naming_both(tmp_path: Path) -> None:
    net = new_net(tmp_path)  # only to write the experiment: no node runs
    original = net.write_experiment(validators=["validator-0"], quorum=1, max_updates=1)
    seed_dir = net.data_dir("seed")
    # what `p2ptrain seed --experiment-toml original` stores before it serves
    settings = NodeSettings(data_dir=seed_dir, roles=("seed",), experiment_toml=original)
    with DataDir(seed_dir, exclusive=True) as datadir:
        served = asyncio.run(prepare(settings, NodeStore(datadir))).experiment.record_id
    text = original.read_text()
    assert text.count("max_updates = 1\n") == 1
    other = tmp_path / "other.toml"
    other.write_text(text.replace("max_updates = 1\n", "max_updates = 2\n"))
    result = p2ptrain("seed", "--dir", str(seed_dir), "--experiment-toml", str(other))
    line = the_error(result)
    assert line.startswith(f"p2ptrain: error: {seed_dir} follows experiment {served}, not "), line
    defined = EXPERIMENT_ID.findall(line)[1]
    assert defined != served
    assert line.endswith(
        f"defined by {other}; use a fresh --dir to create a new experiment, or restart with "
        "the original --experiment-toml"
    )


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this user cannot write in: for root (whom permissions do not stop) a
    read-only tmpfs mounted here, otherwise mode 0555."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)
        return
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("root, but no mount(8) to mount a read-only tmpfs with")
    mounted = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"root, but cannot mount a read-only tmpfs: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_node_on_a_read_only_directory_exits_2_with_one_line(read_only_dir: Path) -> None:
    problem = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    experiment = "ab" * 32
    train = p2ptrain(
        "train",
        "--dir",
        str(read_only_dir),
        "--experiment",
        experiment,
        "--bootstrap",
        "http://127.0.0.1:9",
    )
    assert the_error(train) == (
        f"p2ptrain: error: cannot write in the data directory {read_only_dir}: {problem}; "
        "choose a directory this user can write (--dir)"
    )


# -- children that end with their parent ----------------------------------------------------

GUARDED_PARENT = """
import subprocess, sys
from p2ptrain.node.parent_death import bound_to_this_process
idle = [sys.executable, "-c", "import signal; signal.pause()"]
child = subprocess.Popen(bound_to_this_process(idle), stdin=subprocess.DEVNULL)
print(child.pid, flush=True)
sys.stdin.read()
"""


@linux_only
def test_a_bound_child_dies_with_its_killed_parent() -> None:
    assert guards_children()
    parent = subprocess.Popen(
        [sys.executable, "-c", GUARDED_PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    pidfds: dict[int, int] = {}
    try:
        assert parent.stdout is not None
        readable, _, _ = select.select([parent.stdout], [], [], COMMAND_TIMEOUT_S)
        assert readable, "the parent did not start its child"
        child = int(parent.stdout.readline())
        pidfds[child] = os.pidfd_open(child)
        assert wait_gone(pidfds, 0) == [child]  # alive while its parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=COMMAND_TIMEOUT_S)
        assert wait_gone(pidfds, GONE_WITHIN_S) == []
    finally:
        kill_and_close(pidfds)
        parent.kill()
        parent.wait()
        for stream in (parent.stdin, parent.stdout):
            if stream is not None:
                stream.close()


class Demo:
    """A running ``p2ptrain demo`` and the lines it writes on stderr."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain", "demo", "--workdir", str(workdir), *DEMO_ARGS],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="demo-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_ready(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait_for(
                lambda: self.ended or self.said("every node is ready"), timeout_s
            )
        assert self.said("every node is ready"), self.diagnosis("the demo's nodes to be ready")

    def nodes(self) -> dict[int, int]:
        """The demo's node processes (its descendants whose command names its work dir: it
        forks them from a server of its own): pid -> pidfd."""
        parents: dict[int, int] = {}
        commands: dict[int, bytes] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
            commands[int(entry)] = b" ".join(command)

        def descends(pid: int) -> bool:
            while pid in parents and pid != self.process.pid:
                pid = parents[pid]
            return pid == self.process.pid

        return {
            pid: os.pidfd_open(pid)
            for pid, command in commands.items()
            if pid != self.process.pid and descends(pid) and str(self.workdir).encode() in command
        }

    def diagnosis(self, what: str) -> str:
        logs = []
        for log in sorted((self.workdir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-10:]
            logs.append(f"--- {log.name}\n" + "\n".join(tail))
        return f"waiting for {what}; the demo said:\n" + "\n".join(self.lines + logs)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self._reader.join(timeout=COMMAND_TIMEOUT_S)
        if self.process.stderr is not None:
            self.process.stderr.close()


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """A demo started now; at the end it and any node of it left are killed and reaped."""
    started = Demo(tmp_path / "demo")
    try:
        yield started
    finally:
        started.close()


@linux_only
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_no_node_of_a_stopped_or_killed_demo_outlives_it(demo: Demo, signum: int) -> None:
    demo.wait_ready(DEMO_READY_S)
    nodes = demo.nodes()
    try:
        assert len(nodes) == DEMO_NODES, demo.diagnosis(f"{DEMO_NODES} node processes: {nodes}")
        assert wait_gone(nodes, 0) == sorted(nodes)
        sent = time.monotonic()
        demo.process.send_signal(signum)
        survivors = wait_gone(nodes, GONE_WITHIN_S)
        gone_s = time.monotonic() - sent
        assert survivors == [], demo.diagnosis(f"nodes {survivors} to end")
        returncode = demo.process.wait(timeout=GONE_WITHIN_S)
        name = signal.Signals(signum).name
        print(f"demo {name}: its {len(nodes)} nodes gone in {gone_s:.2f} s, rc {returncode}")
        if signum == signal.SIGTERM:
            assert returncode == 128 + signum
            assert demo.said("SIGTERM: stopping every node"), demo.diagnosis("its last words")
        else:
            assert returncode == -signum
        for directory in demo.workdir.iterdir():
            check_not_in_use(directory)  # every lock went with its node
    finally:
        kill_and_close(nodes)
