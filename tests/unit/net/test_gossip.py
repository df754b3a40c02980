"""Our own messages reach this node's handlers after the code that published them returned,
in order, and never from inside a handler (no re-entrancy), with or without an event loop."""

from __future__ import annotations

import asyncio
import hashlib

from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Attestation
from p2ptrain.net.config import NetConfig
from p2ptrain.net.gossip import Delivered, GossipRouter

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
