"""How much memory this process has held at most: its peak resident set size.

The peak is the process's ``VmHWM`` (``/proc/self/status``): unlike ``getrusage``'s
``ru_maxrss``, which Linux carries across ``exec`` from the forked parent, it covers this
interpreter alone (``ru_maxrss`` is the fallback without ``/proc``). A node forked from a
warm server starts from the server's resident pages (shared with it until written).
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["peak_rss_mib"]


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
