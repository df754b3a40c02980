"""Run to target: a watcher that says when a running system's model reached the target loss.

``p2ptrain bench convergence --until-target`` lets our network and hivemind train until their
validation loss reaches the target (or a cap of samples). Nobody evaluates inside the
systems, so the bench watches from outside: :class:`TargetWatch` evaluates the newest model
a system has left (a head our seed certified, a snapshot hivemind's first peer saved) in a
process of its own, at the lowest CPU priority, so that it takes the CPU only when the
system leaves some. The process runs in a session of its own, and lowers its session's
scheduling group (Linux's autogroup) as well as itself: with autogroups, each session gets
an equal share of the CPU whatever its threads' niceness, so a niced thread of the bench's
own process would take as much of a core as one of the system's trainers whenever it
evaluates. Once a model is at or below the target it calls ``reached`` once, and the system
stops at its next boundary.

The watcher only decides when to stop: the figures of the report (samples, seconds and bytes
to the target) come from the evaluation of every model after the system stopped, as for a
run of fixed length. A watcher that lags behind costs the run a few more windows, never a
wrong figure. The bench offers it no model before the system trained on the reference
samples (DDP's budget): even at the lowest priority an evaluation takes CPU from the run
it times, when DDP's snapshots are evaluated only after DDP's run. A system that reached
the target by then stops at its first model past the budget.

:func:`read_blob` reads a certified head's weights from a running node's blob store (at
:func:`head_blob`) by their content address, verified against it, without the data
directory's lock the node holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Literal

import torch

from p2ptrain.bench.convergence_task import Task, build_workload
from p2ptrain.errors import LocalError

__all__ = ["POLL_S", "Model", "TargetWatch", "head_blob", "read_blob"]

#: How often the watcher looks for a newer model.
POLL_S = 1.0
#: The watcher's niceness (its own and its session's): the system's processes come first.
NICE = 19

Weights = Mapping[str, torch.Tensor]
#: A model a system left: a key that changes with each new one, the format of its file (a
#: blob of our store, checked against its name, or safetensors) and the file.
Model = tuple[str, Literal["blob", "safetensors"], Path]
Newest = Callable[[], Model | None]


def head_blob(data_dir: Path, weights_blob: str) -> Path:
    """Where the node at ``data_dir`` keeps blob ``weights_blob``."""
    from p2ptrain.store.datadir import BLOBS_DIR

    return data_dir / BLOBS_DIR / weights_blob[:2] / weights_blob


def read_blob(path: Path) -> dict[str, torch.Tensor]:
    """The weights in a blob a running node keeps (blobs are written once, under their
    SHA-256: checked against it here)."""
    from p2ptrain.core.tensors import decode_state_dict

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LocalError(f"cannot read head weights {path}: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != path.name:
        raise LocalError(f"{path} does not hash to its name: the node's blob store is damaged")
    return decode_state_dict(data)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights: dict[str, torch.Tensor] = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise LocalError(f"cannot read snapshot {path}: {exc}") from exc
    return weights


class TargetWatch:
    """Evaluates ``newest()`` whenever it names a new model, in a lowered process of its
    own (see the module docstring), until one is at or below ``target`` (then ``reached`` is
    called once) or :meth:`close`."""

    def __init__(
        self,
        task: Task,
        target: float,
        newest: Newest,
        reached: Callable[[], None],
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.task, self.target, self.poll_s = task, target, poll_s
        self._newest, self._reached = newest, reached
        self.done = threading.Event()
        self._stop = threading.Event()
        #: (key, validation loss) of every model the watcher evaluated.
        self.seen: list[tuple[str, float]] = []
        #: Why the watcher gave up, if it did (a model it could not load).
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="target-watch", daemon=True)
        self._child: subprocess.Popen[str] | None = None

    def __enter__(self) -> TargetWatch:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain.bench.convergence_watch", self.task.to_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a scheduling group of its own, lowered there
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        child = self._child
        if child is not None:
            with contextlib.suppress(OSError):
                child.kill()  # ends an evaluation the thread may wait on
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
        self._thread.join()

    def _run(self) -> None:
        child = self._child
        assert child is not None and child.stdin is not None and child.stdout is not None
        last: str | None = None
        while not self._stop.wait(self.poll_s):
            try:
                newest = self._newest()
            except (OSError, LookupError, ValueError) as exc:
                self.error = f"cannot tell the system's newest model: {exc!r}"
                return
            if newest is None or newest[0] == last:
                continue
            last, kind, path = newest
            answer = _ask(child.stdin, child.stdout, f"{kind}\t{path}")
            if answer is None:  # closed while it evaluated, or the child died
                if not self._stop.is_set():
                    code = child.wait()
                    self.error = f"the watcher's process ended (exit status {code})"
                return
            status, _, value = answer.partition("\t")
            if status != "loss":
                self.error = value
                return
            loss = float(value)
            self.seen.append((last, loss))
            if loss <= self.target:
                self.done.set()
                self._reached()
                return


def _ask(to_child: IO[str], from_child: IO[str], line: str) -> str | None:
    """Send the child one model, and read its answer (None: it ended)."""
    try:
        to_child.write(line + "\n")
        to_child.flush()
        answer = from_child.readline()
    except (OSError, ValueError):  # a pipe closed under us
        return None
    return answer.rstrip("\n") or None


def _lower_priority() -> None:
    """Lowest priority for this process and for its session's scheduling group (Linux's
    autogroup: this process runs in a session of its own)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(NICE))


def _serve(task_json: str) -> None:
    """The child: evaluate each model named on stdin (``kind<TAB>path``), answering
    ``loss<TAB>value`` or ``error<TAB>why`` on stdout, one line each."""
    _lower_priority()
    workload = build_workload(Task.from_json(task_json), threads=1)
    read = {"blob": read_blob, "safetensors": _read_safetensors}
    for line in sys.stdin:
        kind, _, path = line.rstrip("\n").partition("\t")
        try:
            if kind not in read:
                raise LocalError(f"the watcher cannot read models of kind {kind!r}")
            answer = f"loss\t{workload.evaluate(read[kind](Path(path)))!r}"
        except LocalError as exc:
            answer = f"error\t{exc}".replace("\n", " ")
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
