"""Blocking work (building the workload, training a generation) on daemon threads, awaited
from the member's event loop.

A daemon thread, not the loop's executor: a thread stuck in a collective (until its timeout)
must not keep a member that was asked to stop from exiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["start_in_thread"]

T = TypeVar("T")


def start_in_thread(
    name: str, function: Callable[..., T], *args: Any, **kw: Any
) -> asyncio.Future[T]:
    """Start ``function(*args, **kw)`` on a daemon thread of its own; the future of its
    result (or of what it raised). Call it from the running event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = function(*args, **kw)
        except BaseException as error:
            loop.call_soon_threadsafe(settle, None, error)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
