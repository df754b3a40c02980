"""A blob the node's collector deletes between its landing and the fetching task's turn to
read it (its window passed meanwhile, on a node whose other role is ahead) is fetched once
more; lost twice, the fetch failed as a fetch (TransportError), not as the role's error."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.errors import TransportError
from p2ptrain.node.persist import NodeStore
from p2ptrain.protocol.intake import ACCEPTED
from p2ptrain.store.datadir import DataDir
from tests.support.builders import identity

DATA = b"an update's bytes" * 64
BLOB = hashlib.sha256(DATA).hexdigest()


class _Landed:
    seconds = 0.01

    @property
    def bytes_by_provider(self) -> dict[str, int]:
        return {"http://a": len(DATA)}


class _CollectingNet:
    """A transport whose downloads land the blob, after which the collector deletes it
    ``collected`` times before anyone reads it."""

    address = None

    def __init__(self, store: NodeStore, collected: int) -> None:
        self.store = store
        self.collected = collected
        self.downloads = 0

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
    ) -> _Landed:
        self.downloads += 1
        assert self.store.blobs.put(DATA) == blob_id
        if self.collected > 0:
            self.collected -= 1
            self.store.blobs.delete(blob_id)
        return _Landed()


def _fetch(tmp_path: Path, collected: int, how: str) -> tuple[Any, int]:
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        net = _CollectingNet(store, collected)
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
        if how == "update":
            source = asyncio.run(services.fetch_update_blob(BLOB, size=len(DATA)))
            got = bytes(source.read(0, len(DATA)))
            source.close()
        else:
            got = bytes(asyncio.run(services.fetch_blob(BLOB, kind="aggregate")))
        return got, net.downloads


@pytest.mark.parametrize("how", ["update", "aggregate"])
def test_a_blob_collected_as_it_landed_is_fetched_again(tmp_path: Path, how: str) -> None:
    assert _fetch(tmp_path, collected=1, how=how) == (DATA, 2)


@pytest.mark.parametrize("how", ["update", "aggregate"])
def test_a_blob_collected_twice_is_a_failed_fetch(tmp_path: Path, how: str) -> None:
    with pytest.raises(TransportError, match=f"blob {BLOB[:12]} was collected twice"):
        _fetch(tmp_path, collected=2, how=how)
