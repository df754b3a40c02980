"""Our own messages reach this node's handlers after the code that published them returned,
in order, and never from inside a handler (no re-entrancy), with or without an event loop;
a body goes on as its id, is asked for once and served once, and nobody is sent a kind it
skips."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Attestation
from p2ptrain.net.config import NetConfig
from p2ptrain.net.gossip import Delivered, GossipRouter, message_id_of
from p2ptrain.net.wire import Frame, Gossip, Have, Subscribe, Want, decode_frame

TOPIC = "exp/" + "ab" * 32
ME = Identity.from_seed(bytes(32))


def _attestation(height: int) -> bytes:
    signed = seal(
        ME,
        Attestation(
            experiment_id="ab" * 32,
            height=height,
            head_id=hashlib.sha256(str(height).encode()).hexdigest(),
            validator=ME.public_key,
            round=0,
            stage="commit",
        ),
    )
    return bytes(signed.envelope.encode())


class Recorder:
    """A handler that publishes the next height once, for the first two heights, and
    records how deep in handlers each delivery came."""

    def __init__(self, router: GossipRouter) -> None:
        self.router = router
        self.depth = 0
        self.seen: list[tuple[int, int]] = []

    def __call__(self, message: Delivered) -> None:
        self.depth += 1
        try:
            height = message.record.record.height  # type: ignore[union-attr]
            self.seen.append((height, self.depth))
            if height < 3:
                self.router.publish(TOPIC, "attestation", _attestation(height + 1))
        finally:
            self.depth -= 1


def _router() -> tuple[GossipRouter, Recorder]:
    router = GossipRouter(NetConfig(), strike=lambda *_: None, drop=lambda *_: None)
    recorder = Recorder(router)
    router.subscribe(TOPIC, recorder)
    return router, recorder


def test_without_a_loop_own_messages_are_delivered_in_turn_never_nested() -> None:
    router, recorder = _router()
    assert router.publish(TOPIC, "attestation", _attestation(1))
    assert recorder.seen == [(1, 1), (2, 1), (3, 1)]


def test_with_a_loop_own_messages_are_delivered_after_the_publisher_returned() -> None:
    router, recorder = _router()

    async def publish() -> list[tuple[int, int]]:
        router.publish(TOPIC, "attestation", _attestation(1))
        assert recorder.seen == []  # not from inside the publishing code
        for _ in range(5):
            await asyncio.sleep(0)
        return recorder.seen

    assert asyncio.run(publish()) == [(1, 1), (2, 1), (3, 1)]


def test_a_message_published_again_is_not_delivered_twice() -> None:
    router, recorder = _router()
    data = _attestation(7)
    assert router.publish(TOPIC, "attestation", data)
    assert not router.publish(TOPIC, "attestation", data)
    assert router.publish(TOPIC, "attestation", data, again=True)
    assert recorder.seen == [(7, 1)]


# -- bodies once, ids to the rest ---------------------------------------------------------


class Neighbour:
    """A neighbour's connection as the router sees it: what was sent to it, decoded."""

    def __init__(self, name: str, *, skip: tuple[str, ...] = ()) -> None:
        self.peer_id = name
        self.topics = frozenset({TOPIC})
        self.skip = frozenset(skip)
        self.closed = False
        self.sent: list[Frame] = []
        self.arrived = asyncio.Event()

    def send(self, frame: bytes) -> None:
        self.sent.append(decode_frame(frame, max_bytes=1 << 20))
        self.arrived.set()

    def of(self, kind: type[Frame]) -> list[Frame]:
        return [f for f in self.sent if isinstance(f, kind)]


def _meshed(*neighbours: Neighbour, **config: Any) -> tuple[GossipRouter, list[Delivered]]:
    router = GossipRouter(NetConfig(**config), strike=lambda *_: None, drop=lambda *_: None)
    delivered: list[Delivered] = []
    router.subscribe(TOPIC, delivered.append)
    for neighbour in neighbours:
        router.connections[neighbour.peer_id] = neighbour  # type: ignore[assignment]
    return router, delivered


def test_a_body_goes_on_as_its_id_to_the_neighbours_that_lack_it() -> None:
    a, b, c = Neighbour("a"), Neighbour("b"), Neighbour("c")
    router, delivered = _meshed(a, b, c)
    data = _attestation(1)
    router.receive(c, Have([message_id_of(data)]))  # type: ignore[arg-type]
    router.receive(a, Gossip(TOPIC, "attestation", data))  # type: ignore[arg-type]
    assert len(delivered) == 1
    assert a.of(Have) == [] and c.of(Have) == []  # a sent it, c announced it
    assert b.of(Have) == [Have([message_id_of(data)])]
    assert all(not n.of(Gossip) for n in (a, b, c))  # no body pushed on
    router.receive(b, Gossip(TOPIC, "attestation", data))  # type: ignore[arg-type]
    assert len(delivered) == 1 and router.statistics().duplicates == 1


def test_an_announced_message_is_asked_for_once_and_served_once() -> None:
    a, b = Neighbour("a"), Neighbour("b")
    router, delivered = _meshed(a, b)
    data = _attestation(2)
    message_id = message_id_of(data)
    router.receive(a, Have([message_id]))  # type: ignore[arg-type]
    router.receive(b, Have([message_id]))  # type: ignore[arg-type]
    assert a.of(Want) == [Want([message_id])] and b.of(Want) == []
    router.receive(a, Gossip(TOPIC, "attestation", data))  # type: ignore[arg-type]
    assert len(delivered) == 1
    assert b.of(Have) == []  # b announced it: it holds it
    router.receive(b, Want([message_id, b"\x09" * 16]))  # type: ignore[arg-type]
    router.receive(b, Want([message_id]))  # type: ignore[arg-type]
    assert b.of(Gossip) == [Gossip(TOPIC, "attestation", data)]  # once; the unknown id: none
    assert router.statistics().served == 1


def test_a_neighbour_that_skips_a_kind_is_sent_neither_bodies_nor_ids() -> None:
    trainer, validator = Neighbour("t", skip=("attestation",)), Neighbour("v")
    router, _ = _meshed(trainer, validator)
    router.publish(TOPIC, "attestation", _attestation(3))
    assert trainer.sent == [] and len(validator.of(Gossip)) == 1
    other = _attestation(4)
    router.receive(validator, Gossip(TOPIC, "attestation", other))  # type: ignore[arg-type]
    assert trainer.sent == []


def test_a_node_that_skips_a_kind_drops_its_bodies_and_says_so() -> None:
    neighbour = Neighbour("n")
    router, delivered = _meshed(neighbour, gossip_skip=("attestation",))
    assert decode_frame(router.hello(), max_bytes=4096) == Subscribe([TOPIC], ["attestation"])
    router.receive(neighbour, Gossip(TOPIC, "attestation", _attestation(5)))  # type: ignore[arg-type]
    assert delivered == [] and router.statistics().unwanted == 1


def test_without_a_body_in_time_the_next_neighbour_that_announced_it_is_asked() -> None:
    silent, helpful = Neighbour("s"), Neighbour("h")
    router, delivered = _meshed(silent, helpful, want_timeout_s=0.05)
    data = _attestation(6)
    message_id = message_id_of(data)

    async def run() -> None:
        router.receive(silent, Have([message_id]))  # type: ignore[arg-type]
        router.receive(helpful, Have([message_id]))  # type: ignore[arg-type]
        assert helpful.of(Want) == []
        await asyncio.wait_for(helpful.arrived.wait(), 10)
        assert helpful.of(Want) == [Want([message_id])]
        router.receive(helpful, Gossip(TOPIC, "attestation", data))  # type: ignore[arg-type]

    asyncio.run(run())
    assert len(delivered) == 1 and silent.of(Want) == [Want([message_id])]
