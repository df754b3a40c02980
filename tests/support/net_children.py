"""Run :mod:`tests.support.net_child` nodes as processes and talk to them; reap them always."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


class NodeProcess:
    def __init__(self, spec: dict[str, Any], prefix: Sequence[str] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.spec = spec
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.support.net_child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(Path(spec["data_dir"]) / "stderr.log", "wb"),  # noqa: SIM115
            cwd=ROOT,
            env=env,
        )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.address: str | None = None
        self.peer_id = ""

    def wait_up(self) -> None:
        up = self.next_line(timeout=30)
        assert up["event"] == "up", up
        self.address = up["address"]
        self.peer_id = up["peer_id"]

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def next_line(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"node {self.spec['seed']} said nothing for {timeout} s") from None
        if line is None:
            raise AssertionError(f"node {self.spec['seed']} exited:\n{self.stderr()[-3000:]}")
        return line

    def ask(self, timeout: float = 30, **cmd: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(cmd) + "\n").encode())
        self.process.stdin.flush()
        answer = self.next_line(timeout)
        assert answer["event"] == "ok", answer
        return answer

    def stderr(self) -> str:
        return (Path(self.spec["data_dir"]) / "stderr.log").read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                pass
        self.kill()


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, poll: Callable[[], None] | None = None
) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        if poll is not None:
            poll()
        time.sleep(0.05)  # polling interval of a condition wait, not a synchronisation sleep


@pytest.fixture
def spawn_node(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Start a node process: ``spawn_node(seed="a", network={...}, ...)``; all are reaped."""
    started: list[NodeProcess] = []

    def spawn(prefix: Sequence[str] = (), **spec: Any) -> NodeProcess:
        data_dir = tmp_path / f"node-{spec['seed']}"
        data_dir.mkdir(exist_ok=True)
        spec.setdefault("network", {})
        node = NodeProcess({"data_dir": str(data_dir), **spec}, prefix)
        started.append(node)
        node.wait_up()
        return node

    yield spawn
    for node in started:
        node.stop()
