"""Which byte range to ask which provider for, and which provider's bytes to believe.

Pure (no I/O, no clock): :class:`ChunkPlan` hands out spans of a blob to providers, takes
back what failed from the byte reached, and drops providers that keep failing;
:class:`Reconciliation` decides, after a blob failed its hash, which versions of each piece
to try together, and which providers are proven to have served bad bytes.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from p2ptrain.errors import LocalError

__all__ = ["ChunkPlan", "Piece", "Reconciliation", "Span"]


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes ``[start, end)`` of chunk ``chunk`` to ask one provider for."""

    chunk: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, end)`` as one provider served them (None: from an earlier fetch)."""

    start: int
    end: int
    provider: str | None


# -- the plan (pure) ----------------------------------------------------------------------


class ChunkPlan:
    """Which range to ask which provider for. Pure: no I/O, no clock.

    Chunks are handed out lowest first, so the hashed prefix keeps growing. The first
    ``ramp`` chunks grow from ``chunk_bytes / ramp`` to ``chunk_bytes``: streams that start
    together then finish their chunks one after another, in order, so the prefix hasher
    follows the downloads closely instead of facing every stream's chunk at the end. The
    bytes of a chunk arrive in order, so its progress is one offset (``reached``): a chunk
    that fails goes back to the queue from there, and a provider that failed it gets it
    again only when every live provider has. ``completed`` are byte ranges already on disk
    (a resume).
    """

    def __init__(
        self,
        size: int,
        chunk_bytes: int,
        providers: Sequence[str],
        *,
        max_failures: int = 3,
        completed: Iterable[tuple[int, int]] = (),
        ramp: int = 1,
    ) -> None:
        if size < 0 or chunk_bytes <= 0 or max_failures < 1 or ramp < 1:
            raise LocalError(
                "a chunk plan needs size >= 0, chunk_bytes > 0, max_failures >= 1 and "
                f"ramp >= 1; got {size}, {chunk_bytes}, {max_failures}, {ramp}"
            )
        self.size = size
        self.max_failures = max_failures
        self._starts, self._ends = _boundaries(size, chunk_bytes, ramp)
        count = len(self._starts)
        self._reached = list(self._starts)
        self._owner: list[str | None] = [None] * count
        self._failed_by: list[set[str]] = [set() for _ in range(count)]
        self._pieces: list[list[Piece]] = [[] for _ in range(count)]
        self.failures: Counter[str] = Counter()
        #: Dropped providers and why (the first reason that dropped them).
        self.dropped: dict[str, str] = {}
        self.live: list[str] = list(dict.fromkeys(providers))
        for first, last in _merged(completed):
            for chunk in range(count):
                start = self._starts[chunk]
                if first <= start < last:
                    self._reached[chunk] = min(last, self._ends[chunk])
                    self._pieces[chunk] = [Piece(start, self._reached[chunk], None)]
        self.resumed_bytes = sum(r - s for r, s in zip(self._reached, self._starts, strict=True))
        self._pending = [i for i in range(count) if self._reached[i] < self._ends[i]]
        self._frontier_chunk = 0
        self._advance_frontier()

    def chunk_end(self, chunk: int) -> int:
        return self._ends[chunk]

    @property
    def complete(self) -> bool:
        return self._frontier_chunk == len(self._reached)

    @property
    def frontier(self) -> int:
        """Bytes ``[0, frontier)`` are all on disk."""
        if self.complete:
            return self.size
        return self._reached[self._frontier_chunk]

    @property
    def stalled(self) -> bool:
        """Nothing more can arrive: chunks are missing and every provider is dropped."""
        return not self.complete and not self.live

    def next_span(self, provider: str) -> Span | None:
        """The next range for one of ``provider``'s streams, or None for now."""
        if provider not in self.live:
            return None
        everyone = set(self.live)
        for index, chunk in enumerate(self._pending):
            failed_by = self._failed_by[chunk]
            if provider not in failed_by or everyone <= failed_by:
                del self._pending[index]
                self._owner[chunk] = provider
                return Span(chunk, self._reached[chunk], self.chunk_end(chunk))
        return None

    def received(self, chunk: int, provider: str, count: int) -> bool:
        """``count`` more bytes of ``chunk`` are on disk; True when the chunk is complete."""
        start = self._reached[chunk]
        end = start + count
        self._reached[chunk] = end
        pieces = self._pieces[chunk]
        if pieces and pieces[-1].provider == provider and pieces[-1].end == start:
            pieces[-1] = Piece(pieces[-1].start, end, provider)
        else:
            pieces.append(Piece(start, end, provider))
        if end < self.chunk_end(chunk):
            return False
        self._owner[chunk] = None
        self._advance_frontier()
        return True

    def failed(self, chunk: int, provider: str, reason: str, *, fatal: bool = False) -> bool:
        """``provider`` failed ``chunk``: the rest of it goes back to the queue. Returns
        True when this drops the provider (``fatal``, or too many failures)."""
        if self._owner[chunk] == provider:
            self._owner[chunk] = None
            insort(self._pending, chunk)
        self._failed_by[chunk].add(provider)
        return self.strike(provider, reason, fatal=fatal)

    def strike(self, provider: str, reason: str, *, fatal: bool = False) -> bool:
        """Count a failure against ``provider``; True when this drops it."""
        self.failures[provider] += 1
        if provider in self.live and (fatal or self.failures[provider] >= self.max_failures):
            self.drop(provider, reason)
            return True
        return False

    def drop(self, provider: str, reason: str) -> None:
        if provider in self.live:
            self.live.remove(provider)
            self.dropped.setdefault(provider, reason)

    def pieces(self) -> list[Piece]:
        """Who served which bytes, in order; covers ``[0, size)`` once complete."""
        return [piece for pieces in self._pieces for piece in pieces]

    def completed_ranges(self) -> list[tuple[int, int]]:
        """The byte ranges on disk, merged (for the progress record)."""
        return _merged(
            (start, reached)
            for start, reached in zip(self._starts, self._reached, strict=True)
            if reached > start
        )

    def _advance_frontier(self) -> None:
        while self._frontier_chunk < len(self._reached) and self._reached[
            self._frontier_chunk
        ] == self.chunk_end(self._frontier_chunk):
            self._frontier_chunk += 1


def _boundaries(size: int, chunk_bytes: int, ramp: int) -> tuple[list[int], list[int]]:
    """Chunk starts and ends: ``ramp`` growing chunks, then ``chunk_bytes`` each."""
    starts: list[int] = []
    ends: list[int] = []
    position = 0
    while position < size:
        rung = len(starts) + 1
        length = max(1, chunk_bytes * rung // ramp) if rung <= ramp else chunk_bytes
        starts.append(position)
        position = min(size, position + length)
        ends.append(position)
    return starts, ends


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


# -- reconciliation (pure) ----------------------------------------------------------------


@dataclass(slots=True)
class _Version:
    digest: bytes  # SHA-256 of the piece's bytes in this version
    file: int  # where they are: 0 is the partial file, n > 0 the n-th re-fetch file
    providers: set[str] = field(default_factory=set)


class Reconciliation:
    """Which providers' bytes to believe when the assembled blob does not hash to its id.

    Each piece starts with one version, the bytes on disk. Rounds of :meth:`refetch_plan`
    ask providers that have not served a piece yet for it again; different bytes are a new
    version (told apart by SHA-256). :meth:`candidates` are assemblies of one version per
    piece: by majority (ties to the newest version), then for each provider the hypotheses
    "it lies" (majority without its votes) and "it tells the truth" (its version wherever it
    served one). Once every live provider was asked for every piece, the last kind covers
    any honest provider, so one honest provider suffices. When a candidate hashes to the id,
    :meth:`blame` names every provider that served other bytes for any piece: proof, not
    suspicion. Pure: the caller fetches, hashes and tells the results.
    """

    def __init__(self, pieces: Sequence[Piece], digests: Sequence[bytes]) -> None:
        if len(pieces) != len(digests):
            raise LocalError("reconciliation needs one digest per piece")
        self.pieces = list(pieces)
        self._versions = [
            [_Version(digest, 0, {p.provider} if p.provider is not None else set())]
            for p, digest in zip(pieces, digests, strict=True)
        ]
        self._asked = [{p.provider} if p.provider is not None else set() for p in pieces]
        self._tried: set[tuple[int, ...]] = {(0,) * len(pieces)}

    def add(self, piece: int, provider: str, digest: bytes, file: int) -> None:
        """``provider`` served piece ``piece`` with bytes hashing to ``digest``, kept in
        ``file`` at the piece's offsets."""
        for version in self._versions[piece]:
            if version.digest == digest:
                version.providers.add(provider)
                return
        self._versions[piece].append(_Version(digest, file, {provider}))

    def file_of(self, piece: int, version: int) -> int:
        return self._versions[piece][version].file

    def digest_of(self, piece: int, version: int) -> bytes:
        return self._versions[piece][version].digest

    def contested(self) -> list[int]:
        return [i for i, versions in enumerate(self._versions) if len(versions) > 1]

    def candidates(self) -> list[tuple[int, ...]]:
        """Assemblies not tried yet (a version index per piece), most plausible first."""
        voters = sorted({p for versions in self._versions for v in versions for p in v.providers})
        found: list[tuple[int, ...]] = []
        choices = [tuple(_pick(vs, excluded) for vs in self._versions) for excluded in voters]
        choices += [tuple(_trust(vs, trusted) for vs in self._versions) for trusted in voters]
        for choice in [tuple(_pick(vs, None) for vs in self._versions), *choices]:
            if choice not in self._tried and choice not in found:
                found.append(choice)
        return found

    def tried(self, choice: tuple[int, ...]) -> None:
        self._tried.add(choice)

    def refetch_plan(self, live: Sequence[str]) -> dict[int, str]:
        """Piece -> provider for the next round: contested pieces, or every piece when none
        is, each from a live provider that has not been asked for it, spreading the load.
        Empty when nobody is left to ask."""
        order = {provider: i for i, provider in enumerate(live)}
        load: Counter[str] = Counter()
        plan: dict[int, str] = {}
        for targets in (self.contested(), range(len(self.pieces))):
            for piece in targets:
                options = [p for p in live if p not in self._asked[piece]]
                if options:
                    chosen = min(options, key=lambda p: (load[p], order[p]))
                    plan[piece] = chosen
                    load[chosen] += 1
                    self._asked[piece].add(chosen)
            if plan:
                return plan
        return plan

    def blame(self, choice: tuple[int, ...]) -> dict[str, Piece]:
        """Given the assembly that verified: each provider that served other bytes, and the
        first piece where it did."""
        bad: dict[str, Piece] = {}
        for piece, (chosen, versions) in enumerate(zip(choice, self._versions, strict=True)):
            for index, version in enumerate(versions):
                if index != chosen:
                    start, end = self.pieces[piece].start, self.pieces[piece].end
                    for provider in sorted(version.providers):
                        bad.setdefault(provider, Piece(start, end, provider))
        return bad


def _pick(versions: list[_Version], excluded: str | None) -> int:
    """The version with the most votes, not counting ``excluded``'s; ties to the newest."""
    return max(range(len(versions)), key=lambda i: (len(versions[i].providers - {excluded}), i))


def _trust(versions: list[_Version], trusted: str) -> int:
    """The version ``trusted`` served, or the majority's if it served none."""
    mine = [i for i, version in enumerate(versions) if trusted in version.providers]
    return mine[0] if mine else _pick(versions, None)
