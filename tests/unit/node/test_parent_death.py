"""A process that another program started (a pod rank under torchrun) ends once that program
has ended, rather than training on alone (:func:`~p2ptrain.node.parent_death.exit_with_parent`).

The test starts a middle process that starts the watched one, both writing to one pipe;
the middle process is SIGKILLed, and the pipe must reach its end (every writer gone) with
the watched process saying why it exited."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

WATCHED = """
import threading
from p2ptrain.node.parent_death import exit_with_parent
exit_with_parent("watched", poll_s=0.05)
print("watching", flush=True)
threading.Event().wait()
"""

MIDDLE = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {WATCHED!r}], stderr=subprocess.STDOUT)
print("middle", child.pid, flush=True)
sys.stdin.read()
"""


def test_a_process_exits_once_the_one_that_started_it_is_killed() -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    ended = threading.Event()

    def read() -> None:
        assert middle.stdout is not None
        for line in middle.stdout:  # until every writer of the pipe has exited
            lines.append(line.strip())
            if line.startswith("watching"):
                middle.kill()
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ended.wait(60), f"the watched process did not exit: {lines}"
    finally:
        middle.kill()
        middle.wait()
        for line in lines:  # never leave the watched process behind
            if line.startswith("middle "):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)
    watched = int(next(line for line in lines if line.startswith("middle ")).split()[1])
    said = f"watched: the process that started it (pid {middle.pid}) has ended; exiting"
    assert said in lines, lines
    assert watched != middle.pid
