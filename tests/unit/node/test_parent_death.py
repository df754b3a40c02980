"""A process that another program started (a pod rank under torchrun) ends once that program
has ended, rather than training on alone (:func:`~p2ptrain.node.parent_death.exit_with_parent`).

The test starts a middle process that starts the watched one, both writing to one pipe;
the middle process is SIGKILLed, and the pipe must reach its end (every writer gone) with
the watched process saying why it exited. A process told which parent to watch
(``PARENT_ENV``, as ``torchrun``'s ranks are) and started after that parent ended exits at
once: watching the parent it has by then would keep it alive."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from p2ptrain.node.parent_death import PARENT_ENV

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


def test_a_process_whose_named_parent_has_already_ended_exits_at_once() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    watched = subprocess.run(
        [sys.executable, "-c", WATCHED],
        env={**os.environ, PARENT_ENV: str(ended.pid)},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = f"watched: the process that started it (pid {ended.pid}) has ended; exiting"
    assert watched.returncode == 1, (watched.returncode, watched.stdout, watched.stderr)
    assert said in watched.stderr
