"""Node processes forked from a warm server: the :data:`~.local_network.Launcher` of the demo
and the chaos bench.

A node started as a new interpreter (``python -m p2ptrain ...``) spends about five seconds
of CPU before it does anything: importing torch, and torch's compiler, which building the
first optimizer imports. A local network of nine nodes spends most of its first minute on
that, and a bench that restarts nodes pays it again for each. This launcher starts nodes from
a :mod:`multiprocessing` fork server that has imported all of that once: each node is still
its own process, running the same command line through :mod:`runpy` as ``python -m`` would,
with its own session, environment, stdout pipe, stderr log, working directory and process
title (``ps`` shows its command), and it is signalled, paused and killed like any other.
Only the start of the interpreter is skipped.

* A node dies with the process that launched it, SIGKILLed or not: it watches a pipe whose
  other end only that process holds (its *lifeline*), and kills itself when the pipe closes.
* ``ip netns exec NAMESPACE PYTHON -m MODULE ...`` runs forked too: the node enters the
  network namespace itself (``setns(2)``) before anything else.
* Any other command (a wrapper script), a platform other than Linux, or ``P2PTRAIN_FORK=0``
  in the environment: the command starts as a new interpreter
  (:func:`~.local_network.start_process`).

``p2ptrain bench convergence`` does not use it: it counts its systems' CPU time as that of
the processes it waited for, and starts every system's processes alike.
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

from p2ptrain.node.local_network import ChildProcess, Launcher, start_process

__all__ = ["ENV", "PRELOAD", "ForkedProcess", "fork_launcher"]

#: Imported once by the fork server, so that no node imports them again.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.optim",
    "p2ptrain.cli.main",
    "p2ptrain.cli.node_commands",
    "p2ptrain.node.launch",
    "p2ptrain.node.shell",
    "p2ptrain.torch.char_gpt",
    "p2ptrain.torch.registry",
)
#: ``P2PTRAIN_FORK=0``: every node a new interpreter.
ENV = "P2PTRAIN_FORK"
_NETNS = ("ip", "netns", "exec")
_CLONE_NEWNET = 0x40000000


class _Fd:
    """A file descriptor handed to a forked node (the fork server duplicates it in)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate: Any) -> _Fd:
    return _Fd(duplicate.detach())


def _enter_namespace(name: str) -> None:
    """Move this process into the network namespace ``name`` (as ``ip netns exec`` does for
    the sockets it opens)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


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
    command: list[str],
    module: str,
    args: list[str],
    namespace: str | None,
    environment: dict[str, str],
    cwd: str,
    stdout: _Fd,
    stderr: _Fd,
    lifeline: _Fd,
) -> None:
    """The forked node: ``python -m module args...`` without the interpreter's start."""
    os.setsid()
    if namespace is not None:
        _enter_namespace(namespace)  # before any thread: new threads inherit it
    _die_with(lifeline.fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout.fd, 1)
    os.dup2(stderr.fd, 2)
    for fd in (null, stdout.fd, stderr.fd):
        os.close(fd)
    os.chdir(cwd)
    import setproctitle  # before the environment changes: it moves the environment away

    setproctitle.setproctitle(" ".join(command))
    os.environ.clear()
    os.environ.update(environment)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedProcess:
    """A node forked by the server, used as a :class:`subprocess.Popen` is."""

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


def _forkable(command: Sequence[str]) -> tuple[str | None, str, list[str]] | None:
    """(namespace, module, arguments) of ``[ip netns exec NS] PYTHON -m MODULE ARGS...``
    with this interpreter as PYTHON; None for any other command."""
    namespace = None
    rest = list(command)
    if tuple(rest[:3]) == _NETNS and len(rest) > 3:
        namespace, rest = rest[3], rest[4:]
    if len(rest) < 3 or rest[0] != sys.executable or rest[1] != "-m":
        return None
    return namespace, rest[2], rest[3:]


class _ForkServer:
    """The one fork server of this process (multiprocessing keeps one), started on first
    use with :data:`PRELOAD` and what the first caller added."""

    def __init__(self) -> None:
        self._context: Any = None
        self._preload: list[str] = list(PRELOAD)
        self._lifeline_read = -1
        self._lock = threading.Lock()

    def add_preload(self, modules: Sequence[str]) -> None:
        with self._lock:
            if self._context is None:
                self._preload += [m for m in modules if m not in self._preload]

    def _server(self) -> Any:
        with self._lock:
            if self._context is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(self._preload)
                read, write = os.pipe()  # the write end stays here, never inherited
                os.set_inheritable(write, False)
                self._lifeline_read = read
                self._lifeline_write = write
                self._context = context
            return self._context

    def __call__(
        self, command: Sequence[str], environment: Mapping[str, str], log: IO[bytes]
    ) -> tuple[ChildProcess, IO[bytes]]:
        forkable = _forkable(command)
        if forkable is None:
            return start_process(command, environment, log)
        namespace, module, args = forkable
        context = self._server()
        read, write = os.pipe()
        try:
            process = context.Process(
                target=_run,
                kwargs={
                    "command": list(command[4:] if namespace else command),
                    "module": module,
                    "args": args,
                    "namespace": namespace,
                    "environment": dict(environment),
                    "cwd": os.getcwd(),
                    "stdout": _Fd(write),
                    "stderr": _Fd(log.fileno()),
                    "lifeline": _Fd(self._lifeline_read),
                },
                name=module,
                daemon=True,
            )
            process.start()
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        return ForkedProcess(process, command), os.fdopen(read, "rb")


_SERVER = _ForkServer()


def fork_launcher(preload: Sequence[str] = ()) -> Launcher:
    """The launcher that forks nodes from this process's fork server, which imports
    ``preload`` too if it has not started yet; :func:`~.local_network.start_process` where
    ``P2PTRAIN_FORK=0`` or where there is no fork server (not Linux)."""
    if os.environ.get(ENV) == "0" or not sys.platform.startswith("linux"):
        return start_process
    _SERVER.add_preload(preload)
    return _SERVER
