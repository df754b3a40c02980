"""Blob downloads between real processes on loopback: failover when a provider dies
mid-transfer, a provider serving corrupted bytes found and reported, resume after a
cancelled fetch, and a clear error when nobody holds the blob.

Each provider is a child process (``tests/support/blob_provider_child.py``) running a
NetNode with its own store; it reports its address on stdout. The tests wait for conditions
(never sleep) and a fixture reaps every child.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient
from p2ptrain.net.range_answer import BadAnswer, RangeRequest
from p2ptrain.net.range_reader import RangeReader, RangeReaderStatistics
from p2ptrain.net.transfer import BlobFetcher
from p2ptrain.store.blobs import BlobStore
from tests.support.blob_provider_child import identity, network

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tests.support.blob_provider_child"
SEED = 20_250_601
UP_TIMEOUT_S = 30.0
MIB = 1 << 20
T = TypeVar("T")


@dataclass
class Provider:
    label: str
    process: subprocess.Popen[bytes]
    address: str
    blob: str | None


Spawn = Callable[..., list[Provider]]


@pytest.fixture
def spawn_providers(tmp_path: Path) -> Iterator[Spawn]:
    """Start provider children (all at once) and wait for their addresses; on teardown
    close their stdin, and kill any that does not exit."""
    children: list[subprocess.Popen[bytes]] = []

    def spawn(*specs: dict[str, Any]) -> list[Provider]:
        started = []
        for spec in specs:
            label = spec["seed"]
            argument = json.dumps({"data_dir": str(tmp_path / f"provider-{label}"), **spec})
            with open(tmp_path / f"provider-{label}.log", "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", CHILD, argument],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            children.append(process)
            started.append((label, process))
        return [
            Provider(label, process, up["address"], up["blob"])
            for label, process in started
            for up in [_first_line(process, tmp_path / f"provider-{label}.log")]
        ]

    yield spawn
    for process in children:
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
    for process in children:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def _first_line(process: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    lines: queue.Queue[bytes] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=UP_TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"provider sent no address within {UP_TIMEOUT_S}s: {log.read_text()}")
    if not line:
        pytest.fail(f"provider exited with {process.wait()}: {log.read_text()}")
    up: dict[str, Any] = json.loads(line)
    return up


def seeded_blob(tmp_path: Path, size: int, seed: int) -> tuple[Path, bytes, str]:
    print(f"blob of {size} bytes from seed {seed}")
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"blob-{seed}"
    path.write_bytes(data)
    return path, data, hashlib.sha256(data).hexdigest()


def with_fetcher(root: Path, scenario: Callable[[BlobFetcher], Awaitable[T]], **options: Any) -> T:
    async def run() -> T:
        client = PeerClient(ClientCredentials(network(), identity("fetcher"), secret=None))
        try:
            with BlobStore(root) as store:
                return await scenario(BlobFetcher(client, store, **options))
        finally:
            await client.close()

    return asyncio.run(run())


def partial_files(root: Path) -> list[str]:
    directory = root / "partial"
    return sorted(os.listdir(directory)) if directory.exists() else []


def stored(root: Path, blob: str) -> bytes:
    with BlobStore(root) as store:
        return bytes(store.get(blob))  # get() verifies the hash


def test_a_provider_killed_mid_transfer_is_replaced_from_the_byte_reached(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 64 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED)
    providers = spawn_providers(*({"seed": f"p{i}", "blob": str(path)} for i in range(3)))
    victim = providers[1]
    killed_after: list[int] = []

    def kill_victim(address: str, received: int) -> None:
        if address == victim.address and not killed_after:
            victim.process.send_signal(signal.SIGKILL)
            killed_after.append(received)

    async def scenario(fetcher: BlobFetcher) -> Any:
        result = await fetcher.fetch(blob, [p.address for p in providers], on_progress=kill_victim)
        return result, fetcher.statistics()

    # One stream per provider and 16 MiB chunks: the victim's first chunk cannot have been
    # sent whole before the kill (socket buffers hold a few MiB), and a chunk is left over
    # for it to ask for, so it fails either way.
    result, statistics = with_fetcher(
        tmp_path / "fetcher", scenario, chunk_bytes=16 * MIB, streams_per_provider=1
    )
    assert victim.process.wait(timeout=10) == -signal.SIGKILL
    assert killed_after, "the victim never sent a byte"
    assert result.size == size
    assert victim.address in result.failed_providers
    assert result.bad_providers == ()
    assert 0 < result.bytes_by_provider[victim.address] < size
    # The victim's unfinished chunk went on from the byte reached: no byte was fetched twice.
    assert sum(result.bytes_by_provider.values()) == size
    assert statistics.failovers >= 1 and statistics.fetches == 1
    assert stored(tmp_path / "fetcher", blob) == data
    assert partial_files(tmp_path / "fetcher") == []


def test_a_provider_serving_corrupted_bytes_is_proven_bad_and_reported(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 32 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 1)
    honest = {"blob": str(path)}
    providers = spawn_providers(
        {"seed": "honest-1", **honest},
        {"seed": "liar", **honest, "corrupt_every": MIB},
        {"seed": "honest-2", **honest},
    )
    liar = providers[1]
    reports: list[tuple[str, str]] = []

    async def scenario(fetcher: BlobFetcher) -> Any:
        result = await fetcher.fetch(blob, [p.address for p in providers], size=size)
        return result, fetcher.statistics()

    result, statistics = with_fetcher(
        tmp_path / "fetcher",
        scenario,
        chunk_bytes=4 * MIB,
        on_bad_provider=lambda address, reason: reports.append((address, reason)),
    )
    assert [address for address, _ in reports] == [liar.address]
    assert "differ from the blob that verified" in reports[0][1]
    assert result.bad_providers == (liar.address,)
    assert statistics.bad_providers == 1
    assert stored(tmp_path / "fetcher", blob) == data
    assert partial_files(tmp_path / "fetcher") == []


def test_when_no_provider_serves_matching_bytes_nobody_is_blamed(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 8 * MIB
    path, _, blob = seeded_blob(tmp_path, size, SEED + 2)
    providers = spawn_providers(
        {"seed": "liar-1", "blob": str(path), "corrupt_every": MIB},
        {"seed": "liar-2", "blob": str(path), "corrupt_every": 3 * MIB},
    )
    reports: list[tuple[str, str]] = []

    async def scenario(fetcher: BlobFetcher) -> None:
        await fetcher.fetch(blob, [p.address for p in providers])

    with pytest.raises(ProtocolViolation, match="no provider served bytes matching blob"):
        with_fetcher(
            tmp_path / "fetcher",
            scenario,
            chunk_bytes=2 * MIB,
            on_bad_provider=lambda address, reason: reports.append((address, reason)),
        )
    assert reports == []
    with BlobStore(tmp_path / "fetcher") as store:
        assert not store.has(blob)
    assert partial_files(tmp_path / "fetcher") == []


def test_a_cancelled_fetch_resumes_from_the_partial_file(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 48 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 3)
    (provider,) = spawn_providers({"seed": "p", "blob": str(path)})
    root = tmp_path / "fetcher"

    async def cancel_midway(fetcher: BlobFetcher) -> None:
        halfway = asyncio.Event()

        def progress(_: str, received: int) -> None:
            if received >= size // 2:
                halfway.set()

        fetch = asyncio.create_task(fetcher.fetch(blob, [provider.address], on_progress=progress))
        async with asyncio.timeout(UP_TIMEOUT_S):
            await halfway.wait()
        fetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetch

    with_fetcher(root, cancel_midway, chunk_bytes=4 * MIB)
    assert partial_files(root) == [blob, f"{blob}.json"]

    async def fetch_again(fetcher: BlobFetcher) -> Any:
        return await fetcher.fetch(blob, [provider.address]), fetcher.statistics()

    result, statistics = with_fetcher(root, fetch_again, chunk_bytes=4 * MIB)
    assert size // 4 <= result.resumed_bytes < size
    assert result.bytes_by_provider[provider.address] == size - result.resumed_bytes
    assert statistics.resumes == 1
    assert stored(root, blob) == data
    assert partial_files(root) == []


def test_ranges_come_through_a_seed_relay_from_a_provider_with_no_server(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 12 * MIB + 12345
    path, data, blob = seeded_blob(tmp_path, size, SEED + 4)
    (seed,) = spawn_providers({"seed": "seed"})
    (private,) = spawn_providers({"seed": "private", "blob": str(path), "relay": seed.address})
    assert private.address == f"{seed.address}/v1/relay/{identity('private').peer_id}"

    async def scenario(fetcher: BlobFetcher) -> Any:
        return await fetcher.fetch(blob, [private.address])  # HEAD, then ranges, relayed

    result = with_fetcher(tmp_path / "fetcher", scenario, chunk_bytes=4 * MIB)
    assert result.size == size
    assert result.bytes_by_provider == {private.address: size}
    assert result.failed_providers == ()
    assert stored(tmp_path / "fetcher", blob) == data


def test_nobody_holding_the_blob_is_a_transport_error_that_names_every_provider(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    blob = hashlib.sha256(b"a blob nobody has").hexdigest()
    providers = spawn_providers({"seed": "empty-1"}, {"seed": "empty-2"})
    addresses = [p.address for p in providers]

    for size in (None, MIB):  # asking for the size (HEAD), then knowing it (GET)

        async def scenario(fetcher: BlobFetcher, size: int | None = size) -> None:
            await fetcher.fetch(blob, addresses, size=size)

        with pytest.raises(TransportError) as caught:
            with_fetcher(tmp_path / "fetcher", scenario)
        message = str(caught.value)
        assert f"none of the 2 provider(s) could deliver blob {blob}" in message
        assert all(address in message for address in addresses)
        assert "404" in message
        assert partial_files(tmp_path / "fetcher") == []


def test_the_transfer_bench_reports_every_figure_at_a_tiny_size(tmp_path: Path) -> None:
    out_dir = tmp_path / "results"
    options = ["--mib", "4", "--repeats", "1", "--gossip-nodes", "4", "--gossip-messages", "5"]
    options += ["--gossip-processes", "2", "--workdir", str(tmp_path), "--out-dir", str(out_dir)]
    finished = subprocess.run(
        [sys.executable, "-m", "p2ptrain.cli.main", "bench", "transfer", "--json", *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr
    printed = json.loads(finished.stdout)
    assert json.loads((out_dir / "transfer.json").read_text()) == printed
    for key in ("baseline", "single_provider", "multi_provider"):
        assert printed[f"{key}_mb_s"] > 0
    assert printed["single_provider_ratio"] > 0 and printed["multi_provider_ratio"] > 0
    assert (printed["mib"], printed["gossip_nodes"], printed["gossip_messages"]) == (4, 4, 5)
    assert printed["gossip_deliveries"] == 5 * 3  # every message reached the 3 other nodes
    assert 0 < printed["gossip_p50_ms"] <= printed["gossip_p99_ms"] <= printed["gossip_max_ms"]
    assert "4 NetNodes in 2 child processes" in printed["gossip_setup"]
    assert sorted(os.listdir(tmp_path)) == ["results"]  # the scratch directory is gone


# -- the plain-http range reader against a provider that misbehaves ------------------------


class FakeProvider:
    """A raw HTTP/1.1 server in the test's own event loop, on loopback, serving ``data`` as
    blob ranges (a request without credentials gets a nonce, as from a real provider; the
    credentials are not checked) and misbehaving as told: ``announced_size`` (a
    Content-Range of a blob of another size), ``truncate_at`` (close after that many body
    bytes of the first answer), ``extra`` (bytes after each body), ``header_bytes`` (a
    header of that many bytes), ``silent`` (never answer a GET), ``drop_second`` (close a
    connection when a second GET comes on it, as a server whose keep-alive timer runs out
    just then), ``challenge_first`` (answer the first GET 401 with a new nonce, as a server
    whose nonce expired), ``withhold`` (hold back the last byte of the first that many
    answers until the next request is in: only a client that asks ahead gets them)."""

    def __init__(
        self,
        data: bytes,
        *,
        announced_size: int | None = None,
        truncate_at: int | None = None,
        extra: bytes = b"",
        header_bytes: int = 0,
        silent: bool = False,
        drop_second: bool = False,
        challenge_first: bool = False,
        withhold: int = 0,
    ) -> None:
        self.data = data
        self.announced_size = announced_size
        self.truncate_at = truncate_at
        self.extra, self.header_bytes, self.silent = extra, header_bytes, silent
        self.drop_second, self.challenge_first, self.withhold = (
            drop_second,
            challenge_first,
            withhold,
        )
        self.gets: list[str] = []  # the Range of each GET answered
        self.authorized: list[bool] = []  # whether each GET had credentials
        self.connections = 0  # connections that carried a GET
        self._server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._handlers.values():
            writer.close()
        async with asyncio.timeout(UP_TIMEOUT_S):
            await asyncio.gather(*self._handlers)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = writer
        gets = 0
        head: str | None = None  # a request read ahead
        try:
            while True:
                if head is None:
                    async with asyncio.timeout(UP_TIMEOUT_S):
                        head = (await reader.readuntil(b"\r\n\r\n")).decode()
                request, head = head, None
                lines = request.split("\r\n")
                authorized = any(line.startswith("Authorization: ") for line in lines)
                challenge = not authorized
                if lines[0].startswith("HEAD ") and not challenge:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                if lines[0].startswith("GET "):
                    self.authorized.append(authorized)
                    challenge |= self.challenge_first and len(self.authorized) == 1
                if challenge:
                    writer.write(
                        b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n"
                        b'WWW-Authenticate: P2PTrain nonce="fresh"\r\n\r\n'
                    )
                    continue
                (wanted,) = [line[7:] for line in lines if line.startswith("Range: ")]
                gets += 1
                self.connections += gets == 1
                if self.drop_second and gets == 2:
                    return
                self.gets.append(wanted)
                if self.silent:
                    continue
                first, last = map(int, wanted.removeprefix("bytes=").split("-"))
                body = self.data[first : last + 1]
                size = self.announced_size or len(self.data)
                answer = (
                    f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
                    f"Content-Range: bytes {first}-{last}/{size}\r\n"
                    f"X-Padding: {'p' * self.header_bytes}\r\n\r\n".encode()
                )
                if self.truncate_at is not None and len(self.gets) == 1:
                    writer.write(answer + body[: self.truncate_at])
                    await writer.drain()
                    return
                if len(self.gets) <= self.withhold:
                    writer.write(answer + body[:-1])
                    async with asyncio.timeout(UP_TIMEOUT_S):
                        head = (await reader.readuntil(b"\r\n\r\n")).decode()
                    body = body[-1:]
                    answer = b""
                writer.write(answer + body + self.extra)  # one write: small ones arrive whole
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_a_provider_announcing_a_blob_of_another_size_is_dropped_at_once(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 16 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 5)
    (honest,) = spawn_providers({"seed": "honest", "blob": str(path)})
    liar = FakeProvider(data, announced_size=size + 1)

    async def scenario(fetcher: BlobFetcher) -> Any:
        async with liar as address:
            result = await fetcher.fetch(blob, [address, honest.address], size=size)
            return address, result

    address, result = with_fetcher(
        tmp_path / "fetcher", scenario, chunk_bytes=4 * MIB, streams_per_provider=1
    )
    assert len(liar.gets) == 1  # a bad answer drops the provider: it is not asked again
    assert result.failed_providers == (address,)
    assert result.bytes_by_provider == {address: 0, honest.address: size}
    assert stored(tmp_path / "fetcher", blob) == data


def test_a_truncated_body_fails_over_from_the_byte_reached(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 16 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 6)
    (honest,) = spawn_providers({"seed": "honest", "blob": str(path)})
    flaky = FakeProvider(data, truncate_at=MIB + 12345)

    async def scenario(fetcher: BlobFetcher) -> Any:
        async with flaky as address:
            result = await fetcher.fetch(blob, [address, honest.address], size=size)
            return address, result, fetcher.statistics()

    address, result, statistics = with_fetcher(
        tmp_path / "fetcher", scenario, chunk_bytes=4 * MIB, streams_per_provider=1
    )
    assert result.failed_providers == (address,)
    assert statistics.failovers == 1
    assert result.bytes_by_provider[address] >= MIB + 12345  # what it sent before it broke
    assert sum(result.bytes_by_provider.values()) == size  # and nothing of it twice
    assert stored(tmp_path / "fetcher", blob) == data


def read_range(
    provider: FakeProvider,
    ranges: list[tuple[int, int]],
    *,
    timeout_s: float = UP_TIMEOUT_S,
    ahead: bool = False,
) -> tuple[bytes, list[BaseException | None], RangeReaderStatistics]:
    """Read ``ranges`` of the fake's blob into a file with one RangeReader (asking for each
    next range ahead when told); return the file, each read's error (or None) and the
    reader's statistics."""
    size = len(provider.data)
    blob = hashlib.sha256(provider.data).hexdigest()

    async def run(fd: int) -> tuple[list[BaseException | None], RangeReaderStatistics]:
        client = PeerClient(ClientCredentials(network(), identity("reader"), secret=None))
        errors: list[BaseException | None] = []
        try:
            async with provider as address:
                requests = [RangeRequest(address, blob, start, end, size) for start, end in ranges]
                following = iter(requests[1:])
                reader = RangeReader(client, address, timeout_s=timeout_s)
                async with reader:
                    for request in requests:
                        try:
                            await reader.read(
                                request,
                                fd,
                                lambda _: None,
                                (lambda: next(following, None)) if ahead else None,
                            )
                            errors.append(None)
                        except TransportError as exc:
                            errors.append(exc)
                return errors, reader.statistics()
        finally:
            await client.close()

    fd, name = tempfile.mkstemp()
    try:
        os.ftruncate(fd, size)
        errors, statistics = asyncio.run(run(fd))
        return os.pread(fd, size, 0), errors, statistics
    finally:
        os.close(fd)
        os.unlink(name)


def test_the_range_reader_keeps_its_connection_and_reconnects_when_the_server_closed_it() -> None:
    data = random.Random(SEED).randbytes(3 * MIB)
    ranges = [(0, MIB), (MIB, 2 * MIB), (2 * MIB, 3 * MIB)]
    steady = FakeProvider(data)
    received, errors, statistics = read_range(steady, ranges)
    assert (received, errors) == (data, [None] * 3)
    assert (statistics.connections, statistics.requests, statistics.bytes) == (1, 3, 3 * MIB)
    assert steady.connections == 1
    # A second request on a connection meets a close: it is asked again on a new one.
    dropping = FakeProvider(data, drop_second=True)
    received, errors, statistics = read_range(dropping, ranges)
    assert (received, errors) == (data, [None] * 3)
    assert (statistics.connections, statistics.requests) == (3, 5)
    assert dropping.gets == ["bytes=0-1048575", "bytes=1048576-2097151", "bytes=2097152-3145727"]


def test_the_range_reader_drops_connections_that_overrun_and_gives_up_on_silence() -> None:
    data = random.Random(SEED).randbytes(MIB)
    # Bytes past the range asked for: the range is kept, the connection is not.
    received, errors, statistics = read_range(
        FakeProvider(data, extra=b"surplus"), [(0, 1000), (1000, 2000)]
    )
    assert (received[:2000], errors) == (data[:2000], [None, None])
    assert statistics.connections == 2
    _, errors, _ = read_range(FakeProvider(data, header_bytes=16 << 10), [(0, 1000)])
    assert isinstance(errors[0], BadAnswer) and "head over 16384 bytes" in str(errors[0])
    received, errors, _ = read_range(FakeProvider(data, silent=True), [(0, 1000)], timeout_s=0.3)
    assert isinstance(errors[0], TransportError) and "sent nothing for 0.3s" in str(errors[0])
    assert received == bytes(MIB)


def test_the_range_reader_asks_ahead_on_the_same_connection() -> None:
    data = random.Random(SEED).randbytes(3 * MIB)
    ranges = [(0, MIB), (MIB, 2 * MIB), (2 * MIB, 3 * MIB)]
    # The fake finishes an answer only once the next request is in.
    received, errors, statistics = read_range(FakeProvider(data, withhold=2), ranges, ahead=True)
    assert (received, errors) == (data, [None] * 3)
    assert (statistics.connections, statistics.requests, statistics.bytes) == (1, 3, 3 * MIB)
    # Without asking ahead, the first answer never ends.
    _, errors, _ = read_range(FakeProvider(data, withhold=2), ranges[:1], timeout_s=0.3)
    assert isinstance(errors[0], TransportError) and "sent nothing for 0.3s" in str(errors[0])


def test_the_range_reader_learns_a_new_nonce_and_asks_again() -> None:
    data = random.Random(SEED).randbytes(MIB)
    fake = FakeProvider(data, challenge_first=True)
    received, errors, statistics = read_range(fake, [(0, MIB)])
    assert (received, errors) == (data, [None])
    assert fake.authorized == [True, True]  # the first with a nonce the fake calls stale
    assert fake.gets == [f"bytes=0-{MIB - 1}"]  # the second answered
    assert statistics.requests == 2


class _Stalling:
    """A provider that accepts connections and then never answers (``trickle_bps`` None),
    or answers a range with a valid head and then the right bytes at ``trickle_bps``/s."""

    def __init__(self, trickle_bps: float | None = None, *, data: bytes = b"") -> None:
        self.trickle_bps = trickle_bps
        self.data = data
        self.size = len(data)
        self.requests = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                request = (await reader.readuntil(b"\r\n\r\n")).decode()
                self.requests += 1
                if self.trickle_bps is None:
                    await asyncio.Event().wait()  # never answers
                lines = request.split("\r\n")
                ranges = [line[7:] for line in lines if line.startswith("Range: ")]
                if ranges:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # the nonce
            (wanted,) = ranges
            first, last = map(int, wanted.removeprefix("bytes=").split("-"))
            writer.write(
                f"HTTP/1.1 206 Partial Content\r\nContent-Length: {last + 1 - first}\r\n"
                f"Content-Range: bytes {first}-{last}/{self.size}\r\n\r\n".encode()
            )
            for start in range(first, last + 1, 16):  # the right bytes, 16 at a time
                writer.write(self.data[start : min(start + 16, last + 1)])
                await writer.drain()
                await asyncio.sleep(16 / self.trickle_bps)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def test_a_provider_that_never_answers_costs_the_fetch_less_than_its_probe_timeout(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 4 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 7)
    (honest,) = spawn_providers({"seed": "honest", "blob": str(path)})
    hung = _Stalling()

    async def scenario(fetcher: BlobFetcher) -> Any:
        async with hung as address:
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = await fetcher.fetch(blob, [address, honest.address])  # asks the size
            return address, result, loop.time() - started

    address, result, seconds = with_fetcher(tmp_path / "fetcher", scenario, probe_timeout_s=3.0)
    print(f"fetched {size} bytes past a hung provider in {seconds:.2f} s")
    assert hung.requests >= 1  # it was asked, and never answered
    assert seconds < 2.0, f"the fetch waited {seconds:.2f} s for the hung provider"
    assert address in result.failed_providers
    assert stored(tmp_path / "fetcher", blob) == data


def test_a_trickling_provider_is_dropped_and_its_range_continues_elsewhere(
    tmp_path: Path, spawn_providers: Spawn
) -> None:
    size = 16 * MIB
    path, data, blob = seeded_blob(tmp_path, size, SEED + 8)
    (honest,) = spawn_providers({"seed": "honest", "blob": str(path)})
    trickler = _Stalling(trickle_bps=16.0, data=data)

    async def scenario(fetcher: BlobFetcher) -> Any:
        async with trickler as address:
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = await fetcher.fetch(blob, [address, honest.address], size=size)
            return address, result, fetcher.statistics(), loop.time() - started

    address, result, statistics, seconds = with_fetcher(
        tmp_path / "fetcher", scenario, chunk_bytes=4 * MIB
    )
    print(f"fetched {size} bytes past a 16 B/s provider in {seconds:.2f} s")
    assert statistics.slow_providers == 1
    assert address in result.failed_providers
    assert seconds < 10.0
    assert stored(tmp_path / "fetcher", blob) == data
