"""Bounded intake: an admitted outsider floods the network with validly signed junk.

A real network (a seed, a reducer, two validators with quorum 2, two trainers) trains
while an outsider -- a key the open network admits, speaking the real ``/ws`` gossip
protocol from this test's process -- sends 300 signed updates for a window far ahead of
everyone's and then 120 signed proposals of ~0.95 MiB from a key that is neither a reducer
nor a validator. Nothing of it may be kept or forwarded: compared with an equally long
stretch of the same network without the flood, no node's ``node.db`` or RSS grows by more
than 20 MB; the far-future updates strike nobody (a lagging node must not strike honest
forwarders), the proposals get their signer banned, and the network keeps certifying.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2ptrain.core.envelope import Signed, open_envelope, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
from p2ptrain.core.records import Head, Proposal, Update
from p2ptrain.driver.services import experiment_topic
from p2ptrain.net.client import fetch_network_manifest
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection
from p2ptrain.net.node import NetNode
from p2ptrain.net.wire import Gossip, encode_frame
from p2ptrain.store.blobs import BlobStore
from tests.support.local_net import Net, new_net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

MB = 1 << 20
#: What the flood may add to a node's disk or memory, over the same stretch without it.
MARGIN_BYTES = 20 * MB
FUTURE_UPDATES = 300
JUNK_PROPOSALS = 120
PROPOSAL_BYTES = int(0.95 * MB)
#: Windows certified in each measured stretch.
STRETCH_WINDOWS = 2
WINDOW_TIMEOUT_S = 90.0
NODES = ["seed", "reducer-0", "validator-0", "validator-1", "trainer-0", "trainer-1"]


@dataclass(frozen=True)
class Footprint:
    db: int
    rss: int


def _footprint(net: Net, name: str) -> Footprint:
    directory = net.data_dir(name)
    db = sum(
        path.stat().st_size
        for path in directory.glob("node.db*")  # the database and its write-ahead log
        if path.is_file()
    )
    pid = net.network.nodes[name].process.pid
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return Footprint(db, rss_kib * 1024)


def _footprints(net: Net) -> dict[str, Footprint]:
    return {name: _footprint(net, name) for name in NODES}


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("junk-flood"))
    try:
        net.launch(validators=2, reducers=1, trainers=2, quorum=2, deadline_s=10.0)
        yield net
    finally:
        net.close()


def _wait_windows(net: Net, windows: int) -> int:
    target = net.heights["seed"] + windows
    net.wait_height("seed", target, WINDOW_TIMEOUT_S)
    return target


class Outsider:
    """A key the open network admits, sending validly signed junk over ``/ws``."""

    def __init__(self, seed_address: str, experiment_id: str, open_window: int, head: str):
        self.identity = Identity.generate()
        self.seed_address = seed_address
        self.experiment_id = experiment_id
        self.open_window = open_window
        self.head = head
        self.sent = {"update": 0, "proposal": 0}
        self.closed_because: list[str] = []
        self.close_codes: list[int | None] = []

    async def run(self) -> None:
        raw = await fetch_network_manifest(self.seed_address)
        network = open_envelope(raw, NetworkManifest).record
        with tempfile.TemporaryDirectory() as blobs:
            node = NetNode(
                identity=self.identity,
                network=network,
                blobs=BlobStore(blobs),
                config=NetConfig(host=None, bootstrap=(self.seed_address,)),
                roles=("trainer",),
            )
            async with node:
                manifest_raw = await node.client.record(self.seed_address, self.experiment_id)
                manifest = open_envelope(manifest_raw, ExperimentManifest).record
                topic = experiment_topic(self.experiment_id)
                connection = await self._subscribed_connection(node, topic)
                for index in range(FUTURE_UPDATES):
                    await self._send(node, topic, "update", self._future_update(manifest, index))
                # not struck for them: still connected, still not banned
                assert not connection.closed, connection.close_reason
                for index in range(JUNK_PROPOSALS):
                    await self._send(node, topic, "proposal", self._junk_proposal(index))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(30):
                        await connection.wait_closed()
                self.closed_because.append(connection.close_reason)
                self.close_codes.append(connection.close_code)

    async def _subscribed_connection(self, node: NetNode, topic: str) -> PeerConnection:
        async with asyncio.timeout(30):
            while True:
                for connection in node.gossip.connections.values():
                    if topic in connection.topics:
                        return connection
                await asyncio.sleep(0.05)

    async def _send(self, node: NetNode, topic: str, kind: str, signed: Signed[object]) -> None:
        frame = encode_frame(Gossip(topic, kind, bytes(signed.envelope.encode())))
        for connection in list(node.gossip.connections.values()):
            if topic in connection.topics and not connection.closed:
                await connection.send_wait(frame, timeout_s=30)
        self.sent[kind] += 1

    def _future_update(self, manifest: ExperimentManifest, index: int) -> Signed[Update]:
        shards = tuple(sorted(s.name for s in manifest.dataset.shards))
        update = Update(
            experiment_id=self.experiment_id,
            window=self.open_window + 50 + index,
            base_head=secrets.token_hex(32),
            trainer=self.identity.public_key,
            lease_shards=shards,
            lease_samples=manifest.lease_size,
            delta_blob=secrets.token_hex(32),
            delta_bytes=1024,
            codec=manifest.codec.name,
            loss_before=1.0,
            loss_after=0.5,
        )
        return seal(self.identity, update)

    def _junk_proposal(self, index: int) -> Signed[Proposal]:
        # each id is in the proposal and its head: ~2 x 67 bytes of msgpack per id
        ids = tuple(sorted(secrets.token_hex(32) for _ in range(PROPOSAL_BYTES // 134)))
        aggregate = secrets.token_hex(32)
        head = Head(
            experiment_id=self.experiment_id,
            height=self.open_window,
            parent=self.head,
            weights_blob=secrets.token_hex(32),
            optimizer_blob=None,
            accepted=ids,
            aggregate_blob=aggregate,
        )
        proposal = Proposal(
            experiment_id=self.experiment_id,
            window=self.open_window,
            base_head=self.head,
            reducer=self.identity.public_key,
            accepted=ids,
            rejected=(),
            aggregate_blob=aggregate,
            head=head,
        )
        return seal(self.identity, proposal)


def test_a_junk_flood_is_neither_kept_nor_forwarded(net: Net) -> None:
    _wait_windows(net, 1)  # everyone is in step
    before = _footprints(net)
    _wait_windows(net, STRETCH_WINDOWS)
    quiet = _footprints(net)

    status = net.status("seed")
    seed = net.network.nodes["seed"]
    assert seed.address is not None
    outsider = Outsider(seed.address, status["experiment_id"], status["height"] + 1,
                        status["head_id"])  # fmt: skip
    started = time.monotonic()
    asyncio.run(outsider.run())
    flood_s = time.monotonic() - started
    _wait_windows(net, STRETCH_WINDOWS)  # the network keeps certifying
    after = _footprints(net)

    assert outsider.sent == {"update": FUTURE_UPDATES, "proposal": JUNK_PROPOSALS}, outsider.sent
    grown, table = [], []
    for name in NODES:
        for part in ("db", "rss"):
            quiet_growth = getattr(quiet[name], part) - getattr(before[name], part)
            flood_growth = getattr(after[name], part) - getattr(quiet[name], part)
            table.append(f"{name} {part} {quiet_growth / MB:+.1f}/{flood_growth / MB:+.1f} MB")
            if flood_growth > max(0, quiet_growth) + MARGIN_BYTES:
                grown.append(f"{name} {part} +{flood_growth / MB:.1f} MB "
                             f"(+{quiet_growth / MB:.1f} MB without the flood)")  # fmt: skip
    print(f"flood {flood_s:.1f} s; growth without/with the flood: {'; '.join(table)}")
    net.check(not grown, f"the flood ({flood_s:.1f} s) was kept: {'; '.join(grown)}")
    # the proposal sender was banned: the seed closed its connection and counts it
    net.check(
        any("banned" in reason for reason in outsider.closed_because),
        f"the seed did not ban the proposal sender: {outsider.closed_because}",
    )
    # ... with the close code docs/protocol.md promises for misbehaviour
    net.check(1008 in outsider.close_codes, f"banned socket closed with {outsider.close_codes}")
    net.wait("the seed to count the ban", 10, lambda: net.status("seed")["banned"] >= 1)
    # nobody was struck for the far-future updates: they only count as ignored
    for name in ("seed", "validator-0", "validator-1"):
        reports = net.status(name).get("reports", [])
        net.check(
            not any("far ahead" in str(r) for r in reports),
            f"{name} reported a peer for far-future updates: {reports}",
        )
