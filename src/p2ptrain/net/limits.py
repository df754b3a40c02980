"""Bounds on what a peer can make a node do: token buckets and a bounded seen-set."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SeenSet", "TokenBucket"]


class TokenBucket:
    """``rate`` tokens per second up to ``burst``. ``take`` says how long to wait first.

    Time is passed in (seconds, monotonic) so the bucket is pure and testable.
    """

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = now

    def take(self, amount: float, now: float) -> float:
        """Spend ``amount`` tokens; return the seconds the caller must wait before acting
        (0 when the bucket covered it). Debt is allowed, so a large message is not starved."""
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= amount
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class SeenSet:
    """Message ids seen recently: at most ``capacity`` of them, none older than ``ttl``."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, message_id: bytes) -> bool:
        return message_id in self._seen

    def add(self, message_id: bytes, now: float) -> bool:
        """Record ``message_id``; return False if it was seen within ``ttl`` (a duplicate)."""
        self._expire(now)
        if message_id in self._seen:
            return False
        self._seen[message_id] = now
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True

    def seen(self, message_id: bytes, now: float) -> bool:
        """Whether ``message_id`` was seen within ``ttl``."""
        self._expire(now)
        return message_id in self._seen

    def _expire(self, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) < now - self.ttl:
            self._seen.popitem(last=False)
