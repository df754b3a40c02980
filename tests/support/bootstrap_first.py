"""``python -m tests.support.bootstrap_first FIRST ARGS...``: ``p2ptrain ARGS`` with
``--bootstrap FIRST`` before the other ``--bootstrap`` flags (the harness names the seed
itself), and ``-v`` when the harness runs its nodes with debug logs."""

from __future__ import annotations

import os
import runpy
import sys

from tests.support.local_net import VERBOSE_ENV

if __name__ == "__main__":
    first, *args = sys.argv[1:]
    at = args.index("--bootstrap")
    verbose = ["-v"] if os.environ.get(VERBOSE_ENV) else []
    sys.argv = ["p2ptrain", *verbose, *args[:at], "--bootstrap", first, *args[at:]]
    runpy.run_module("p2ptrain", run_name="__main__", alter_sys=True)
