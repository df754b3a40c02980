"""A real node's :class:`~p2ptrain.driver.transport.Transport`: its network (:class:`NetNode`,
the HTTP client that asks one peer) and its blob store, with the verifying, resumable,
multi-provider :class:`~p2ptrain.net.transfer.BlobFetcher` for blobs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from p2ptrain.core.records import PeerRecord
from p2ptrain.driver.transport import ProviderNote
from p2ptrain.net.client import HeadLinks, WindowRecords
from p2ptrain.net.node import NetNode
from p2ptrain.net.transfer import BlobFetcher, FetchResult
from p2ptrain.store.blobs import BlobStore

__all__ = ["NetTransport"]


class NetTransport:
    """``net`` and ``blobs`` behind the driver's seam; a blob download gives up on a
    provider after ``fetch_timeout_s``."""

    def __init__(self, net: NetNode, blobs: BlobStore, *, fetch_timeout_s: float) -> None:
        self.net = net
        self._blobs = blobs
        self._fetch_timeout_s = fetch_timeout_s
        self._fetcher: BlobFetcher | None = None
        self._notes: tuple[ProviderNote, ProviderNote] | None = None

    @property
    def address(self) -> str | None:
        return self.net.address

    @property
    def roles(self) -> Sequence[str]:
        return self.net.roles

    def known_peers(self) -> Iterator[PeerRecord]:
        return (signed.record for signed in self.net.peers)

    def peer_record(self, peer_id: str) -> PeerRecord | None:
        signed = self.net.peers.get(peer_id)
        return None if signed is None else signed.record

    def address_of(self, peer_id: str) -> str | None:
        return self.net.address_of(peer_id)

    def last_heard(self, peer_id: str, now: float) -> float | None:
        return self.net.last_heard(peer_id, now)

    def strike(self, peer_id: str, reason: str) -> None:
        self.net.strike(peer_id, reason)

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> None:
        self.net.publish(topic, kind, data, again=again)

    async def wait_connected(self) -> None:
        await self.net.wait_connected()

    async def head_links(self, address: str, experiment_id: str, after: int) -> HeadLinks:
        return await self.net.client.head_links(address, experiment_id, after)

    async def window_records(self, address: str, experiment_id: str, window: int) -> WindowRecords:
        return await self.net.client.window_records(address, experiment_id, window)

    async def record(self, address: str, record_id: str) -> bytes:
        return await self.net.client.record(address, record_id)

    async def push_blob(self, address: str, blob_id: str) -> int:
        path = self._blobs.path(blob_id)
        return path.stat().st_size if await self.net.client.push_blob(address, blob_id, path) else 0

    async def download(
        self,
        blob_id: str,
        providers: Sequence[str],
        *,
        size: int | None,
        on_bad: ProviderNote,
        on_fault: ProviderNote,
        on_bytes: Callable[[int], None] | None = None,
    ) -> FetchResult:
        fetcher = self._blob_fetcher(on_bad, on_fault)
        if on_bytes is None:
            return await fetcher.fetch(blob_id, providers, size=size)
        counted: dict[str, int] = {}

        def progress(address: str, total: int) -> None:  # the fetcher tells running totals
            on_bytes(total - counted.get(address, 0))
            counted[address] = total

        return await fetcher.fetch(blob_id, providers, size=size, on_progress=progress)

    def _blob_fetcher(self, on_bad: ProviderNote, on_fault: ProviderNote) -> BlobFetcher:
        """One fetcher for the node (it fetches each blob once however many ask), built on
        the first download with the notes of the node's one provider book."""
        if self._fetcher is None or self._notes != (on_bad, on_fault):
            config = self.net.config
            self._notes = (on_bad, on_fault)
            self._fetcher = BlobFetcher(
                self.net.client,
                self._blobs,
                timeout_s=self._fetch_timeout_s,
                probe_timeout_s=config.probe_timeout_s,
                min_rate=config.min_fetch_rate,
                on_bad_provider=on_bad,
                on_fault=on_fault,
            )
        return self._fetcher
