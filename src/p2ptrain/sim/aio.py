"""An asyncio event loop on the simulator's virtual clock.

The node's own runner and peer services (:mod:`p2ptrain.driver`) are asyncio code: tasks,
task groups, timeouts, sleeps, hedged questions. :class:`SimLoop` runs them inside a
:class:`~.engine.Simulator` run, deterministically: its clock is the simulator's, every
``call_at``/``call_later`` (and so every sleep and timeout) is a simulator timer, and the
callbacks made ready (a task's next step, a future's callbacks) run in FIFO order in one
simulator event at the current virtual time. Nothing waits on the wall clock or on I/O
(there is none: the virtual network delivers by simulator events), so the same seed gives
the same run, bit for bit.

An exception no task or callback handled (a role's bug, not a fault the driver reports) is
kept in :attr:`SimLoop.errors`; the world fails the run with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextvars import Context
from typing import Any, TypeVarTuple

from p2ptrain.sim.engine import Simulator, Timer

__all__ = ["SimLoop"]

Ts = TypeVarTuple("Ts")


class _SimTimerHandle(asyncio.TimerHandle):
    """An asyncio timer whose cancellation also cancels its simulator event."""

    __slots__ = ("_timer",)

    _timer: Timer | None

    def cancel(self) -> None:
        super().cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class SimLoop(asyncio.BaseEventLoop):
    """The loop of one simulated world (see the module docstring)."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self._sim = sim
        #: A drain is queued in the simulator, or running: new ready callbacks join it.
        self._draining = False
        #: What went wrong unhandled, in words (empty in a sound run).
        self.errors: list[str] = []

    def time(self) -> float:
        return self._sim.now

    def call_at(
        self,
        when: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        handle = _SimTimerHandle(when, callback, args, self, context)
        handle._timer = self._sim.call_at(max(when, self._sim.now), lambda: self._fire(handle))
        return handle

    def _call_soon(
        self, callback: Callable[..., object], args: Any, context: Context | None
    ) -> asyncio.Handle:
        handle: asyncio.Handle = super()._call_soon(callback, args, context)  # type: ignore[misc]
        if not self._draining:
            self._draining = True
            self._sim.call_later(0.0, self._drain)
        return handle

    def _fire(self, handle: _SimTimerHandle) -> None:
        handle._timer = None
        if not handle.cancelled():
            self._ready.append(handle)  # type: ignore[attr-defined]
            self._draining = True
            self._drain()

    def _drain(self) -> None:
        """Run every ready callback, and those they make ready, at the current time."""
        ready = self._ready  # type: ignore[attr-defined]
        try:
            while ready:
                handle = ready.popleft()
                if not handle.cancelled():
                    handle._run()
        finally:
            self._draining = False

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        error = context.get("exception")
        message = context.get("message", "")
        self.errors.append(f"{message}: {error!r}" if error is not None else str(message))

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Make this the running loop (of this thread) for the block: the simulator's run."""
        previous = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        try:
            yield
        finally:
            asyncio.events._set_running_loop(previous)

    def settle(self) -> None:
        """Cancel every task still pending and let them finish (the end of a run)."""
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        for task in tasks:
            task.cancel()
        self._draining = True
        self._drain()
