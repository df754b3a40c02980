"""Child processes that end with the process that started them, even when it is SIGKILLed.

:func:`bound_to_this_process` wraps a command so that it runs through this file as a script,
``python -I -S parent_death.py PARENT_PID COMMAND...``, which

1. asks Linux to SIGKILL it when its parent ends (``prctl(PR_SET_PDEATHSIG)``, kept across
   ``execve``),
2. checks that its parent is still ``PARENT_PID``: a parent that died before step 1 would
   never signal it (the child has been handed to init), so it exits instead, and
3. replaces itself with ``COMMAND``: the same pid and parent, the signal still armed.

This does in a fresh process what a ``preexec_fn`` would do between ``fork`` and ``exec``,
where a supervisor with threads (LocalNetwork reads each child's output on a thread) may
deadlock on a lock another thread held; it costs one small interpreter start (the standard
library only, no site packages).

Linux sends the signal when the *thread* that forked the child ends, not the process, so
only a command started from the main thread is wrapped; from another thread, or elsewhere
than Linux, the command is returned as it is, and only an orderly stop of the supervisor
stops its children.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["PARENT_ENV", "bound_to_this_process", "exit_with_parent", "guards_children"]

_PR_SET_PDEATHSIG = 1

#: The variable naming the pid a pod rank's parent must have (``torchrun``'s agent: ``p2ptrain
#: train --pod-ranks`` sets it to its own pid before it becomes ``torchrun``).
PARENT_ENV = "P2PTRAIN_POD_AGENT_PID"


def guards_children() -> bool:
    """Whether :func:`bound_to_this_process` wraps commands here and now."""
    return sys.platform.startswith("linux") and (
        threading.current_thread() is threading.main_thread()
    )


def bound_to_this_process(command: Sequence[str]) -> list[str]:
    """``command``, run so that Linux SIGKILLs it when this process ends (see the module
    docstring); the command itself where that cannot be done."""
    if not guards_children():
        return list(command)
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), *command]


def exit_with_parent(what: str, poll_s: float = 0.5) -> None:
    """End this process once the process that started it has ended: for a process that
    another program starts (a pod rank, started by torchrun's agent), which cannot be
    wrapped by :func:`bound_to_this_process`. A daemon thread reads the parent's pid every
    ``poll_s``; once the process has been handed to another parent it says so and exits at
    once (``os._exit``: a rank stuck in a collective or in torch.distributed's teardown
    would not get further), as the agent's own SIGKILL would have ended it.

    The parent to watch is the pid in :data:`PARENT_ENV` where it is set, else the parent
    this process has now. The variable closes a race: a rank that gets here after its agent
    was killed already has another parent, and watching that one would keep it alive."""
    named = os.environ.get(PARENT_ENV, "")
    parent = int(named) if named.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(
            f"{what}: the process that started it (pid {parent}) has ended; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _die_with_parent() -> str | None:
    """Arm the parent-death signal; the reason it could not be, or None."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        return str(exc)
    return None


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: parent_death.py PARENT_PID COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent, command = int(argv[1]), list(argv[2:])
    problem = _die_with_parent()
    if problem is not None:
        print(f"{command[0]}: will outlive its parent (prctl: {problem})", file=sys.stderr)
    if os.getppid() != parent:
        print(f"parent {parent} ended before {command[0]} started; not starting", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
