"""A cluster member in pod mode prints its own events and its node's (relayed by a reader
thread) on one stdout: every line stays whole, even unbuffered, where ``print`` writes a
line and its newline apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROGRAM = """
import json, threading
from p2ptrain.cli.cluster_command import print_line

def talk(who):
    for i in range(2000):
        print_line(json.dumps({"event": who, "i": i, "pad": "x" * 60}))

threads = [threading.Thread(target=talk, args=(who,)) for who in ("member", "node")]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


def test_lines_from_two_threads_never_interleave() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4000
    events = [json.loads(line) for line in lines]  # one event per line, each whole
    assert sorted(e["i"] for e in events if e["event"] == "node") == list(range(2000))
