"""The test watchdog kills the processes a stuck test started, and only those."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from tests.support.watchdog import Watchdog, descendants_since, now_ticks

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_it_kills_what_the_test_started_and_leaves_older_processes() -> None:
    older = subprocess.Popen(SLEEPER)
    try:
        since = now_ticks() + 1  # a tick after the older one started
        while now_ticks() < since:
            pass
        watchdog = Watchdog("tests/x.py::test_stuck", after_s=0.5)
        newer = subprocess.Popen(SLEEPER)
        grandchild = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", *SLEEPER]
        )
        try:
            assert newer.wait(timeout=30) == -9  # the wait a stuck test is in ends
            assert grandchild.wait(timeout=30) == -9
            assert older.poll() is None
        finally:
            watchdog.cancel()
            for process in (newer, grandchild):
                process.kill()
                process.wait()
    finally:
        older.kill()
        older.wait()


def test_a_cancelled_watchdog_kills_nothing() -> None:
    watchdog = Watchdog("tests/x.py::test_quick", after_s=0.2)
    child = subprocess.Popen(SLEEPER)
    try:
        watchdog.cancel()
        assert child.pid in descendants_since(os.getpid(), 0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=0.6)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
