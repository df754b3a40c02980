"""A discrete-event engine and a message network on virtual time, deterministic bit for bit:
no wall clock, threads, asyncio or global RNG (the caller passes a :class:`random.Random`), so
the same seed and calls give the same event order and the same float delivery times.

:class:`Simulator` runs callbacks in ``(time, insertion order)``. :class:`Network` delivers
messages between named nodes; the delivery model of :meth:`Network.send`:

* Unknown sender or receiver: :class:`LocalError`. A sender that is down sends nothing (the
  attempt counts as ``messages_dropped_down``).
* Each node's :class:`LinkSpec` is its access link: an uplink and a downlink, each a FIFO with
  the link's bandwidth, and ``latency_s``, the one-way delay of that access link alone.
* The message occupies the sender's uplink from ``max(now, uplink_free_at)`` for
  ``size / sender.bandwidth``; it then propagates for ``sender.latency_s + receiver.latency_s``
  and arrives; from ``max(arrival, downlink_free_at)`` it occupies the receiver's downlink for
  ``size / receiver.bandwidth`` and is delivered at the end of that. Downlinks are served in
  order of arrival (ties by insertion order), so a slow node's own link is the bottleneck
  without any per-pair state. A link change applies to transmissions that start after it.
* Loss: when ``p = max(sender.loss, receiver.loss) > 0`` one ``sim.rng.random()`` is drawn per
  send and the message is lost when it is ``< p``; a network without loss draws nothing. A lost
  message still occupies the sender's uplink (the sender cannot know) and is counted at once.
* Partitions (:class:`Partition`) are checked twice: when the message is sent (then it still
  occupies the uplink and is dropped at once) and when it would be delivered, so a message in
  flight when a partition begins is dropped too (``messages_dropped_partition``).
* A receiver that is down when the message would be delivered drops it
  (``messages_dropped_down``); it still occupied the receiver's downlink.
* A message to oneself is delivered by a zero-delay event, with no link cost, loss or
  partition, but is counted like any other and dropped if the node is down by then.
* Delivery calls the receiver's handler as ``handler(sender, message)``. Exceptions from a
  handler propagate out of :meth:`Simulator.run`: they are bugs.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeAlias

from p2ptrain.errors import LocalError

__all__ = ["Handler", "LinkSpec", "Network", "NetworkStatistics", "Partition", "Simulator", "Timer"]

#: ``handler(sender, message)``, called when a message is delivered to a node.
Handler: TypeAlias = Callable[[str, object], None]

# A queue entry: (time, insertion number, function, argument): ``function(argument)``, or
# with function None, ``argument`` is a Timer. Network messages allocate nothing else.
_Entry: TypeAlias = tuple[float, int, Callable[[Any], None] | None, Any]

_COMPACT_MIN_CANCELLED = 1024


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise LocalError(f"{field} must be {rule}, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One node's access link. ``latency_s`` is the one-way delay of this link alone (a message
    takes the sender's plus the receiver's); ``bandwidth_bytes_s`` is the capacity of the
    uplink and, separately, of the downlink (``math.inf`` means no limit); ``loss`` is the
    probability that a message through this link is dropped."""

    latency_s: float = 0.02
    bandwidth_bytes_s: float = 12.5e6
    loss: float = 0.0

    def __post_init__(self) -> None:
        latency, bandwidth, loss = self.latency_s, self.bandwidth_bytes_s, self.loss
        _require(math.isfinite(latency) and latency >= 0, "LinkSpec.latency_s", ">= 0", latency)
        _require(bandwidth > 0, "LinkSpec.bandwidth_bytes_s", "> 0 (inf: no limit)", bandwidth)
        _require(0.0 <= loss <= 1.0, "LinkSpec.loss", "in [0, 1]", loss)


@dataclass(frozen=True, slots=True)
class Partition:
    """A network split, active for virtual times ``start_s <= t < end_s`` (``end_s`` may be
    ``math.inf``). Two nodes in different groups cannot exchange messages while it is active;
    nodes in the same group can. A node in no group is unaffected and reaches everyone.
    Groups must be disjoint frozensets of node names (names need not exist yet)."""

    start_s: float
    end_s: float
    groups: tuple[frozenset[str], ...]

    def __post_init__(self) -> None:
        start, end = self.start_s, self.end_s
        _require(math.isfinite(start) and start >= 0, "Partition.start_s", ">= 0", start)
        _require(end > start, "Partition.end_s", f"> start_s ({start!r})", end)
        seen: set[str] = set()
        for group in self.groups:
            ok = isinstance(group, frozenset) and all(isinstance(n, str) for n in group)
            _require(ok, "each of Partition.groups", "a frozenset of node names", group)
            _require(seen.isdisjoint(group), "Partition.groups", "disjoint", self.groups)
            seen |= group


class Timer:
    """A scheduled callback, returned by :meth:`Simulator.call_at`; :meth:`cancel` stops it."""

    __slots__ = ("_action", "_cancelled", "_sim", "when")

    def __init__(self, sim: Simulator, when: float, action: Callable[[], None]) -> None:
        self._sim: Simulator | None = sim  # None once the timer has run
        self._action = action
        self._cancelled = False
        self.when = when  # the virtual time at which the action runs

    def cancel(self) -> None:
        """Make sure the action never runs. No effect once it has run or if already cancelled."""
        if self._sim is not None and not self._cancelled:
            self._cancelled = True
            self._sim._note_cancelled()

    @property
    def cancelled(self) -> bool:
        """True when :meth:`cancel` was called before the action ran."""
        return self._cancelled


class Simulator:
    """Virtual time and an event queue; events run in ``(time, insertion order)``. ``rng`` is
    the caller's :class:`random.Random`, the one source of randomness inside the simulation."""

    __slots__ = ("_cancelled", "_heap", "_now", "_running", "_seq", "_stopping", "rng")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._now = 0.0
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cancelled = 0  # cancelled timers still in the heap (lazy deletion)
        self._running = False
        self._stopping = False

    @property
    def now(self) -> float:
        """The virtual time in seconds; 0.0 at the start."""
        return self._now

    @property
    def pending(self) -> int:
        """How many events are waiting to run (cancelled timers not counted)."""
        return len(self._heap) - self._cancelled

    def call_at(self, when: float, action: Callable[[], None]) -> Timer:
        """Run ``action()`` at virtual time ``when`` (``now`` or later, finite)."""
        if not (math.isfinite(when) and when >= self._now):
            raise LocalError(f"call_at({when!r}): time must be finite and >= now ({self._now!r})")
        timer = Timer(self, when, action)
        heapq.heappush(self._heap, (when, next(self._seq), None, timer))
        return timer

    def call_later(self, delay: float, action: Callable[[], None]) -> Timer:
        """Run ``action()`` ``delay`` virtual seconds from now (``delay >= 0``, finite)."""
        if not (math.isfinite(delay) and delay >= 0):
            raise LocalError(f"call_later delay must be a finite number >= 0, got {delay!r}")
        return self.call_at(self._now + delay, action)

    def run(self, until: float | None = None, *, max_events: int | None = None) -> int:
        """Run events in order and return how many ran. Stops when the queue is empty, when the
        next event is after ``until`` (events at exactly ``until`` run), or after the event that
        called :meth:`stop`. With ``until`` and no :meth:`stop`, ``now`` is ``until`` afterwards.
        ``max_events`` guards against runaway loops: when one more event is due after that many
        ran, :class:`LocalError` is raised and the due event stays queued."""
        if self._running:
            raise LocalError("Simulator.run() was called from inside an event; schedule instead")
        if until is not None and not (math.isfinite(until) and until >= self._now):
            raise LocalError(f"run(until={until!r}) must be finite and >= now ({self._now!r})")
        _require(max_events is None or max_events >= 0, "run(max_events)", ">= 0", max_events)
        limit_time = math.inf if until is None else until
        limit_events = -1 if max_events is None else max_events
        heap = self._heap
        heappop = heapq.heappop
        ran = 0
        self._running = True
        self._stopping = False
        try:
            while heap and not self._stopping:
                entry = heap[0]
                when = entry[0]
                if when > limit_time:
                    break
                function, argument = entry[2], entry[3]
                if function is None and argument._cancelled:
                    heappop(heap)
                    self._cancelled -= 1
                    continue
                if ran == limit_events:
                    raise LocalError(
                        f"run() stopped after max_events={ran} events at virtual time {self._now!r}"
                        f" s with more due at {when!r} s; an event probably reschedules itself"
                        " without end. Raise max_events if the load is real."
                    )
                heappop(heap)
                self._now = when
                ran += 1
                if function is None:
                    argument._sim = None
                    argument._action()
                else:
                    function(argument)
            if until is not None and not self._stopping:
                self._now = until
        finally:
            self._running = False
        return ran

    def stop(self) -> None:
        """Make the current :meth:`run` return after the event that is running now."""
        if self._running:
            self._stopping = True

    def _schedule(self, when: float, function: Callable[[Any], None], argument: Any) -> None:
        """Queue ``function(argument)`` at ``when``; uncancellable, for :class:`Network`."""
        heapq.heappush(self._heap, (when, next(self._seq), function, argument))

    def _note_cancelled(self) -> None:
        self._cancelled += 1
        heap = self._heap
        if self._cancelled >= _COMPACT_MIN_CANCELLED and 2 * self._cancelled > len(heap):
            heap[:] = [e for e in heap if e[2] is not None or not e[3]._cancelled]
            heapq.heapify(heap)  # in place: a running loop keeps its reference
            self._cancelled = 0


@dataclass(frozen=True, slots=True)
class NetworkStatistics:
    """Counters of a :class:`Network`. Every send attempt is in ``messages_sent`` and, once,
    in exactly one of ``messages_delivered``, the three ``messages_dropped_*`` counters or
    ``messages_in_flight``. ``bytes_sent`` sums the sizes of all attempts,
    ``bytes_delivered`` those of delivered messages."""

    messages_sent: int
    messages_delivered: int
    messages_dropped_loss: int
    messages_dropped_partition: int
    messages_dropped_down: int
    messages_in_flight: int
    bytes_sent: int
    bytes_delivered: int
    #: Send attempts per node, in the order the nodes were added.
    sent_by_node: Mapping[str, int]


@dataclass(slots=True, eq=False)
class _Node:
    name: str
    handler: Handler
    link: LinkSpec
    up: bool = True
    uplink_free_at: float = 0.0
    downlink_free_at: float = 0.0
    sent: int = 0  # send attempts


# One per message: (sender, receiver, message, size in bytes).
_Flight: TypeAlias = tuple[_Node, _Node, object, int]


class Network:
    """Named nodes exchanging messages on a :class:`Simulator` (delivery model: see the module
    docstring). ``default`` is the :class:`LinkSpec` of nodes added without one."""

    def __init__(self, sim: Simulator, default: LinkSpec = LinkSpec()) -> None:
        self._sim = sim
        self._default = default
        self._nodes: dict[str, _Node] = {}
        self._partitions: list[tuple[float, float, dict[str, int]]] = []
        self._arrive_bound = self._arrive  # bound once, not per message
        self._deliver_bound = self._deliver
        self._sent = self._delivered = self._in_flight = 0
        self._dropped_loss = self._dropped_partition = self._dropped_down = 0
        self._bytes_sent = self._bytes_delivered = 0

    def add_node(self, node: str, handler: Handler, link: LinkSpec | None = None) -> None:
        """Add a node (up) whose messages go to ``handler``; ``link`` defaults to the network's."""
        if node in self._nodes:
            raise LocalError(f"node {node!r} is already in the network; node names are unique")
        self._nodes[node] = _Node(node, handler, self._default if link is None else link)

    def set_link(self, node: str, link: LinkSpec) -> None:
        """Give ``node`` a new access link (for example a slow one) from now on."""
        self._node(node).link = link

    def add_partition(self, partition: Partition) -> None:
        """Split the network during ``partition``'s interval (partitions may overlap)."""
        where = {name: i for i, group in enumerate(partition.groups) for name in group}
        self._partitions.append((partition.start_s, partition.end_s, where))

    def set_up(self, node: str, up: bool) -> None:
        """Crash (``False``) or restart (``True``) ``node``. A node that is down sends nothing
        and messages reaching it are dropped; messages it sent earlier still travel."""
        self._node(node).up = up

    def is_up(self, node: str) -> bool:
        """Whether ``node`` is up."""
        return self._node(node).up

    def can_reach(self, a: str, b: str, at: float | None = None) -> bool:
        """Whether both nodes are up now and no partition active at ``at`` (default: now)
        separates them. Up state is the current one even for another ``at``."""
        node_a, node_b = self._node(a), self._node(b)
        when = self._sim.now if at is None else at
        return node_a.up and node_b.up and not self._separated(a, b, when)

    def send(self, sender: str, receiver: str, message: object, size_bytes: int) -> None:
        """Send ``message`` of ``size_bytes`` from ``sender`` to ``receiver``."""
        source, target = self._node(sender), self._node(receiver)
        _require(size_bytes >= 0, "send(size_bytes)", ">= 0", size_bytes)
        self._sent += 1
        self._bytes_sent += size_bytes
        source.sent += 1
        if not source.up:
            self._dropped_down += 1
            return
        sim = self._sim
        now = sim._now
        if source is target:
            self._in_flight += 1
            sim._schedule(now, self._deliver_bound, (source, target, message, size_bytes))
            return
        out_link, in_link = source.link, target.link
        start = source.uplink_free_at if source.uplink_free_at > now else now
        sent_at = start + size_bytes / out_link.bandwidth_bytes_s
        source.uplink_free_at = sent_at
        loss = out_link.loss if out_link.loss > in_link.loss else in_link.loss
        if loss > 0.0 and sim.rng.random() < loss:
            self._dropped_loss += 1
            return
        if self._partitions and self._separated(sender, receiver, now):
            self._dropped_partition += 1
            return
        self._in_flight += 1
        arrival = sent_at + out_link.latency_s + in_link.latency_s
        sim._schedule(arrival, self._arrive_bound, (source, target, message, size_bytes))

    def broadcast(
        self, sender: str, receivers: Iterable[str], message: object, size_bytes: int
    ) -> None:
        """:meth:`send` to each receiver in the given order, skipping ``sender`` itself."""
        for receiver in receivers:
            if receiver != sender:
                self.send(sender, receiver, message, size_bytes)

    def statistics(self) -> NetworkStatistics:
        """A frozen snapshot of the counters."""
        return NetworkStatistics(
            messages_sent=self._sent,
            messages_delivered=self._delivered,
            messages_dropped_loss=self._dropped_loss,
            messages_dropped_partition=self._dropped_partition,
            messages_dropped_down=self._dropped_down,
            messages_in_flight=self._in_flight,
            bytes_sent=self._bytes_sent,
            bytes_delivered=self._bytes_delivered,
            sent_by_node=MappingProxyType({n.name: n.sent for n in self._nodes.values()}),
        )

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            raise LocalError(f"unknown node {name!r}; add it with Network.add_node() first")
        return node

    def _separated(self, a: str, b: str, at: float) -> bool:
        for start, end, where in self._partitions:
            if start <= at < end:
                group_a, group_b = where.get(a), where.get(b)
                if group_a is not None and group_b is not None and group_a != group_b:
                    return True
        return False

    def _arrive(self, flight: _Flight) -> None:
        target = flight[1]
        now = self._sim._now
        start = target.downlink_free_at if target.downlink_free_at > now else now
        done = start + flight[3] / target.link.bandwidth_bytes_s
        target.downlink_free_at = done
        self._sim._schedule(done, self._deliver_bound, flight)

    def _deliver(self, flight: _Flight) -> None:
        source, target, message, size_bytes = flight
        self._in_flight -= 1
        if not target.up:
            self._dropped_down += 1
        elif self._partitions and self._separated(source.name, target.name, self._sim._now):
            self._dropped_partition += 1
        else:
            self._delivered += 1
            self._bytes_delivered += size_bytes
            target.handler(source.name, message)
