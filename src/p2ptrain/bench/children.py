"""What the benchmarks need to run programs of this p2ptrain as child processes."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["child_env", "log_tail"]

LOG_TAIL_CHARS = 3000


def child_env() -> dict[str, str]:
    """This environment with this p2ptrain's source first on ``PYTHONPATH``, so that a child
    interpreter imports the same code as its parent."""
    source = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (source, env.get("PYTHONPATH"))))
    return env


def log_tail(log: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a child's log, said for an error message."""
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"its log {log} does not read: {exc}"
    tail = text[-chars:].strip()
    return f"the end of its log {log}:\n{tail}" if tail else f"its log {log} is empty"
