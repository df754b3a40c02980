"""A test that outlives its timeout: pytest-timeout's SIGALRM fires once, in the test's main
thread; when the test is waiting on a child process that will not exit, or a cleanup waits
again after the timeout's exception, nothing else ends it and the whole run stops at CI's
cap. The watchdog kills the processes the test started (those descending from this worker and
started after the test did), which ends such a wait with an error that names the test."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

#: Clock ticks per second of ``/proc/PID/stat``'s start time.
_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in ticks since boot)``, or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return int(fields[1]), int(fields[19])


def now_ticks() -> int:
    """The time since boot in the ticks of ``/proc/PID/stat``."""
    return int(float(Path("/proc/uptime").read_text().split()[0]) * _TICKS)


def descendants_since(root: int, since_ticks: int) -> list[int]:
    """The processes descending from ``root`` that started at or after ``since_ticks``."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat
    found = []
    for pid, (_, started) in parents.items():
        ancestor = pid
        while ancestor in parents and ancestor != root:
            ancestor = parents[ancestor][0]
        if ancestor == root and pid != root and started >= since_ticks:
            found.append(pid)
    return found


class Watchdog:
    """Kills what the running test started once it has run ``after_s`` seconds."""

    def __init__(self, nodeid: str, after_s: float) -> None:
        self._nodeid = nodeid
        self._since = now_ticks()
        self._timer = threading.Timer(after_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        pids = descendants_since(os.getpid(), self._since)
        os.write(
            2,
            f"\nwatchdog: {self._nodeid} is still running past its timeout; killing the "
            f"processes it started: {pids}\n".encode(),
        )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cancel(self) -> None:
        self._timer.cancel()
