"""``p2ptrain bench transfer``: blob download speed against plain aiohttp, and gossip latency.

Transfer, over loopback, one blob of random bytes, each figure the best of ``repeats`` with
the contenders interleaved so a noisy neighbour slows them alike:

* ``baseline_mb_s``: a plain aiohttp server (``web.FileResponse``, a child process, no
  p2ptrain code) and a plain aiohttp client writing the body to a file and fsyncing it --
  the same durability a blob store gives (``baseline_unsynced_mb_s``: without the fsync);
* ``single_provider_mb_s``: :class:`BlobFetcher` from one provider (a NetNode child
  process: signed requests, ``Range``, ``sendfile``) into a :class:`BlobStore`, hash checked;
* ``multi_provider_mb_s``: the same from three providers;
* the ratios of ours to the baseline.

Gossip: NetNodes in a few child processes, bootstrapped from the first one, all subscribed to
one experiment topic. Once every node has connections and has delivered a message from every
other node, nodes chosen at random publish signed attestations one at a time; each delivery
is stamped with ``time.time()`` (one machine, one clock) and the delay to each other node is
recorded.

The children are this module run as ``python -m p2ptrain.bench.transfer ROLE SPEC``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp

from p2ptrain import __version__
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import Attestation
from p2ptrain.errors import LocalError
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient
from p2ptrain.net.transfer import BlobFetcher
from p2ptrain.store.blobs import BlobStore

__all__ = ["run_transfer_bench"]

_MB = 1e6
_START_TIMEOUT_S = 60.0
_WAIT_TIMEOUT_S = 30.0
_EXPERIMENT = hashlib.sha256(b"p2ptrain bench transfer").hexdigest()
_TOPIC = f"exp/{_EXPERIMENT}"
_WARMUP_HEIGHT = 1_000_000


def _identity(label: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"bench-transfer/{label}".encode()).digest())


def _network() -> NetworkManifest:
    return NetworkManifest(name="bench-transfer", authority=_identity("authority").public_key)


def run_transfer_bench(
    *,
    mib: int = 256,
    repeats: int = 5,
    gossip_nodes: int = 16,
    gossip_messages: int = 200,
    gossip_processes: int = 4,
    seed: int = 0,
    workdir: str | None = None,
) -> dict[str, Any]:
    """Run both measurements; return one JSON-ready object (see the module docstring)."""
    if mib <= 0 or repeats <= 0 or gossip_messages <= 0:
        raise LocalError("--mib, --repeats and --gossip-messages must be positive")
    if not 2 <= gossip_nodes <= 256 or not 1 <= gossip_processes <= gossip_nodes:
        raise LocalError("use 2..256 gossip nodes and 1..nodes gossip processes")
    result: dict[str, Any] = {
        "p2ptrain_version": __version__,
        "machine": f"{platform.machine()} {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs",
        "seed": seed,
    }
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-transfer-", dir=workdir) as scratch:
        root = Path(scratch)
        result.update(asyncio.run(_measure_transfer(root, mib << 20, repeats, seed)))
        result.update(
            asyncio.run(
                _measure_gossip(root, gossip_nodes, gossip_processes, gossip_messages, seed)
            )
        )
    return result


# -- children -----------------------------------------------------------------------------


class _Child:
    """A child process speaking JSON lines; it exits when its stdin closes."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log

    async def line(self, timeout_s: float = _WAIT_TIMEOUT_S) -> dict[str, Any]:
        assert self.process.stdout is not None
        try:
            raw = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        except TimeoutError:
            raise LocalError(
                f"a bench child said nothing for {timeout_s}s; see {self.log}"
            ) from None
        if not raw:
            tail = self.log.read_text()[-2000:]
            raise LocalError(f"a bench child exited early ({self.log}):\n{tail}")
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")

    async def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


@contextlib.asynccontextmanager
async def _children(
    scratch: Path,
) -> AsyncIterator[Callable[[str, dict[str, Any]], Awaitable[_Child]]]:
    """Yields ``start(role, spec)``; every child started is stopped (or killed) on exit."""
    started: list[_Child] = []

    async def start(role: str, spec: dict[str, Any]) -> _Child:
        log = scratch / f"{role}-{len(started)}.log"
        with open(log, "wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                __name__,
                role,
                json.dumps(spec),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                limit=1 << 20,
            )
        started.append(_Child(process, log))
        return started[-1]

    try:
        yield start
    finally:
        await asyncio.gather(*(child.stop() for child in started))


# -- transfer -----------------------------------------------------------------------------


async def _measure_transfer(scratch: Path, size: int, repeats: int, seed: int) -> dict[str, Any]:
    blob_file, blob = _random_file(scratch / "blob", size, seed)
    async with _children(scratch) as start:
        plain = await start("plain", {"file": str(blob_file)})
        providers = [
            await start("provider", {"file": str(blob_file), "dir": str(scratch / f"p{i}")})
            for i in range(3)
        ]
        port = (await plain.line(_START_TIMEOUT_S))["port"]
        addresses = [(await p.line(_START_TIMEOUT_S))["address"] for p in providers]
        client = PeerClient(ClientCredentials(_network(), _identity("fetcher"), secret=None))
        try:
            with BlobStore(scratch / "fetcher") as store:
                fetcher = BlobFetcher(client, store)

                plain_file = scratch / "plain-download"
                plain_file.touch()

                async with aiohttp.ClientSession() as session:
                    best = await _best_of(
                        repeats,
                        {
                            "baseline": (
                                plain_file.unlink,
                                lambda: _plain_download(session, port, plain_file, sync=True),
                            ),
                            "baseline_unsynced": (
                                plain_file.unlink,
                                lambda: _plain_download(session, port, plain_file, sync=False),
                            ),
                            "single": (
                                lambda: store.delete(blob),
                                lambda: _fetch(fetcher, blob, addresses[:1]),
                            ),
                            "multi": (
                                lambda: store.delete(blob),
                                lambda: _fetch(fetcher, blob, addresses),
                            ),
                        },
                    )
                if store.get(blob) != blob_file.read_bytes():  # get() checks the hash too
                    raise LocalError("transfer bench: the fetched blob differs from the file")
        finally:
            await client.close()
    mb = size / _MB
    return {
        "mib": size >> 20,
        "repeats": repeats,
        "providers": len(addresses),
        "baseline_mb_s": mb / best["baseline"],
        "baseline_unsynced_mb_s": mb / best["baseline_unsynced"],
        "single_provider_mb_s": mb / best["single"],
        "multi_provider_mb_s": mb / best["multi"],
        "single_provider_ratio": best["baseline"] / best["single"],
        "multi_provider_ratio": best["baseline"] / best["multi"],
    }


def _random_file(path: Path, size: int, seed: int) -> tuple[Path, str]:
    """``size`` seeded random bytes in ``path``; returns the path and the blob id."""
    rng, hasher = random.Random(seed), hashlib.sha256()
    with open(path, "wb") as file:
        for offset in range(0, size, 16 << 20):
            block = rng.randbytes(min(16 << 20, size - offset))
            hasher.update(block)
            file.write(block)
    return path, hasher.hexdigest()


async def _best_of(
    repeats: int, contenders: dict[str, tuple[Callable[[], object], Callable[[], Awaitable[None]]]]
) -> dict[str, float]:
    """Best seconds of each contender's ``run`` over ``repeats`` interleaved rounds; its
    ``prepare`` (removing the previous download) and an ``os.sync()`` that settles writeback
    of earlier rounds are not timed."""
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, (prepare, run) in contenders.items():
            prepare()
            os.sync()
            started = time.perf_counter()
            await run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


async def _fetch(fetcher: BlobFetcher, blob: str, addresses: list[str]) -> None:
    await fetcher.fetch(blob, addresses)


async def _plain_download(
    session: aiohttp.ClientSession, port: int, target: Path, *, sync: bool
) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        async with session.get(f"http://127.0.0.1:{port}/blob") as response:
            response.raise_for_status()
            async for data in response.content.iter_any():
                os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


# -- gossip -------------------------------------------------------------------------------


async def _measure_gossip(
    scratch: Path, nodes: int, processes: int, messages: int, seed: int
) -> dict[str, Any]:
    counts = [nodes // processes + (i < nodes % processes) for i in range(processes)]
    async with _children(scratch) as start:
        directory = str(scratch / "gossip")
        spec: dict[str, Any] = {"first": 0, "count": counts[0], "bootstrap": None, "dir": directory}
        children = [await start("gossip", spec)]
        spec["bootstrap"] = (await children[0].line(_START_TIMEOUT_S))["addresses"][0]
        for index in range(1, processes):
            spec.update(first=sum(counts[:index]), count=counts[index])
            children.append(await start("gossip", spec))
        for child in children[1:]:
            await child.line(_START_TIMEOUT_S)
        run = _GossipRun(children, counts)
        try:
            async with asyncio.TaskGroup() as group:
                listeners = [group.create_task(run.listen(i)) for i in range(processes)]
                await run.measure(messages, random.Random(seed))
                for listener in listeners:
                    listener.cancel()
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
    samples = sorted((t - run.sent[height]) * 1000 for height, t in run.delivered)
    return {
        "gossip_nodes": nodes,
        "gossip_messages": messages,
        "gossip_deliveries": len(samples),
        "gossip_p50_ms": _percentile(samples, 50),
        "gossip_p99_ms": _percentile(samples, 99),
        "gossip_max_ms": samples[-1],
        "gossip_setup": f"{nodes} NetNodes in {processes} child processes "
        f"({'/'.join(map(str, counts))} nodes each), one machine, loopback; bootstrapped "
        "from the first node; one signed attestation in flight at a time, from a random node",
    }


class _GossipRun:
    """The parent's side of the gossip measurement: commands out, delivery stamps in."""

    def __init__(self, children: list[_Child], counts: list[int]) -> None:
        self.children = children
        self.nodes = sum(counts)
        self.owner = [i for i, count in enumerate(counts) for _ in range(count)]
        self.sent: dict[int, float] = {}  # height -> publish time
        self.delivered: list[tuple[int, float]] = []  # (height, time) of measured deliveries
        self.arrived: dict[int, set[int]] = {}  # height -> nodes that delivered it
        self.answers: list[asyncio.Queue[dict[str, Any]]] = [asyncio.Queue() for _ in children]
        self.changed = asyncio.Event()
        self.measured = 0

    async def listen(self, index: int) -> None:
        while True:
            event = await self.children[index].line(timeout_s=3600)
            if event["event"] != "delivered":
                self.answers[index].put_nowait(event)
                continue
            self.arrived.setdefault(event["height"], set()).add(event["node"])
            if event["height"] <= self.measured:
                self.delivered.append((event["height"], event["t"]))
            self.changed.set()

    async def ask(self, index: int, command: dict[str, Any]) -> dict[str, Any]:
        self.children[index].send(command)
        return await asyncio.wait_for(self.answers[index].get(), _WAIT_TIMEOUT_S)

    async def measure(self, messages: int, rng: random.Random) -> None:
        await self._wait_for_mesh(min(4, self.nodes - 1))
        for node in range(self.nodes):  # every node hears every other: the mesh is connected
            await self._publish(node, _WARMUP_HEIGHT + node)
        for node in range(self.nodes):
            await self._wait_for_everyone(_WARMUP_HEIGHT + node, node)
        self.measured = messages
        for height in range(1, messages + 1):
            node = rng.randrange(self.nodes)
            await self._publish(node, height)
            await self._wait_for_everyone(height, node)

    async def _publish(self, node: int, height: int) -> None:
        command = {"cmd": "publish", "node": node, "height": height}
        self.sent[height] = (await self.ask(self.owner[node], command))["t"]

    async def _wait_for_everyone(self, height: int, origin: int) -> None:
        try:
            async with asyncio.timeout(_WAIT_TIMEOUT_S):
                while len(self.arrived.get(height, set()) | {origin}) < self.nodes:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise LocalError(
                f"gossip bench: message {height} did not reach all {self.nodes} nodes within "
                f"{_WAIT_TIMEOUT_S}s"
            ) from None

    async def _wait_for_mesh(self, degree: int) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            statuses = [await self.ask(i, {"cmd": "status"}) for i in range(len(self.children))]
            if all(c >= degree for status in statuses for c in status["connections"]):
                return
            if time.monotonic() > deadline:
                raise LocalError(f"gossip bench: the mesh did not form: {statuses}")
            await asyncio.sleep(0.1)  # polling interval, not synchronisation: it re-checks


def _percentile(sorted_values: list[float], percent: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, -(-len(sorted_values) * percent // 100))
    return sorted_values[int(rank) - 1]


# -- the children's side ------------------------------------------------------------------


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _commands() -> AsyncIterator[dict[str, Any]]:
    """JSON commands from stdin until it closes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command: dict[str, Any] = json.loads(line)
        yield command


async def _plain_server(spec: dict[str, Any]) -> None:
    """No p2ptrain code: aiohttp serving one file with ``FileResponse`` (sendfile)."""
    from aiohttp import web

    async def blob(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(spec["file"])

    app = web.Application()
    app.router.add_get("/blob", blob)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    _emit({"port": runner.addresses[0][1]})
    async for _ in _commands():
        pass
    await runner.cleanup()


async def _provider(spec: dict[str, Any]) -> None:
    from p2ptrain.net.config import NetConfig
    from p2ptrain.net.node import NetNode

    with BlobStore(spec["dir"]) as store:
        with open(spec["file"], "rb") as source:
            store.put_stream(source)
        node = NetNode(
            identity=_identity(spec["dir"]),
            network=_network(),
            blobs=store,
            config=NetConfig(host="127.0.0.1", port=0),
        )
        async with node:
            _emit({"address": node.address})
            async for _ in _commands():
                pass


async def _gossip_nodes(spec: dict[str, Any]) -> None:
    from p2ptrain.net.config import NetConfig
    from p2ptrain.net.gossip import Delivered
    from p2ptrain.net.node import NetNode

    first, count = spec["first"], spec["count"]

    def on_message(index: int) -> Callable[[Delivered], None]:
        def delivered(message: Delivered) -> None:
            record = message.record
            if message.from_peer and isinstance(record, Signed):
                height = record.record.height
                _emit({"event": "delivered", "height": height, "node": index, "t": time.time()})

        return delivered

    async with contextlib.AsyncExitStack() as stack:
        nodes: list[NetNode] = []
        for index in range(first, first + count):
            bootstrap = spec["bootstrap"] or (nodes[0].address if nodes else None)
            node = NetNode(
                identity=_identity(f"gossip-{index}"),
                network=_network(),
                blobs=stack.enter_context(BlobStore(Path(spec["dir"]) / str(index))),
                config=NetConfig(
                    host="127.0.0.1",
                    bootstrap=(bootstrap,) if bootstrap else (),
                    discovery_interval_s=0.25,
                ),
            )
            node.gossip.subscribe(_TOPIC, on_message(index))
            nodes.append(await stack.enter_async_context(node))
        _emit({"event": "up", "addresses": [node.address for node in nodes]})
        async for command in _commands():
            if command["cmd"] == "status":
                connections = [len(node.gossip.connections) for node in nodes]
                _emit({"event": "status", "connections": connections})
            elif command["cmd"] == "publish":
                node = nodes[command["node"] - first]
                record = Attestation(
                    experiment_id=_EXPERIMENT,
                    height=command["height"],
                    head_id=hashlib.sha256(str(command["height"]).encode()).hexdigest(),
                    validator=node.identity.public_key,
                    round=0,
                    stage="commit",
                )
                data = seal(node.identity, record).envelope.encode()
                sent = time.time()
                node.publish(_TOPIC, "attestation", data)
                _emit({"event": "published", "t": sent})


_ROLES: dict[str, Callable[[dict[str, Any]], Coroutine[Any, Any, None]]] = {
    "plain": _plain_server,
    "provider": _provider,
    "gossip": _gossip_nodes,
}

if __name__ == "__main__":
    asyncio.run(_ROLES[sys.argv[1]](json.loads(sys.argv[2])))
