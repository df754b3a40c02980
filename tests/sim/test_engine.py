"""The simulator's event engine and network: hand-computed delivery times (all values exact in
binary, so times compare with ``==``), event order, timers, run limits, determinism by seed,
partitions, crashed nodes, statistics and configuration errors."""

from __future__ import annotations

import functools
import math
import random

import pytest

from p2ptrain.errors import LocalError
from p2ptrain.sim.engine import LinkSpec, Network, NetworkStatistics, Partition, Simulator

SEED = 7_919

Delivery = tuple[float, str, str, object]  # (time, sender, receiver, message)


def make_network(
    links: dict[str, LinkSpec], seed: int = SEED
) -> tuple[Simulator, Network, list[Delivery]]:
    """A network of the given nodes whose handlers append to one delivery log."""
    sim = Simulator(random.Random(seed))
    network = Network(sim)
    log: list[Delivery] = []
    for name, link in links.items():

        def handler(sender: str, message: object, name: str = name) -> None:
            log.append((sim.now, sender, name, message))

        network.add_node(name, handler, link)
    return sim, network, log


def accounted(stats: NetworkStatistics) -> int:
    return (
        stats.messages_delivered
        + stats.messages_dropped_loss
        + stats.messages_dropped_partition
        + stats.messages_dropped_down
        + stats.messages_in_flight
    )


# --- delivery times -------------------------------------------------------------------------


def test_one_message_by_hand() -> None:
    # uplink 500 B / 1000 B/s = 0.5; propagation 0.125 + 0.25; downlink 500 / 2000 = 0.25.
    sim, network, log = make_network({"a": LinkSpec(0.125, 1000.0), "b": LinkSpec(0.25, 2000.0)})
    network.send("a", "b", "hello", 500)
    assert sim.run() == 2  # arrival on b's downlink, then delivery
    assert log == [(1.125, "a", "b", "hello")]
    assert sim.now == 1.125


def test_back_to_back_messages_queue_on_the_senders_uplink() -> None:
    # Both leave a's uplink in turn (0.5 s each) though they go to different receivers.
    sim, network, log = make_network(
        {"a": LinkSpec(0.125, 1000.0), "b": LinkSpec(0.25, 2000.0), "c": LinkSpec(0.0, 1000.0)}
    )
    network.send("a", "b", "first", 500)
    network.send("a", "c", "second", 500)
    network.send("a", "b", "third", 500)
    sim.run()
    assert log == [
        (1.125, "a", "b", "first"),  # 0.5 + 0.375 + 0.25
        (1.625, "a", "c", "second"),  # 1.0 + 0.125 + 0.5
        (2.125, "a", "b", "third"),  # 1.5 + 0.375 + 0.25; b's downlink idle since 1.125
    ]


def test_a_slow_receivers_downlink_is_the_bottleneck() -> None:
    # a and c transmit in parallel (own uplinks, 1 s each) and both arrive at 1.0; b's downlink
    # takes 2 s per message and serves them in insertion order.
    fast = LinkSpec(0.0, 1000.0)
    sim, network, log = make_network({"a": fast, "c": fast, "b": LinkSpec(0.0, 500.0)})
    network.send("a", "b", "from a", 1000)
    network.send("c", "b", "from c", 1000)
    sim.run()
    assert log == [(3.0, "a", "b", "from a"), (5.0, "c", "b", "from c")]


def test_the_downlink_serves_messages_in_order_of_arrival_not_of_sending() -> None:
    # far's message is sent first but arrives at 10.0; near's arrives at 0.0 and must not wait
    # behind it on b's downlink (1 s per message).
    sim, network, log = make_network(
        {"far": LinkSpec(10.0, math.inf), "near": LinkSpec(0.0, math.inf), "b": LinkSpec(0.0, 500)}
    )
    network.send("far", "b", "far", 500)
    network.send("near", "b", "near", 500)
    sim.run()
    assert log == [(1.0, "near", "b", "near"), (11.0, "far", "b", "far")]


def test_a_link_change_applies_to_later_transmissions() -> None:
    sim, network, log = make_network({"a": LinkSpec(0.0, 1000.0), "b": LinkSpec(0.0, math.inf)})
    network.send("a", "b", 1, 1000)
    network.set_link("a", LinkSpec(0.0, 250.0))
    network.send("a", "b", 2, 1000)  # starts at 1.0 on the new, slower uplink
    sim.run()
    assert log == [(1.0, "a", "b", 1), (5.0, "a", "b", 2)]


def test_a_message_to_oneself_costs_nothing_and_is_counted() -> None:
    sim, network, log = make_network({"a": LinkSpec(0.0, 1000.0), "b": LinkSpec(0.0, math.inf)})
    sim.call_at(2.0, lambda: network.send("a", "a", "note", 10_000))
    sim.call_at(2.0, lambda: network.send("a", "b", "out", 1000))
    sim.run()
    # The self-message did not occupy a's uplink: "out" takes exactly 1 s.
    assert log == [(2.0, "a", "a", "note"), (3.0, "a", "b", "out")]
    assert network.statistics().messages_delivered == 2
    assert network.statistics().bytes_delivered == 11_000


def test_broadcast_skips_the_sender_and_keeps_the_order() -> None:
    link = LinkSpec(0.0, 1000.0)
    sim, network, log = make_network({"a": link, "b": link, "c": link, "d": link})
    network.broadcast("a", ["d", "a", "b", "c"], "all", 1000)
    sim.run()
    assert log == [(2.0, "a", "d", "all"), (3.0, "a", "b", "all"), (4.0, "a", "c", "all")]
    assert network.statistics().sent_by_node == {"a": 3, "b": 0, "c": 0, "d": 0}


def test_handler_exceptions_propagate() -> None:
    sim = Simulator(random.Random(SEED))
    network = Network(sim)

    def broken(sender: str, message: object) -> None:
        raise RuntimeError(f"bug handling {message!r} from {sender}")

    network.add_node("a", broken)
    network.add_node("b", broken)
    network.send("a", "b", "x", 1)
    with pytest.raises(RuntimeError, match="bug handling 'x' from a"):
        sim.run()


# --- events and timers ----------------------------------------------------------------------


def test_events_at_equal_times_run_in_insertion_order() -> None:
    sim = Simulator(random.Random(SEED))
    order: list[str] = []

    def first_at_one() -> None:
        order.append("a")
        sim.call_later(0.0, lambda: order.append("d"))  # same time, queued after b and c

    sim.call_at(1.0, first_at_one)
    sim.call_at(1.0, lambda: order.append("b"))
    sim.call_at(0.5, lambda: order.append("early"))
    sim.call_later(1.0, lambda: order.append("c"))
    assert sim.run() == 5
    assert order == ["early", "a", "b", "c", "d"]


def test_a_cancelled_timer_never_runs() -> None:
    sim = Simulator(random.Random(SEED))
    ran: list[str] = []
    keep = sim.call_at(1.0, lambda: ran.append("keep"))
    drop = sim.call_at(1.0, lambda: ran.append("drop"))
    late = sim.call_at(2.0, lambda: ran.append("late"))
    sim.call_at(1.5, late.cancel)  # cancelled by an earlier event while running
    drop.cancel()
    drop.cancel()  # twice is harmless
    assert drop.cancelled
    assert not keep.cancelled
    assert sim.pending == 3
    assert sim.run() == 2
    assert ran == ["keep"]
    assert late.cancelled
    assert sim.pending == 0
    keep.cancel()  # after it ran: no effect
    assert not keep.cancelled
    assert sim.pending == 0


def test_many_cancelled_timers_are_compacted_and_the_rest_still_run() -> None:
    sim = Simulator(random.Random(SEED))
    ran: list[int] = []
    timers = [sim.call_at(float(i), functools.partial(ran.append, i)) for i in range(3000)]
    for timer in timers:
        if timer.when % 1000 != 0:
            timer.cancel()
    assert sim.pending == 3
    assert len(sim._heap) < 3000  # compaction happened
    assert sim.run() == 3
    assert ran == [0, 1000, 2000]


def test_run_until_leaves_later_events_pending_and_sets_now() -> None:
    sim = Simulator(random.Random(SEED))
    ran: list[float] = []
    for when in (1.0, 2.0, 3.0):
        sim.call_at(when, lambda: ran.append(sim.now))
    assert sim.run(until=2.0) == 2  # an event at exactly `until` runs
    assert (ran, sim.now, sim.pending) == ([1.0, 2.0], 2.0, 1)
    assert sim.run(until=2.5) == 0
    assert sim.now == 2.5
    assert sim.run() == 1
    assert (ran, sim.now, sim.pending) == ([1.0, 2.0, 3.0], 3.0, 0)
    assert sim.run(until=10.0) == 0
    assert sim.now == 10.0
    with pytest.raises(LocalError, match="until"):
        sim.run(until=9.0)
    with pytest.raises(LocalError, match="now"):
        sim.call_at(9.0, lambda: None)
    with pytest.raises(LocalError, match="delay"):
        sim.call_later(-1.0, lambda: None)


def test_stop_returns_after_the_current_event() -> None:
    sim = Simulator(random.Random(SEED))
    ran: list[str] = []
    sim.call_at(1.0, lambda: ran.append("a"))
    sim.call_at(1.0, sim.stop)
    sim.call_at(1.0, lambda: ran.append("b"))
    assert sim.run(until=5.0) == 2
    assert (ran, sim.now, sim.pending) == (["a"], 1.0, 1)
    assert sim.run() == 1
    assert ran == ["a", "b"]


def test_max_events_stops_a_runaway_loop_with_a_helpful_message() -> None:
    sim = Simulator(random.Random(SEED))

    def again() -> None:
        if sim.now < 1000.0:  # without the guard, fail here instead of hanging
            sim.call_later(0.25, again)

    sim.call_at(0.0, again)
    with pytest.raises(LocalError, match=r"after max_events=100 events at virtual time 24\.75"):
        sim.run(max_events=100)
    assert sim.pending == 1  # the due event was not run


def test_max_events_allows_exactly_that_many() -> None:
    sim = Simulator(random.Random(SEED))
    for when in range(5):
        sim.call_at(float(when), lambda: None)
    with pytest.raises(LocalError, match="max_events=4"):
        sim.run(max_events=4)
    assert sim.run(max_events=1) == 1  # the fifth, alone


def test_run_cannot_be_reentered_from_an_event() -> None:
    sim = Simulator(random.Random(SEED))

    def reenter() -> None:
        sim.run()

    sim.call_at(1.0, reenter)
    with pytest.raises(LocalError, match="inside an event"):
        sim.run()


# --- determinism ----------------------------------------------------------------------------


def lossy_gossip_log(seed: int) -> list[Delivery]:
    """Twelve nodes on lossy links of different speeds; each forwards what it hears once."""
    layout = random.Random(1)  # the topology is fixed; only the simulation seed varies
    links = {
        f"n{i}": LinkSpec(layout.uniform(0.001, 0.05), layout.uniform(1e5, 1e7), loss=0.25)
        for i in range(12)
    }
    sim = Simulator(random.Random(seed))
    network = Network(sim)
    log: list[Delivery] = []
    names = list(links)
    seen: set[tuple[str, object]] = set()
    for name in names:

        def forward(sender: str, message: object, name: str = name) -> None:
            log.append((sim.now, sender, name, message))
            if (name, message) not in seen:
                seen.add((name, message))
                network.broadcast(name, names, message, 20_000)

        network.add_node(name, forward, links[name])
    for i, name in enumerate(names[:3]):
        network.broadcast(name, names, f"rumour {i}", 20_000)
    sim.run(max_events=100_000)
    return log


def test_the_same_seed_gives_the_same_log_bit_for_bit() -> None:
    first, second = lossy_gossip_log(SEED), lossy_gossip_log(SEED)
    assert len(first) > 100, f"seed {SEED}: too few deliveries to compare"
    assert [repr(d) for d in first] == [repr(d) for d in second], f"seed {SEED}"


def test_a_different_seed_gives_a_different_log() -> None:
    other = SEED + 1
    assert lossy_gossip_log(SEED) != lossy_gossip_log(other), f"seeds {SEED} and {other}"


def test_a_network_without_loss_draws_no_randomness() -> None:
    sim, network, _ = make_network({"a": LinkSpec(), "b": LinkSpec()})
    before = sim.rng.getstate()
    for _ in range(10):
        network.send("a", "b", None, 100)
    sim.run()
    assert sim.rng.getstate() == before, f"seed {SEED}"
    network.set_link("b", LinkSpec(loss=0.5))
    network.send("a", "b", None, 100)  # max(0, 0.5) > 0: exactly one draw
    expected = random.Random()
    expected.setstate(before)
    expected.random()
    assert sim.rng.getstate() == expected.getstate(), f"seed {SEED}"


# --- partitions, crashes and statistics -----------------------------------------------------


def test_partition_drops_during_and_delivers_after() -> None:
    link = LinkSpec(0.0, math.inf)
    sim, network, log = make_network({"a": link, "b": link, "c": link})
    network.add_partition(Partition(1.0, 2.0, (frozenset({"a"}), frozenset({"b"}))))
    for when in (0.5, 1.0, 1.5, 2.0):
        sim.call_at(when, lambda: network.send("a", "b", sim.now, 1))
        sim.call_at(when, lambda: network.send("a", "c", sim.now, 1))  # c is in no group
    sim.run()
    assert [(t, r) for t, _, r, _ in log] == [
        (0.5, "b"),
        (0.5, "c"),
        (1.0, "c"),
        (1.5, "c"),
        (2.0, "b"),
        (2.0, "c"),
    ]
    assert network.statistics().messages_dropped_partition == 2
    assert not network.can_reach("a", "b", at=1.0)
    assert network.can_reach("a", "b", at=2.0)  # the interval is half-open
    assert network.can_reach("a", "c", at=1.5)
    assert network.can_reach("b", "c", at=1.5)
    assert network.can_reach("a", "b")  # now = 2.0


def test_a_message_in_flight_is_dropped_when_a_partition_begins_before_it_arrives() -> None:
    # 0.5 + 0.5 s of latency: sent at 0.5 (no partition yet), due at 1.5 (partitioned).
    link = LinkSpec(0.5, math.inf)
    sim, network, log = make_network({"a": link, "b": link})
    network.add_partition(Partition(1.0, math.inf, (frozenset({"a"}), frozenset({"b"}))))
    sim.call_at(0.5, lambda: network.send("a", "b", "doomed", 1))
    sim.call_at(0.5, lambda: network.send("a", "a", "to self", 1))  # same group as itself
    sim.run()
    assert log == [(0.5, "a", "a", "to self")]
    stats = network.statistics()
    assert (stats.messages_dropped_partition, stats.messages_in_flight) == (1, 0)


def test_a_message_sent_across_a_partition_is_dropped_even_if_it_heals_in_flight() -> None:
    link = LinkSpec(0.5, math.inf)
    sim, network, log = make_network({"a": link, "b": link})
    network.add_partition(Partition(0.0, 0.5, (frozenset({"a"}), frozenset({"b"}))))
    network.send("a", "b", "too early", 1)  # due at 1.0, after the partition
    sim.run()
    assert log == []
    assert network.statistics().messages_dropped_partition == 1


def test_down_nodes_send_nothing_and_drop_what_reaches_them() -> None:
    link = LinkSpec(0.5, 1000.0)
    sim, network, log = make_network({"a": link, "b": link})
    network.set_up("b", False)
    assert not network.is_up("b")
    assert not network.can_reach("a", "b")
    network.send("b", "a", "from the dead", 1000)  # nothing happens, a's uplink untouched
    network.send("a", "b", "lost", 1000)  # due at 3.0, b still down then
    sim.call_at(2.5, lambda: network.send("a", "b", "saved", 1000))  # due at 5.5
    sim.call_at(4.0, lambda: network.set_up("b", True))
    assert sim.pending == 3  # "from the dead" scheduled nothing
    sim.run()
    assert log == [(5.5, "a", "b", "saved")]
    stats = network.statistics()
    assert stats.messages_dropped_down == 2
    assert stats.sent_by_node == {"a": 2, "b": 1}


def test_statistics_add_up_in_flight_and_after() -> None:
    link = LinkSpec(0.25, 1000.0)
    sim, network, _ = make_network(
        {"a": link, "b": link, "c": link, "lossy": LinkSpec(0.25, 1000.0, loss=1.0)}
    )
    network.add_partition(Partition(0.0, 10.0, (frozenset({"a", "b"}), frozenset({"c"}))))
    network.send("a", "b", 1, 500)  # delivered at 0.5 + 0.5 + 0.5 = 1.5
    network.send("a", "b", 2, 500)  # delivered at 2.0
    network.send("a", "c", 3, 500)  # partition
    network.send("b", "lossy", 4, 100)  # loss = 1.0
    network.set_up("c", False)
    network.send("c", "a", 5, 100)  # sender down
    network.send("b", "a", 6, 250)  # b's uplink is busy until 0.1: delivered at 1.1
    sim.run(until=1.5)
    mid = network.statistics()
    assert mid.messages_sent == 6
    assert (mid.messages_delivered, mid.messages_in_flight) == (2, 1), mid
    assert (mid.messages_dropped_loss, mid.messages_dropped_partition) == (1, 1)
    assert mid.messages_dropped_down == 1
    assert accounted(mid) == mid.messages_sent
    assert mid.messages_in_flight == sim.pending
    sim.run()
    end = network.statistics()
    assert (end.messages_delivered, end.messages_in_flight) == (3, 0)
    assert accounted(end) == end.messages_sent == 6
    assert end.bytes_sent == 500 * 3 + 100 * 2 + 250
    assert end.bytes_delivered == 500 * 2 + 250
    assert end.sent_by_node == {"a": 3, "b": 2, "c": 1, "lossy": 0}


def test_unknown_and_duplicate_nodes_are_local_errors() -> None:
    _, network, _ = make_network({"a": LinkSpec()})
    with pytest.raises(LocalError, match="already"):
        network.add_node("a", lambda sender, message: None)
    for call in (
        lambda: network.send("a", "ghost", None, 1),
        lambda: network.send("ghost", "a", None, 1),
        lambda: network.set_up("ghost", True),
        lambda: network.can_reach("a", "ghost"),
    ):
        with pytest.raises(LocalError, match="unknown node 'ghost'"):
            call()
    with pytest.raises(LocalError, match="size_bytes"):
        network.send("a", "a", None, -1)
    assert network.statistics().messages_sent == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("latency_s", -0.001),
        ("latency_s", math.inf),
        ("latency_s", math.nan),
        ("bandwidth_bytes_s", 0.0),
        ("bandwidth_bytes_s", -5.0),
        ("bandwidth_bytes_s", math.nan),
        ("loss", -0.1),
        ("loss", 1.5),
        ("loss", math.nan),
    ],
)
def test_link_spec_errors_name_the_field(field: str, value: float) -> None:
    with pytest.raises(LocalError, match=rf"LinkSpec\.{field} must be .*, got {value!r}"):
        LinkSpec(**{field: value})


def test_link_spec_accepts_its_boundaries() -> None:
    LinkSpec(latency_s=0.0, bandwidth_bytes_s=math.inf, loss=1.0)
    LinkSpec(loss=0.0)


def test_partition_errors_name_the_field() -> None:
    a, b = frozenset({"a"}), frozenset({"b"})
    with pytest.raises(LocalError, match=r"Partition\.start_s"):
        Partition(-1.0, 1.0, (a, b))
    with pytest.raises(LocalError, match=r"Partition\.end_s"):
        Partition(1.0, 1.0, (a, b))
    with pytest.raises(LocalError, match="disjoint"):
        Partition(0.0, 1.0, (a, frozenset({"a", "b"})))
    with pytest.raises(LocalError, match="frozenset of node names"):
        Partition(0.0, 1.0, ("ab", "cd"))  # type: ignore[arg-type]
