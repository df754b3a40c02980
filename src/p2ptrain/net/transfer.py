"""Blob downloads: in parallel from several providers, resumable, verified before use.

:class:`BlobFetcher` cuts a blob into chunks and asks each provider for ranges of it
(``GET /v1/blobs/{id}`` with ``Range``), one stream (connection) per provider unless told
otherwise. Every piece that arrives is written at its offset into a preallocated partial
file, ``<store root>/partial/<id>``, so memory stays bounded by the socket buffers (and one
receive buffer). A worker thread hashes the contiguous prefix of
the file as it grows; when the last chunk lands only the tail is left to hash, and the file
becomes a blob only if the whole of it hashes to the id.

Faults, and what happens:

* a provider errors, times out or disconnects: its chunk goes back to the queue from the
  byte reached and another stream continues it; a provider that fails ``max_failures``
  times (or answers 404 or nonsense) is dropped;
* the fetch is cancelled or the process dies: ``<id>.json`` next to the partial file
  records the ranges on disk, and the next fetch of the id resumes from them;
* the blob does not hash to its id: some provider served bad bytes, but the hash does not
  say which. :class:`Reconciliation` fetches each piece again from other providers and
  tries assemblies of the versions it got; when one hashes to the id, every provider that
  served different bytes of any piece is proven bad, dropped and reported through
  ``on_bad_provider``. If nothing verifies, :class:`ProtocolViolation` says so and nobody
  is blamed.

:class:`~p2ptrain.net.chunk_plan.ChunkPlan` and :class:`~p2ptrain.net.chunk_plan.Reconciliation`
are pure (no I/O, no clock): which range to ask whom for, and which bytes to believe;
:mod:`p2ptrain.net.partial_file` keeps the partial file, its record and the prefix hasher.

Speed: from ``http://`` providers each stream reads with a
:class:`~p2ptrain.net.range_reader.RangeReader`, a connection of its own that asks for the
next range before the current one is in and receives into one reused buffer (``https://``,
and answers it cannot read, go through aiohttp). Hashing is the one cost a plain download
does not pay, so it runs on its own thread, through a read-only mapping of the partial file
(no copy; hashlib releases the GIL), and keeps up with the network; writing the landed
prefix to disk is started in the background as it grows (without waiting for the disk), so
the fsync before the blob becomes visible finds little left to write.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from p2ptrain.errors import LocalError, ProtocolViolation, StorageFault, TransportError
from p2ptrain.net.chunk_plan import ChunkPlan, Piece, Reconciliation, Span
from p2ptrain.net.client import PeerClient
from p2ptrain.net.failure_text import transport_reason
from p2ptrain.net.partial_file import (
    HASH_STEP_BYTES,
    PARTIAL_DIR,
    PartialBlob,
    PrefixHasher,
    hash_range,
    pwrite_all,
    range_digest,
    start_writeback,
)
from p2ptrain.net.range_answer import (
    BadAnswer,
    MissingBlob,
    RangeRequest,
    TooSlow,
    UnsupportedAnswer,
)
from p2ptrain.net.range_reader import RangeReader
from p2ptrain.store.blobs import BlobStore

__all__ = ["BlobFetcher", "FetchResult", "TransferStatistics"]

logger = logging.getLogger(__name__)

_ID = re.compile(r"[0-9a-f]{64}")
_EMPTY_ID = hashlib.sha256(b"").hexdigest()
#: Start writing the landed prefix to disk each time this much more has landed.
_FLUSH_BYTES = 8 << 20
#: Record the ranges on disk at most this often (and when the fetch ends, however it ends).
_SAVE_INTERVAL_S = 1.0
#: Once one provider told the size, how long the others may still answer (at least).
_PROBE_GRACE_S = 0.25
#: The rate watcher looks every this often, at the rate over at least this long.
_RATE_CHECK_S = 1.0
_RATE_WINDOW_S = 2.0
#: A provider this many times slower than the fastest one is dropped from the fetch.
_SLOWER_FACTOR = 16.0


# -- records ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchResult:
    blob_id: str
    size: int
    seconds: float
    #: Bytes received from each provider (re-fetches to find a bad provider included).
    bytes_by_provider: dict[str, int]
    #: Providers proven to have served bytes that differ from the verified blob.
    bad_providers: tuple[str, ...]
    #: Providers that failed at least once: an error, a timeout, a broken connection, no such
    #: blob, a malformed answer (bad providers are not repeated here).
    failed_providers: tuple[str, ...]
    #: Bytes found on disk from an earlier, interrupted fetch of the same blob.
    resumed_bytes: int


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    fetches: int  # fetches that ended with the blob in the store
    bytes: int  # bytes received from providers
    bad_providers: int  # providers proven to have served bad bytes
    failovers: int  # ranges that failed at one provider and went back to the queue
    resumes: int  # fetches that found bytes of an earlier attempt on disk
    slow_providers: int  # providers dropped from a fetch for being too slow


# -- the fetcher --------------------------------------------------------------------------


class _Changes:
    """Wakes the streams waiting for work whenever the plan changes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(slots=True)
class _Pace:
    """How fast one provider's stream delivers: bytes from it at the start of the current
    measuring interval, and the deadline the rate watcher moves to now to drop it."""

    deadline: asyncio.Timeout
    since: float
    bytes_at: int
    too_slow: str = ""


@dataclass(slots=True)
class _Job:
    """One fetch in progress."""

    blob_id: str
    plan: ChunkPlan
    partial: PartialBlob
    on_progress: Callable[[str, int], None] | None
    received: Counter[str]  # bytes from each provider
    hasher: PrefixHasher
    changes: _Changes = field(default_factory=_Changes)
    #: The range each provider's stream waits for now, watched by :meth:`_watch_rates`.
    active: dict[str, _Pace] = field(default_factory=dict)
    flush_at: int = 0  # tell _flush_behind when the frontier passes this
    next_save: float = 0.0  # when to record progress next (time.monotonic())


class BlobFetcher:
    """Downloads blobs from providers into a :class:`BlobStore`. See the module docstring.

    ``chunk_bytes`` is the largest range asked for at once: failover and resume work to the
    byte whatever its size, but every request costs a signature, its check and a file
    response, and the hash can only follow the contiguous prefix, which trails the bytes
    received by about a chunk per provider. ``streams_per_provider`` connections to each
    provider carry ranges at once; one is enough for plain ``http://`` providers, as each
    asks for its next range before the current one is in (see
    :class:`~p2ptrain.net.range_reader.RangeReader`). On one machine (loopback, 2 cores,
    256 MiB) 32 MiB and one stream measured fastest, from one provider and from three.
    ``timeout_s`` bounds each wait for bytes.

    No fetch waits for the slowest provider: the size is asked of every provider at once
    (``HEAD``, each bounded by ``probe_timeout_s``) and the download starts with those that
    answered soon after the first; a provider whose stream keeps below ``min_rate``
    bytes/s, or far below the fastest one's, is dropped from the fetch and its range goes
    to the others (a trickling provider would otherwise never time out).
    ``on_bad_provider(address, reason)`` is called once for each provider proven to have
    served bytes that differ from the verified blob (count it against the peer);
    ``on_fault(address, reason)`` for a transport fault (no answer, too slow, a broken
    connection): never misbehaviour, but the caller may ask that provider last next time.
    """

    def __init__(
        self,
        client: PeerClient,
        blobs: BlobStore,
        *,
        chunk_bytes: int = 32 << 20,
        streams_per_provider: int = 1,
        timeout_s: float = 30.0,
        on_bad_provider: Callable[[str, str], None] | None = None,
        on_fault: Callable[[str, str], None] | None = None,
        max_failures: int = 3,
        max_blob_bytes: int = 8 << 30,
        probe_timeout_s: float = 3.0,
        min_rate: float = 32_768.0,
    ) -> None:
        if chunk_bytes < 1 << 16:
            raise LocalError(f"chunk_bytes={chunk_bytes} is too small; use at least 65536")
        if not 1 <= streams_per_provider <= 16:
            raise LocalError(f"streams_per_provider={streams_per_provider}; use 1..16")
        if not 0 < timeout_s <= 3600:
            raise LocalError(f"timeout_s={timeout_s}; use a value in (0, 3600] seconds")
        if max_failures < 1 or max_blob_bytes < 0:
            raise LocalError("max_failures must be >= 1 and max_blob_bytes >= 0")
        if not 0 < probe_timeout_s <= 600 or min_rate < 0:
            raise LocalError("probe_timeout_s must be in (0, 600] s and min_rate >= 0")
        self._client = client
        self._blobs = blobs
        self._chunk_bytes = chunk_bytes
        self._streams = streams_per_provider
        self._timeout_s = timeout_s
        self._on_bad_provider = on_bad_provider
        self._on_fault = on_fault
        self._probe_timeout_s = probe_timeout_s
        self._min_rate = min_rate
        self._max_failures = max_failures
        self._max_blob_bytes = max_blob_bytes
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._fetches = self._bytes = self._bad = self._failovers = self._resumes = 0
        self._slow = 0

    def statistics(self) -> TransferStatistics:
        return TransferStatistics(
            fetches=self._fetches,
            bytes=self._bytes,
            bad_providers=self._bad,
            failovers=self._failovers,
            resumes=self._resumes,
            slow_providers=self._slow,
        )

    async def fetch(
        self,
        blob_id: str,
        providers: Sequence[str],
        *,
        size: int | None = None,
        on_progress: Callable[[str, int], None] | None = None,
    ) -> FetchResult:
        """Fetch ``blob_id`` from ``providers`` (addresses) unless the store holds it.

        ``size`` saves asking the providers (``HEAD``). ``on_progress(address, n)`` is
        called whenever bytes land, with the bytes received from that provider so far.
        Raises :class:`TransportError` when no provider could deliver (the bytes on disk
        are kept for the next attempt) and :class:`ProtocolViolation` when no provider
        served bytes that hash to the id.
        """
        if not isinstance(blob_id, str) or not _ID.fullmatch(blob_id):
            raise LocalError(f"malformed blob id {blob_id!r:.80}; validate peer ids first")
        addresses = list(dict.fromkeys(providers))
        if not addresses:
            raise LocalError(f"no provider given for blob {blob_id}; find who holds it first")
        if size is not None and not 0 <= size <= self._max_blob_bytes:
            raise LocalError(f"size {size} is outside 0..max_blob_bytes={self._max_blob_bytes}")
        lock, users = self._locks.get(blob_id, (asyncio.Lock(), 0))
        self._locks[blob_id] = (lock, users + 1)
        try:
            async with lock:
                return await self._fetch(blob_id, addresses, size, on_progress)
        finally:
            lock, users = self._locks[blob_id]
            if users == 1:
                del self._locks[blob_id]
            else:
                self._locks[blob_id] = (lock, users - 1)

    async def _fetch(
        self,
        blob_id: str,
        addresses: list[str],
        size: int | None,
        on_progress: Callable[[str, int], None] | None,
    ) -> FetchResult:
        started = time.monotonic()
        if self._blobs.has(blob_id):
            return FetchResult(blob_id, self._blobs.size(blob_id), 0.0, {}, (), (), 0)
        unusable: dict[str, str] = {}
        if size is None:
            size, addresses, unusable = await self._probe_size(blob_id, addresses)
        if size == 0:
            return self._store_empty(blob_id, started, tuple(unusable))
        with PartialBlob(self._blobs.root / PARTIAL_DIR, blob_id, size) as partial:
            if self._blobs.has(blob_id):  # another fetcher finished it while we asked around
                partial.forget()
                return FetchResult(blob_id, size, time.monotonic() - started, {}, (), (), 0)
            plan = ChunkPlan(
                size,
                self._chunk_bytes,
                addresses,
                max_failures=self._max_failures,
                completed=partial.completed,
                ramp=len(addresses) * self._streams,
            )
            if plan.resumed_bytes:
                self._resumes += 1
                logger.info("resuming blob %s from %d bytes on disk", blob_id, plan.resumed_bytes)
            with PrefixHasher(partial.fd, size) as hasher:
                received = Counter(dict.fromkeys(addresses, 0))
                job = _Job(blob_id, plan, partial, on_progress, received, hasher)
                digest = await self._download(job)
            if digest is None:
                raise TransportError(_undelivered(blob_id, plan, unusable))
            bad: dict[str, Piece] = {}
            if digest != blob_id:
                bad = await self._reconcile(job)
            await asyncio.to_thread(self._blobs.adopt_verified, partial.path, blob_id, size)
            partial.forget(keep_bytes=True)
        self._report_bad(blob_id, bad)
        self._fetches += 1
        failed = [*unusable, *plan.failures]
        return FetchResult(
            blob_id=blob_id,
            size=size,
            seconds=time.monotonic() - started,
            bytes_by_provider=dict(job.received),
            bad_providers=tuple(bad),
            failed_providers=tuple(p for p in dict.fromkeys(failed) if p not in bad),
            resumed_bytes=plan.resumed_bytes,
        )

    # -- downloading ----------------------------------------------------------------------

    async def _download(self, job: _Job) -> str | None:
        """Run every provider's streams until the plan is complete or stalled; return the
        SHA-256 of what landed, or None when bytes are missing (no provider left)."""
        plan, partial = job.plan, job.partial
        job.hasher.advance(plan.frontier)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self._streams):  # round robin: every provider starts early
                    for provider in plan.live:
                        group.create_task(self._stream(job, provider))
                group.create_task(self._flush_behind(job))
                group.create_task(self._watch_rates(job))
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None
        finally:
            partial.save(plan.completed_ranges())
        if not plan.complete:
            return None
        landed = time.monotonic()
        async with asyncio.TaskGroup() as group:  # flush while the hash catches up
            group.create_task(asyncio.to_thread(os.fsync, partial.fd))
            digest = await job.hasher.digest()
            hashed = time.monotonic()
        logger.debug(
            "blob %s: hashed %.3fs and flushed %.3fs after the last byte",
            job.blob_id[:16],
            hashed - landed,
            time.monotonic() - landed,
        )
        return digest

    async def _flush_behind(self, job: _Job) -> None:
        """Start writing the landed prefix to disk while later bytes arrive, without waiting
        for the disk: the final fsync, which the blob must wait for, then has little left
        to do (and it runs while the hash catches up)."""
        plan = job.plan
        flushed = plan.frontier
        while not (plan.complete or plan.stalled):
            await job.changes.wait()
            frontier = plan.frontier
            if frontier - flushed >= _FLUSH_BYTES and not plan.complete:
                await asyncio.to_thread(start_writeback, job.partial.fd, flushed, frontier)
                flushed = frontier

    async def _watch_rates(self, job: _Job) -> None:
        """Every second, drop the streams that deliver below ``min_rate`` bytes/s, or below
        1/``_SLOWER_FACTOR`` of the fastest, over the last ``_RATE_WINDOW_S``."""
        plan, loop = job.plan, asyncio.get_running_loop()
        check_at = loop.time() + _RATE_CHECK_S
        while not (plan.complete or plan.stalled):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(check_at):
                    await job.changes.wait()  # wakes to end with the plan
            if loop.time() < check_at:
                continue
            check_at = loop.time() + _RATE_CHECK_S
            now = time.monotonic()
            rates: dict[str, float] = {}
            for provider, pace in job.active.items():
                elapsed = now - pace.since
                if elapsed >= _RATE_WINDOW_S:
                    rates[provider] = (job.received[provider] - pace.bytes_at) / elapsed
            fastest = max(rates.values(), default=0.0)
            for provider, rate in rates.items():
                pace = job.active[provider]
                if rate < self._min_rate:
                    why = f"{rate:.0f} B/s, below the minimum of {self._min_rate:.0f} B/s"
                elif len(plan.live) > 1 and rate * _SLOWER_FACTOR < fastest:
                    why = f"{rate:.0f} B/s, far below the fastest provider's {fastest:.0f} B/s"
                else:
                    pace.since, pace.bytes_at = now, job.received[provider]
                    continue
                pace.too_slow = why
                pace.deadline.reschedule(loop.time())

    async def _stream(self, job: _Job, provider: str) -> None:
        plan = job.plan
        ahead: list[Span] = []  # the next span, asked for while the current one arrives

        def ask_ahead() -> RangeRequest | None:
            span = plan.next_span(provider)
            if span is None:
                return None
            ahead.append(span)
            return RangeRequest(provider, job.blob_id, span.start, span.end, plan.size)

        async with self._reader(provider) as reader:
            while not plan.complete and provider in plan.live:
                span = ahead.pop() if ahead else plan.next_span(provider)
                if span is None:
                    await job.changes.wait()
                    continue
                landed = self._landing(job, span.chunk, provider)
                request = RangeRequest(provider, job.blob_id, span.start, span.end, plan.size)
                try:
                    await self._paced(
                        job,
                        provider,
                        request=request,
                        landed=landed,
                        reader=reader,
                        ask_ahead=ask_ahead,
                    )
                except StorageFault:
                    raise  # our disk, not the provider: the whole fetch fails
                except TransportError as exc:
                    self._failovers += 1
                    fatal = isinstance(exc, MissingBlob | BadAnswer | TooSlow)
                    self._fault(provider, str(exc))
                    dropped = plan.failed(span.chunk, provider, str(exc), fatal=fatal)
                    logger.info(
                        "%s %s of blob %s: %s",
                        "dropped" if dropped else "failover from",
                        provider,
                        job.blob_id[:16],
                        exc,
                    )
                else:
                    now = time.monotonic()
                    if now >= job.next_save:  # a crash loses at most this much progress
                        job.next_save = now + _SAVE_INTERVAL_S
                        job.partial.save(plan.completed_ranges())
                job.changes.notify()
        for span in ahead:  # the provider was dropped before it was read: give it back
            plan.failed(span.chunk, provider, "dropped before this range was read")
            job.changes.notify()

    async def _paced(
        self,
        job: _Job,
        provider: str,
        *,
        request: RangeRequest,
        landed: Callable[[int], None],
        reader: RangeReader | None,
        ask_ahead: Callable[[], RangeRequest | None],
    ) -> None:
        """:meth:`_receive` under the rate watcher's eye: raises :class:`TooSlow` when it
        dropped the provider."""
        pace: _Pace | None = None
        try:
            async with asyncio.timeout(None) as deadline:
                pace = _Pace(deadline, time.monotonic(), job.received[provider])
                job.active[provider] = pace
                await self._receive(request, job.partial.fd, landed, reader, ask_ahead)
        except TimeoutError:
            if pace is None or not pace.too_slow:
                raise
        finally:
            job.active.pop(provider, None)
        assert pace is not None
        if pace.too_slow:
            self._slow += 1
            raise TooSlow(f"{provider} is too slow: {pace.too_slow}")

    def _fault(self, provider: str, reason: str) -> None:
        if self._on_fault is not None:
            self._on_fault(provider, reason)

    def _landing(self, job: _Job, chunk: int, provider: str) -> Callable[[int], None]:
        """What to do each time ``count`` bytes of ``chunk`` from ``provider`` are on disk."""
        plan, hasher, received, on_progress = job.plan, job.hasher, job.received, job.on_progress

        def landed(count: int) -> None:
            self._bytes += count
            received[provider] += count
            plan.received(chunk, provider, count)
            hasher.advance(plan.frontier)
            if plan.frontier >= job.flush_at:  # wake _flush_behind
                job.flush_at = plan.frontier + _FLUSH_BYTES
                job.changes.notify()
            if on_progress is not None:
                on_progress(provider, received[provider])

        return landed

    @contextlib.asynccontextmanager
    async def _reader(self, provider: str) -> AsyncIterator[RangeReader | None]:
        """A stream's own connection to ``provider`` (plain http only; None for https)."""
        if urlsplit(provider).scheme != "http":
            yield None
            return
        reader = RangeReader(self._client, provider, timeout_s=self._timeout_s)
        try:
            yield reader
        finally:
            await reader.close()

    async def _receive(
        self,
        request: RangeRequest,
        fd: int,
        landed: Callable[[int], None],
        reader: RangeReader | None,
        ask_ahead: Callable[[], RangeRequest | None] | None = None,
    ) -> None:
        """GET ``request``'s range and write its bytes at their offsets in ``fd``, calling
        ``landed(count)`` as they land; ``ask_ahead()`` may be called for the request to
        send next on the same connection. Raises TransportError (MissingBlob and BadAnswer
        among them); a failed disk write raises LocalError."""
        if reader is not None and reader.usable:
            try:
                await reader.read(request, fd, landed, ask_ahead)
                return
            except UnsupportedAnswer as exc:  # nothing landed: ask again, the general way
                logger.info("%s; using a general HTTP client for it", exc)
        await self._receive_plain(
            request.provider,
            request.blob_id,
            start=request.start,
            end=request.end,
            size=request.size,
            fd=fd,
            landed=landed,
        )

    async def _receive_plain(
        self,
        provider: str,
        blob_id: str,
        *,
        start: int,
        end: int,
        size: int,
        fd: int,
        landed: Callable[[int], None],
    ) -> None:
        """:meth:`_receive` with aiohttp (https, and answers a RangeReader cannot read):
        each piece is written at its offset in ``fd``."""
        loop = asyncio.get_running_loop()
        timeout_s = self._timeout_s
        position = start
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                async with self._client.request(
                    "GET",
                    provider,
                    f"/v1/blobs/{blob_id}",
                    headers={"Range": f"bytes={start}-{end - 1}"},
                    ok=(200, 206, 404),
                ) as response:
                    _check_answer(
                        response,
                        provider=provider,
                        blob_id=blob_id,
                        start=start,
                        end=end,
                        size=size,
                    )
                    content = response.content
                    renew_at = loop.time() + timeout_s / 4
                    while position < end:
                        data = await content.readany()
                        if not data:
                            raise TransportError(f"{provider} ended the answer at byte {position}")
                        count = len(data)
                        if position + count > end:
                            raise BadAnswer(
                                f"{provider} sent more than the {end - start} bytes asked"
                            )
                        try:
                            pwrite_all(fd, data, position)
                        except OSError as exc:
                            raise StorageFault(f"blob {blob_id}", exc.strerror or str(exc)) from exc
                        position += count
                        landed(count)
                        now = loop.time()
                        if now > renew_at:
                            deadline.reschedule(now + timeout_s)
                            renew_at = now + timeout_s / 4
        except TimeoutError:
            raise TransportError(
                f"{provider} sent nothing for {timeout_s:g}s (at byte {position} of {start}-{end})"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(
                f"{provider} broke off at byte {position}: {transport_reason(exc)}"
            ) from exc

    async def _probe_size(
        self, blob_id: str, addresses: list[str]
    ) -> tuple[int, list[str], dict[str, str]]:
        """Ask every provider for the blob's size (HEAD) at once, each bounded by
        ``probe_timeout_s``; once one answered, the others have a short grace (twice its
        time, at least ``_PROBE_GRACE_S``) and the rest are left out. Returns the size most
        of those who answered report, the providers that report it, and why the others are
        left out."""
        sizes: dict[str, int] = {}
        failures: dict[str, str] = {}
        started = time.monotonic()

        async def ask(address: str) -> None:
            try:
                async with asyncio.timeout(self._probe_timeout_s):
                    found = await self._client.has_blob(address, blob_id)
            except TimeoutError:
                failures[address] = f"no answer to HEAD within {self._probe_timeout_s:g}s"
            except (TransportError, ProtocolViolation) as exc:
                failures[address] = str(exc)
            else:
                if found is None:
                    failures[address] = "does not hold the blob (404)"
                else:
                    sizes[address] = found

        tasks = {asyncio.create_task(ask(a)): a for a in addresses}
        pending = set(tasks)
        try:
            while pending and not sizes:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if pending:
                grace = max(_PROBE_GRACE_S, 2 * (time.monotonic() - started))
                _, pending = await asyncio.wait(pending, timeout=grace)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in pending:
            failures[tasks[task]] = "answered HEAD much later than the first provider"
        for address, reason in failures.items():
            if "404" not in reason:
                self._fault(address, reason)
        usable = [sizes[a] for a in addresses if 0 <= sizes.get(a, -1) <= self._max_blob_bytes]
        if not usable:
            for address, reported in sizes.items():
                failures[address] = (
                    f"reports {reported} bytes, over max_blob_bytes={self._max_blob_bytes}"
                )
            raise TransportError(_nobody(blob_id, addresses, failures))
        size = max(usable, key=usable.count)  # the most common; ties to the first provider's
        for address, reported in sizes.items():
            if reported != size:
                failures[address] = f"reports {reported} bytes where the others report {size}"
        return size, [a for a in addresses if sizes.get(a) == size], failures

    def _store_empty(self, blob_id: str, started: float, failed: tuple[str, ...]) -> FetchResult:
        if blob_id != _EMPTY_ID:
            raise ProtocolViolation(
                f"providers say blob {blob_id} is empty, but the empty blob's id is {_EMPTY_ID}"
            )
        self._blobs.put(b"")
        self._fetches += 1
        return FetchResult(blob_id, 0, time.monotonic() - started, {}, (), failed, 0)

    def _report_bad(self, blob_id: str, bad: dict[str, Piece]) -> None:
        for provider, piece in bad.items():
            reason = (
                f"served bytes {piece.start}-{piece.end} of blob {blob_id} that differ from "
                "the blob that verified against its id"
            )
            logger.warning("bad provider %s: %s", provider, reason)
            self._bad += 1
            if self._on_bad_provider is not None:
                self._on_bad_provider(provider, reason)

    # -- finding who served bad bytes -------------------------------------------------------

    async def _reconcile(self, job: _Job) -> dict[str, Piece]:
        """The assembled blob does not hash to its id: re-fetch pieces from other providers
        until an assembly verifies; leave it in the partial file and return who lied."""
        partial, plan = job.partial, job.plan
        pieces = plan.pieces()
        logger.warning(
            "blob %s does not hash to its id; re-fetching its %d pieces from other providers",
            job.blob_id,
            len(pieces),
        )
        digests = await asyncio.to_thread(
            lambda: [range_digest(partial.path, p.start, p.end) for p in pieces]
        )
        reconciliation = Reconciliation(pieces, digests)
        files = [partial.path]
        while True:
            for choice in reconciliation.candidates():
                reconciliation.tried(choice)
                digest = await asyncio.to_thread(_assembly_digest, files, reconciliation, choice)
                if digest == job.blob_id:
                    await asyncio.to_thread(_apply, files, reconciliation, choice)
                    return reconciliation.blame(choice)
            assignments = reconciliation.refetch_plan(plan.live)
            if not assignments:
                raise ProtocolViolation(
                    f"no provider served bytes matching blob {job.blob_id}: each piece was "
                    f"compared across {len(job.received)} provider(s) and no assembly of "
                    "what they sent hashes to the id"
                )
            files.append(partial.directory / f"{job.blob_id}.round{len(files)}")
            await self._refetch(job, reconciliation, assignments, files[-1], len(files) - 1)

    async def _refetch(
        self,
        job: _Job,
        reconciliation: Reconciliation,
        assignments: dict[int, str],
        path: Path,
        file: int,
    ) -> None:
        """Fetch the assigned pieces into a sparse file; tell the reconciliation the version
        each provider sent."""
        plan = job.plan
        streams = {provider: asyncio.Semaphore(self._streams) for provider in plan.live}
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

        async def one(index: int, provider: str) -> None:
            piece = reconciliation.pieces[index]

            def landed(count: int) -> None:
                self._bytes += count
                job.received[provider] += count
                if job.on_progress is not None:
                    job.on_progress(provider, job.received[provider])

            request = RangeRequest(provider, job.blob_id, piece.start, piece.end, plan.size)
            async with streams[provider], self._reader(provider) as reader:
                if provider not in plan.live:
                    return
                try:
                    await self._receive(request, fd, landed, reader)
                except StorageFault:
                    raise
                except TransportError as exc:
                    plan.strike(provider, str(exc), fatal=isinstance(exc, MissingBlob))
                    return
            digest = await asyncio.to_thread(range_digest, path, piece.start, piece.end)
            reconciliation.add(index, provider, digest, file)

        try:
            os.ftruncate(fd, plan.size)
            async with asyncio.TaskGroup() as group:
                for index, provider in assignments.items():
                    group.create_task(one(index, provider))
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None
        finally:
            os.close(fd)


def _assembly_digest(
    files: list[Path], reconciliation: Reconciliation, choice: tuple[int, ...]
) -> str:
    """SHA-256 of the blob assembled from one version of each piece."""
    descriptors = [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in files]
    try:
        hasher = hashlib.sha256()
        for index, (piece, version) in enumerate(zip(reconciliation.pieces, choice, strict=True)):
            fd = descriptors[reconciliation.file_of(index, version)]
            hash_range(fd, piece.start, piece.end, hasher)
        return hasher.hexdigest()
    finally:
        for fd in descriptors:
            os.close(fd)


def _apply(files: list[Path], reconciliation: Reconciliation, choice: tuple[int, ...]) -> None:
    """Copy the chosen versions into the partial file, ``files[0]``."""
    target = os.open(files[0], os.O_WRONLY | os.O_CLOEXEC)
    try:
        for index, (piece, version) in enumerate(zip(reconciliation.pieces, choice, strict=True)):
            source = reconciliation.file_of(index, version)
            if source == 0:
                continue
            with open(files[source], "rb", buffering=0) as file:
                position = piece.start
                while position < piece.end:
                    size = min(HASH_STEP_BYTES, piece.end - position)
                    block = os.pread(file.fileno(), size, position)
                    if not block:
                        raise LocalError(f"{files[source]} ended at byte {position}")
                    pwrite_all(target, block, position)
                    position += len(block)
    finally:
        os.close(target)


def _check_answer(
    response: aiohttp.ClientResponse,
    *,
    provider: str,
    blob_id: str,
    start: int,
    end: int,
    size: int,
) -> None:
    if response.status == 404:
        raise MissingBlob(f"{provider} does not hold blob {blob_id} (404)")
    if response.status == 200 and (start, end) == (0, size):
        expected_range = None
    elif response.status == 206:
        expected_range = f"bytes {start}-{end - 1}/{size}"
    else:
        raise BadAnswer(f"{provider} answered {response.status} to a request for a range")
    if expected_range is not None and response.headers.get("Content-Range") != expected_range:
        raise BadAnswer(
            f"{provider} sent Content-Range {response.headers.get('Content-Range')!r:.80}, "
            f"not {expected_range!r} (does it hold a blob of another size?)"
        )
    if response.content_length not in (None, end - start):  # without one, reading checks
        raise BadAnswer(
            f"{provider} announced {response.content_length} bytes for a range of {end - start}"
        )


def _first_error(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first error in a task group's group (cancellation only if nothing else)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [errors]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[:0] = error.exceptions
        else:
            leaves.append(error)
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):
            return leaf
    return leaves[0]


def _nobody(blob_id: str, addresses: Sequence[str], reasons: dict[str, str]) -> str:
    why = "; ".join(f"{a}: {reasons.get(a, 'no answer')}" for a in addresses)
    return f"none of the {len(addresses)} provider(s) could deliver blob {blob_id}: {why}"


def _undelivered(blob_id: str, plan: ChunkPlan, early: dict[str, str]) -> str:
    reasons = {**early, **plan.dropped}
    on_disk = sum(end - start for start, end in plan.completed_ranges())
    return (
        f"{_nobody(blob_id, list(reasons), reasons)}. {on_disk} of {plan.size} bytes are "
        "on disk and the next fetch resumes from them; find other providers and retry"
    )
