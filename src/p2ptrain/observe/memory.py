"""How much memory this process has held at most: its peak resident set size.

The peak is the process's ``VmHWM`` (``/proc/self/status``): unlike ``getrusage``'s
``ru_maxrss``, which Linux carries across ``exec`` from the forked parent, it covers this
interpreter alone (``ru_maxrss`` is the fallback without ``/proc``). A node forked from a
warm server starts from the server's resident pages (shared with it until written).
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["mark_after_imports", "peak_rss_mib", "rss_after_imports_mib", "rss_mib"]

_after_imports: list[float] = []


def _status_mib(field: str) -> float | None:
    """A ``/proc/self/status`` memory field in MiB (None without ``/proc``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB."""
    peak = _status_mib("VmHWM")
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak


def rss_mib() -> float:
    """This process's resident set size now, in MiB (its peak where ``/proc`` is missing)."""
    now = _status_mib("VmRSS")
    return peak_rss_mib() if now is None else now


def mark_after_imports() -> None:
    """Note this process's RSS as its size after imports (once: a node starting calls this
    before it builds any model state), the base its peak is measured against."""
    if not _after_imports:
        _after_imports.append(rss_mib())


def rss_after_imports_mib() -> float | None:
    """The RSS :func:`mark_after_imports` noted, if it was called."""
    return _after_imports[0] if _after_imports else None
