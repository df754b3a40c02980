"""Node processes forked from a warm server: the test suite's :data:`Launcher`.

A node started as ``python -m p2ptrain ...`` spends about five seconds of CPU before it does
anything (importing torch, and torch's compiler when the workload builds its optimizer),
and the real-process tests start a couple of hundred nodes on two cores. This launcher
starts them from a :mod:`multiprocessing` fork server that has imported all of that once
(per test worker): each node is still its own process, running the same command line
through ``runpy`` as ``python -m`` would, with its own session, environment, stdout pipe
and stderr log, and it can be signalled, paused and killed like any other. Only the start of
the interpreter is skipped; the CLI tests, the demo and the benches still start nodes as new
interpreters (:func:`p2ptrain.node.local_network.start_process`).

A node dies with the test process that launched it (it watches a pipe whose other end only
that process holds), as the default launcher's nodes do. A command that is not
``sys.executable -m MODULE ...`` (a wrapper script) is started the default way.
Set ``P2PTRAIN_TEST_FORK=0`` to start every node as a new interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from typing import IO, Any

from p2ptrain.node.local_network import ChildProcess, start_process

__all__ = ["fork_launcher"]

#: Imported once by the fork server, so that no node imports them again.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.optim",
    "p2ptrain.cli.main",
    "p2ptrain.cli.node_commands",
    "p2ptrain.node.launch",
    "p2ptrain.node.shell",
    "p2ptrain.torch.char_gpt",
    "p2ptrain.torch.registry",
    "tests.support.faulty_node",
]
ENV = "P2PTRAIN_TEST_FORK"
_PR_SET_PDEATHSIG = 1


class _Fd:
    """A file descriptor handed to a forked node (the fork server duplicates it in)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate: Any) -> _Fd:
    return _Fd(duplicate.detach())


def _die_with(lifeline: int) -> None:
    """SIGKILL this process once ``lifeline`` (the launcher's pipe) reads end-of-file."""

    def watch() -> None:
        while True:
            try:
                if not os.read(lifeline, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _run(
    *,
    module: str,
    args: list[str],
    environment: dict[str, str],
    cwd: str,
    stdout: _Fd,
    stderr: _Fd,
    lifeline: _Fd,
) -> None:
    """The forked node: ``python -m module args...`` without the interpreter's start."""
    os.setsid()
    _die_with(lifeline.fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout.fd, 1)
    os.dup2(stderr.fd, 2)
    for fd in (null, stdout.fd, stderr.fd):
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedProcess:
    """A node forked by the server, as a :class:`subprocess.Popen` is used."""

    def __init__(self, process: multiprocessing.process.BaseProcess, command: Sequence[str]):
        self._process = process
        self._command = list(command)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self._command, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Launcher:
    def __init__(self) -> None:
        self._context: Any = None
        self._lifeline = -1
        self._lock = threading.Lock()

    def _server(self) -> Any:
        with self._lock:
            if self._context is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(PRELOAD)
                read, self._lifeline = os.pipe()  # the write end stays here, never inherited
                os.set_inheritable(self._lifeline, False)
                self._lifeline_read = read
                self._context = context
            return self._context

    def __call__(
        self, command: Sequence[str], environment: Mapping[str, str], log: IO[bytes]
    ) -> tuple[ChildProcess, IO[bytes]]:
        if len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
            return start_process(command, environment, log)
        context = self._server()
        read, write = os.pipe()
        try:
            process = context.Process(
                target=_run,
                kwargs={
                    "module": command[2],
                    "args": list(command[3:]),
                    "environment": dict(environment),
                    "cwd": os.getcwd(),
                    "stdout": _Fd(write),
                    "stderr": _Fd(log.fileno()),
                    "lifeline": _Fd(self._lifeline_read),
                },
                name=command[2],
                daemon=True,
            )
            process.start()
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return ForkedProcess(process, command), os.fdopen(read, "rb")


_LAUNCHER = _Launcher()


def fork_launcher() -> Any:
    """The launcher the tests' networks use (the default one where ``P2PTRAIN_TEST_FORK=0``
    or where there is no fork server: not Linux)."""
    if os.environ.get(ENV) == "0" or not sys.platform.startswith("linux"):
        return start_process
    return _LAUNCHER
