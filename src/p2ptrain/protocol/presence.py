"""Which trainers a participant expects to report in the open window (the early close on
expected trainers, docs/protocol.md §10).

A trainer is expected when it reported in the window before (its update reached us, in
time or late) and the node heard from it within the presence timeout (a record, or its
presence on the network, directly or through a peer). A peer record alone makes nobody
expected (anyone can sign one). Without a timeout (the simulator, a node told to wait for
every deadline) nobody is expected and no window closes early this way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["LATE_WINDOWS", "Presence"]

#: An update for one of this many windows before the open one (come after its window
#: closed) makes its trainer expected in the open window.
LATE_WINDOWS = 3


class Presence:
    """When each trainer was last heard from, and who reported in the window before."""

    def __init__(self, timeout_s: float | None, most: int) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"presence_timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        #: At most this many trainers are known from the window before (``max_updates``).
        self.most = most
        #: trainer key -> when it was last heard from (bounded: the node reports the
        #: trainers of its peer book, and entries older than the timeout are dropped)
        self.heard: dict[bytes, float] = {}
        #: The trainers that reported in the window before the open one (its updates, and
        #: those that arrived late for it).
        self.reporters_before: set[bytes] = set()

    def new_window(self, reported: Iterable[bytes]) -> None:
        """A window opens; ``reported``: who reported in the one that closed (nobody, when
        the window opened is not the next one)."""
        self.reporters_before = set(reported)

    def heard_from(self, trainer: bytes, when: float) -> None:
        if self.timeout_s is None:
            return
        if when > self.heard.get(trainer, -math.inf):
            self.heard[trainer] = when

    def late(self, now: float, trainer: bytes, behind: int) -> None:
        """An update of ``trainer`` for the window ``behind`` windows before the open one
        came after its window closed: it trains with us, but slower than the windows (it just
        joined, or came back), and is expected from now on, or windows that close early
        would never wait for it."""
        if 1 <= behind <= LATE_WINDOWS and len(self.reporters_before) < self.most:
            self.reporters_before.add(trainer)
            self.heard_from(trainer, now)

    def expected(self, now: float) -> frozenset[bytes]:
        """The trainers that reported in the window before and were heard from within the
        timeout (the lapsed are forgotten)."""
        timeout = self.timeout_s
        if timeout is None:
            return frozenset()
        for key in [k for k, t in self.heard.items() if now - t > timeout]:
            del self.heard[key]
        return frozenset(k for k in self.heard if k in self.reporters_before)

    def counts(self, arrived: int, min_updates: int) -> bool:
        """Whether the expected trainers can close a window holding ``arrived`` updates."""
        return (
            self.timeout_s is not None and bool(self.reporters_before) and (arrived >= min_updates)
        )

    def all_reported(self, now: float, reported: frozenset[bytes]) -> bool:
        return self.expected(now) <= reported

    def next_lapse(self, now: float, reported: frozenset[bytes]) -> float | None:
        """When the next expected trainer that has not reported stops being expected."""
        timeout = self.timeout_s
        if timeout is None:
            return None
        lapses = [
            t + timeout
            for k, t in self.heard.items()
            if k not in reported and k in self.reporters_before
        ]
        after = [t for t in lapses if t > now]
        return min(after) + 1e-3 if after else None
