"""The driver's clock: the running event loop's time.

A node's loop keeps :func:`time.monotonic`; the simulator's loop keeps virtual time, so the
runner, its timers and the peer services' memories (faults, hedges, reports) run on the
simulated clock unchanged."""

from __future__ import annotations

import asyncio
import time

__all__ = ["now"]


def now() -> float:
    """The running loop's time (:func:`time.monotonic` outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
