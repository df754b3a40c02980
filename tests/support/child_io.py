"""How test child processes talk to their parent: JSON lines out, lines in on stdin."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """Write one ``{"event": event, ...}`` line to stdout, flushed."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def stdin_lines() -> AsyncIterator[bytes]:
    """Lines from stdin, without blocking the event loop, until the parent closes it."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield line


async def wait_for_stdin_eof() -> None:
    """Return when the parent closes our stdin (its way of saying: stop)."""
    async for _ in stdin_lines():
        pass
