"""The data directory lock: one node per directory, the holder named, nothing stale after a
crash, readers never refused; and the children bound to their parent's life."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from p2ptrain.errors import DataDirInUse, LocalError
from p2ptrain.node import parent_death
from p2ptrain.store.datadir import LOCK_FILE, DataDir, DataDirLock, check_not_in_use

HOLDER = """
import sys
from p2ptrain.store.datadir import DataDirLock
lock = DataDirLock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    directory = tmp_path / "node"
    lock = DataDirLock(directory)
    assert (directory / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    with pytest.raises(DataDirInUse) as refused:
        DataDirLock(directory)  # another open file, even in the same process
    assert refused.value.pid == os.getpid()
    assert str(refused.value) == (
        f"data directory {directory} is in use by pid {os.getpid()} (another p2ptrain node); "
        "stop it or use another --dir"
    )
    with pytest.raises(DataDirInUse):
        check_not_in_use(directory)
    lock.release()
    lock.release()  # idempotent
    assert not lock.held
    check_not_in_use(directory)
    with DataDirLock(directory) as again:
        assert again.held
    check_not_in_use(directory)


def test_the_lock_of_a_killed_holder_is_free(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert holder.stdout is not None
        readable, _, _ = select.select([holder.stdout], [], [], 30)
        assert readable and holder.stdout.readline() == b"locked\n"
        with pytest.raises(DataDirInUse) as refused:
            DataDirLock(tmp_path)
        assert refused.value.pid == holder.pid
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()
    with DataDirLock(tmp_path):  # the kernel dropped the dead holder's lock
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_a_holder_that_wrote_no_pid_is_another_process(tmp_path: Path) -> None:
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"not a pid")
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DataDirInUse, match="in use by another process") as refused:
            DataDirLock(tmp_path)
        assert refused.value.pid is None
    finally:
        os.close(fd)


def test_readers_open_a_locked_directory_and_a_second_node_does_not(tmp_path: Path) -> None:
    with DataDir(tmp_path, exclusive=True) as node:
        stored = node.blobs.put(b"weights")
        with DataDir(tmp_path) as reader:  # p2ptrain status, export, tests
            assert reader.blobs.get(stored) == b"weights"
        with pytest.raises(DataDirInUse):
            DataDir(tmp_path, exclusive=True)
    with DataDir(tmp_path, exclusive=True):
        pass


def test_a_store_that_fails_to_open_gives_the_lock_back(tmp_path: Path) -> None:
    (tmp_path / "blobs").write_text("a file where the blob store goes")
    with pytest.raises(LocalError, match="cannot create the blob store"):
        DataDir(tmp_path, exclusive=True)
    check_not_in_use(tmp_path)


def test_a_directory_that_cannot_be_made_or_written_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LocalError, match=f"cannot create the data directory {blocker}/node: "):
        DataDirLock(blocker / "node")
    (tmp_path / "node" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(
        LocalError, match=f"cannot write in the data directory {tmp_path / 'node'}: Is a dir"
    ):
        DataDirLock(tmp_path / "node")


def test_what_is_not_a_data_directory_is_not_in_use(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "missing", tmp_path / "plain", tmp_path / "file"):
        check_not_in_use(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_are_bound_to_this_process_only_from_the_main_thread() -> None:
    command = ["p2ptrain", "seed"]
    wrapped = parent_death.bound_to_this_process(command)
    assert wrapped[-2:] == command and wrapped[wrapped.index("-S") + 2] == str(os.getpid())
    seen: list[list[str]] = []
    worker = threading.Thread(
        target=lambda: seen.append(parent_death.bound_to_this_process(command))
    )
    worker.start()
    worker.join()
    assert seen == [command]  # the child would die with the worker thread


def test_a_child_whose_parent_already_ended_does_not_start() -> None:
    # the wrapper runs as a script with the standard library only; parent 1 is not us
    script = parent_death.__file__
    result = subprocess.run(
        [sys.executable, "-I", "-S", script, "1", sys.executable, "-c", "print('started')"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "parent 1 ended before" in result.stderr
    started = subprocess.run(
        [sys.executable, "-I", "-S", script, str(os.getpid()), sys.executable, "-c", "print(1)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (started.returncode, started.stdout) == (0, "1\n"), started.stderr
