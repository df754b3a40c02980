"""A child process that writes blobs into a store and reports each one on stdout.

Usage: ``python blob_writer_child.py ROOT SEED MODE [COUNT]``

* ``loop``: write random blobs (64 KiB to 4 MiB) for ever, alternating put and put_stream.
* ``count``: write COUNT random blobs the same way, then exit 0.
* ``pause-mid-stream``: start a put_stream, write part of it, report ``streaming``, then block
  reading stdin, so the parent can kill us with a temporary file certainly on disk.

Lines: ``ready <seed>`` once, then ``writing <size>`` before each blob and
``wrote <id> <size>`` once it is durable.
"""

from __future__ import annotations

import random
import struct
import sys
from collections.abc import Iterator

from p2ptrain.store.blobs import BlobStore

MIN_SIZE = 64 << 10
MAX_SIZE = 4 << 20


def report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write_blobs(store: BlobStore, rng: random.Random, count: int | None) -> None:
    # Slices of one random pool behind a unique header: distinct blobs, cheap to make, so
    # the time between two blobs is spent almost entirely inside put.
    pool = rng.randbytes(2 * MAX_SIZE)
    written = 0
    while count is None or written < count:
        size = rng.randint(MIN_SIZE, MAX_SIZE)
        offset = rng.randrange(len(pool) - size)
        data = struct.pack(">QQ", rng.getrandbits(64), written) + pool[offset : offset + size]
        report(f"writing {len(data)}")
        if written % 2:
            chunks = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
            identifier = store.put_stream(chunks)
        else:
            identifier = store.put(data)
        written += 1
        report(f"wrote {identifier} {len(data)}")


def pause_mid_stream(store: BlobStore, rng: random.Random) -> None:
    def chunks() -> Iterator[bytes]:
        yield rng.randbytes(MIN_SIZE)
        yield rng.randbytes(MIN_SIZE)  # the first chunk is on disk once this is asked for
        report("streaming")
        sys.stdin.readline()  # blocks until the parent kills us
        yield b"never written"

    store.put_stream(chunks())


def main(argv: list[str]) -> int:
    root, seed, mode = argv[1], int(argv[2]), argv[3]
    rng = random.Random(seed)
    store = BlobStore(root)
    report(f"ready {seed}")
    if mode == "loop":
        write_blobs(store, rng, None)
    elif mode == "count":
        write_blobs(store, rng, int(argv[4]))
    elif mode == "pause-mid-stream":
        pause_mid_stream(store, rng)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
