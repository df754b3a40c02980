"""Run to target: a watcher that says when a running system's model reached the target loss.

``p2ptrain bench convergence --until-target`` lets our network and hivemind train until their
validation loss reaches the target (or a cap of samples). Nobody evaluates inside the
systems, so the bench watches from outside: :class:`TargetWatch` evaluates the newest model
a system has left (a head our seed certified, a snapshot hivemind's first peer saved) on a
thread of its own, at the lowest CPU priority (``nice`` 19 for that thread alone, torch on one
thread), so that it takes the CPU only when the system leaves some. Once a model is at or
below the target it calls ``reached`` once, and the system stops at its next boundary.

The watcher only decides when to stop: the figures of the report (samples, seconds and bytes
to the target) come from the evaluation of every model after the system stopped, as for a
run of fixed length. A watcher that lags behind costs the run a few more windows, never a
wrong figure.

:func:`head_weights` reads a certified head's weights from a running node's blob store by
its content address (verified against it), without the data directory's lock the node
holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from p2ptrain.bench.convergence_task import Task, build_workload
from p2ptrain.errors import LocalError

__all__ = ["POLL_S", "TargetWatch", "head_weights"]

#: How often the watcher looks for a newer model.
POLL_S = 1.0
#: The watcher thread's niceness: the system's own processes come first.
NICE = 19

Weights = Mapping[str, torch.Tensor]
#: The newest model a system left: a key that changes with each new one, and how to load it.
Newest = Callable[[], tuple[str, Callable[[], Weights]] | None]


def head_weights(data_dir: Path, weights_blob: str) -> dict[str, torch.Tensor]:
    """The weights in blob ``weights_blob`` of the node at ``data_dir`` (read while it runs:
    blobs are written once, under their SHA-256, and checked against it here)."""
    from p2ptrain.core.tensors import decode_state_dict
    from p2ptrain.store.datadir import BLOBS_DIR

    path = data_dir / BLOBS_DIR / weights_blob[:2] / weights_blob
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LocalError(f"cannot read head weights {path}: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != weights_blob:
        raise LocalError(f"{path} does not hash to its name: the node's blob store is damaged")
    return decode_state_dict(data)


class TargetWatch:
    """Evaluates ``newest()`` whenever it names a new model, on a niced thread, until one is
    at or below ``target`` (then ``reached`` is called once) or :meth:`close`."""

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

    def __enter__(self) -> TargetWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # a kernel that refuses: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        workload = build_workload(self.task, threads=1)  # torch's work on this thread
        last: str | None = None
        while not self._stop.wait(self.poll_s):
            newest = self._newest()
            if newest is None or newest[0] == last:
                continue
            last, load = newest
            try:
                loss = workload.evaluate(load())
            except LocalError as exc:
                self.error = str(exc)
                return
            self.seen.append((last, loss))
            if loss <= self.target:
                self.done.set()
                self._reached()
                return
