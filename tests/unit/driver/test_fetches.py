"""A follower fetches a certified head's aggregate at the size the head carries: no provider
is asked for the size first (one round trip less in every window, on every follower)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from p2ptrain.driver.fetches import answer
from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.node.persist import NodeStore
from p2ptrain.protocol.effects import AggregateFetch
from p2ptrain.protocol.intake import ACCEPTED
from p2ptrain.store.datadir import DataDir
from tests.support.builders import head, identity


class _Downloaded:
    seconds = 0.01

    @property
    def bytes_by_provider(self) -> dict[str, int]:
        return {"http://a": 64}


class _RecordingNet:
    """A transport that records what each download was asked for and stores the blob."""

    address = None

    def __init__(self, store: NodeStore, body: bytes) -> None:
        self.store, self.body = store, body
        self.asked: list[tuple[str, int | None]] = []

    def known_peers(self) -> list[Any]:
        return []

    def address_of(self, peer_id: str) -> str | None:
        return None

    async def download(
        self,
        blob_id: str,
        providers: Sequence[str],
        *,
        size: int | None,
        on_bad: Callable[[str, str], None],
        on_fault: Callable[[str, str], None],
        on_bytes: Callable[[int], None] | None = None,
    ) -> _Downloaded:
        self.asked.append((blob_id, size))
        self.store.blobs.put(self.body)
        return _Downloaded()


def test_an_aggregate_is_fetched_at_the_size_its_certified_head_names(tmp_path: Path) -> None:
    body = b"aggregate bytes"
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        net = _RecordingNet(store, body)
        services = PeerServices(
            net=net,  # type: ignore[arg-type]
            identity=identity(5),
            store=store,
            storage=StorageHealth(str(tmp_path)),
            experiment_id="e" * 64,
            bootstrap=("http://a",),
            keeps_records=True,
            emit=lambda event: None,
            admit=lambda signed: ACCEPTED,
            on_adopted=lambda machine, adopted: None,
        )
        blob_id = store.blobs.put(body)
        store.blobs.delete(blob_id)  # its id, not held: it has to be fetched
        certified = msgspec.structs.replace(
            head("e" * 64), aggregate_blob=blob_id, aggregate_bytes=len(body)
        )
        got = asyncio.run(
            answer(services, lambda: 0, AggregateFetch(certified, certified.id, first=()))
        )
    assert bytes(got) == body
    assert net.asked == [(blob_id, len(body))]
