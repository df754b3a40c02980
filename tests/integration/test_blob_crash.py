"""Kill a blob writer at arbitrary points; the store must hold only whole, verified blobs.

The child process (``blob_writer_child.py``) reports every durable blob on stdout; the test
waits for those lines (never sleeps), kills the child with SIGKILL, reopens the store and
checks every visible blob against its id.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from p2ptrain.errors import BlobCorrupted
from p2ptrain.store.blobs import BlobStore, blob_id

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("blob_writer_child.py")
BASE_SEED = 7_340_033
LINE_TIMEOUT_S = 60.0


class Child:
    """A writer process and a thread that forwards its stdout lines to a queue."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._forward, daemon=True)
        self._reader.start()

    def _forward(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # end of output

    def next_line(self, context: str) -> str:
        try:
            line = self.lines.get(timeout=LINE_TIMEOUT_S)
        except queue.Empty:
            pytest.fail(f"child sent nothing for {LINE_TIMEOUT_S}s ({context})")
        if line is None:
            pytest.fail(f"child exited with {self.process.wait()} early ({context})")
        return line

    def wait_for_blobs(self, count: int, context: str) -> list[str]:
        """Wait until the child reports ``count`` durable blobs; return their ids."""
        assert self.next_line(context).startswith("ready"), context
        ids: list[str] = []
        while len(ids) < count:
            line = self.next_line(context).split()
            if line[0] == "wrote":
                ids.append(line[1])
        return ids

    def wait_until_writing(self, context: str) -> None:
        """Wait until the child says it is starting to write its next blob."""
        while not self.next_line(context).startswith("writing"):
            pass

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=30) == -signal.SIGKILL
        self._reader.join(timeout=30)


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], Child]]:
    """Start children; reap every one still running when the test ends, pass or fail."""
    children: list[Child] = []

    def start(args: list[str]) -> Child:
        child = Child(args)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait(timeout=30)
        for stream in (child.process.stdin, child.process.stdout):
            if stream is not None:
                stream.close()


def assert_store_is_sound(root: Path, reported: list[str], context: str) -> None:
    """Reopen the store: everything visible verifies, reported blobs survive, tmp/ is empty."""
    with BlobStore(root) as store:
        visible = list(store.ids())
        for identifier in visible:
            assert blob_id(store.get(identifier)) == identifier, context
        assert set(reported) <= set(visible), f"a reported blob is missing ({context})"
        assert os.listdir(root / "tmp") == [], f"stale temporaries left ({context})"
        assert os.listdir(root / "corrupt") == [], f"corruption found ({context})"
        assert store.statistics().corruptions_detected == 0, context


@pytest.mark.parametrize("kill_after", [1, 2, 4, 7, 10, 16])
def test_kill_during_write_loop_leaves_only_whole_blobs(
    tmp_path: Path, spawn: Callable[[list[str]], Child], kill_after: int
) -> None:
    seed = BASE_SEED + kill_after
    context = f"seed={seed} kill_after={kill_after}"
    child = spawn([str(tmp_path), str(seed), "loop"])
    reported = child.wait_for_blobs(kill_after, context)
    child.wait_until_writing(context)
    child.kill()  # lands inside the put of the next blob (it takes milliseconds)
    assert_store_is_sound(tmp_path, reported, context)


def test_kill_mid_stream_leaves_a_temporary_that_reopen_removes(
    tmp_path: Path, spawn: Callable[[list[str]], Child]
) -> None:
    context = f"seed={BASE_SEED}"
    child = spawn([str(tmp_path), str(BASE_SEED), "pause-mid-stream"])
    assert child.next_line(context).startswith("ready"), context
    assert child.next_line(context) == "streaming", context
    child.kill()
    temporaries = os.listdir(tmp_path / "tmp")
    assert len(temporaries) == 1, f"expected the half-written temporary ({context})"
    assert os.path.getsize(tmp_path / "tmp" / temporaries[0]) > 0, context
    assert_store_is_sound(tmp_path, [], context)
    with BlobStore(tmp_path) as store:
        assert list(store.ids()) == [], context


def test_repeated_crashes_then_a_clean_run(
    tmp_path: Path, spawn: Callable[[list[str]], Child]
) -> None:
    reported: list[str] = []
    for round_number in range(3):
        seed = BASE_SEED * 3 + round_number
        child = spawn([str(tmp_path), str(seed), "loop"])
        reported += child.wait_for_blobs(3 + 2 * round_number, f"seed={seed}")
        child.wait_until_writing(f"seed={seed}")
        child.kill()
    assert_store_is_sound(tmp_path, reported, f"seeds={BASE_SEED * 3}+0..2")


def test_processes_writing_the_same_blobs_concurrently(
    tmp_path: Path, spawn: Callable[[list[str]], Child]
) -> None:
    seed, count = BASE_SEED + 100, 12
    context = f"seed={seed}"
    BlobStore(tmp_path).close()
    children = [spawn([str(tmp_path), str(seed), "count", str(count)]) for _ in range(3)]
    reported = [child.wait_for_blobs(count, context) for child in children]
    for child in children:
        assert child.process.wait(timeout=60) == 0, context
    assert reported[0] == reported[1] == reported[2], context
    assert_store_is_sound(tmp_path, reported[0], context)
    with BlobStore(tmp_path) as store:
        assert sorted(store.ids()) == sorted(set(reported[0])), context


def test_tampered_blob_on_disk_is_refused(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    with BlobStore(tmp_path) as store:
        identifier = store.put(data)
        path = store.path(identifier)
    with open(path, "r+b") as file:  # a bit flips while the node is down
        file.seek(12345)
        byte = file.read(1)
        file.seek(12345)
        file.write(bytes([byte[0] ^ 0x80]))
    with BlobStore(tmp_path) as store:
        with pytest.raises(BlobCorrupted, match=identifier):
            store.get(identifier)
        assert not store.has(identifier)
        assert os.listdir(tmp_path / "corrupt") == [f"{identifier}.0"]
