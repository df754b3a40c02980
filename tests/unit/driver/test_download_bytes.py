"""A node files the bytes of its downloads by kind as they land: a fetch that fails or is
cancelled moved bytes too, and the wire counters will have seen them."""

from __future__ import annotations

import asyncio
import contextlib
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

BLOB = "ab" * 32


class _Downloaded:
    seconds = 0.25

    @property
    def bytes_by_provider(self) -> dict[str, int]:
        return {"http://a": 300}


class _HalfwayNet:
    """A transport whose downloads deliver some bytes, then fail, stall or finish."""

    address = None

    def __init__(self, ending: str) -> None:
        self.ending = ending
        self.stalled = asyncio.Event()

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
        assert on_bytes is not None
        on_bytes(100)
        on_bytes(200)
        if self.ending == "fails":
            raise TransportError("http://a: connection reset after 300 bytes")
        if self.ending == "stalls":
            self.stalled.set()
            await asyncio.Event().wait()
        return _Downloaded()


def _services(tmp_path: Path, net: _HalfwayNet) -> tuple[PeerServices, DataDir]:
    datadir = DataDir(tmp_path).__enter__()
    services = PeerServices(
        net=net,  # type: ignore[arg-type]
        identity=identity(5),
        store=NodeStore(datadir),
        storage=StorageHealth(str(tmp_path)),
        experiment_id="e" * 64,
        bootstrap=("http://a",),
        keeps_records=True,
        emit=lambda event: None,
        admit=lambda signed: ACCEPTED,
        on_adopted=lambda machine, adopted: None,
    )
    return services, datadir


@pytest.mark.parametrize("ending", ["finishes", "fails", "stalls"])
def test_the_bytes_of_every_download_are_filed_by_kind_however_it_ends(
    tmp_path: Path, ending: str
) -> None:
    net = _HalfwayNet(ending)
    services, datadir = _services(tmp_path, net)

    async def fetch() -> None:
        download = asyncio.create_task(services.download(BLOB, kind="aggregate"))
        if ending == "stalls":  # cancelled as a node that stops cancels its fetches
            await net.stalled.wait()
            download.cancel()
        raised = {"finishes": None, "fails": TransportError, "stalls": asyncio.CancelledError}
        expected = raised[ending]
        with contextlib.nullcontext() if expected is None else pytest.raises(expected):
            await download

    try:
        asyncio.run(fetch())
    finally:
        datadir.__exit__(None, None, None)
    received = services.telemetry.received
    assert received["aggregate"] == 300, (ending, received)
    assert sum(received.values()) == 300
