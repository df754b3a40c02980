"""Racing providers: ask one, and one more every so often while none answered.

:func:`hedged` is how a node asks its peers anything small (a record, a page of certified
heads) and how the simulator's transport races the providers of a blob: a hung or slow
peer costs a hedge interval, not a timeout, and a peer that answers wrongly is passed over
(the ``ask`` blames it and returns None)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

__all__ = ["HEDGE_S", "SMALL_ANSWER_S", "hedged"]

T = TypeVar("T")

#: While none answered, one more provider is asked every this often.
HEDGE_S = 1.0
#: The longest wait for one provider's answer to a small request (a record, a chain).
SMALL_ANSWER_S = 15.0


async def hedged(
    addresses: Sequence[str],
    ask: Callable[[str], Awaitable[T | None]],
    *,
    on_timeout: Callable[[str, str], None],
    hedge_s: float = HEDGE_S,
    answer_s: float = SMALL_ANSWER_S,
) -> T | None:
    """``ask`` the first address, and one more every ``hedge_s`` while none answered (each
    bounded by ``answer_s``: past it, ``on_timeout(address, reason)``); the first answer
    that is not None wins and the other questions are cancelled. None when nobody
    answered."""
    queue = list(addresses)
    pending: set[asyncio.Task[T | None]] = set()

    async def bounded(address: str) -> T | None:
        try:
            async with asyncio.timeout(answer_s):
                return await ask(address)
        except TimeoutError:
            on_timeout(address, f"no answer within {answer_s:g}s")
            return None

    try:
        while queue or pending:
            if queue:
                pending.add(asyncio.create_task(bounded(queue.pop(0))))
            done, pending = await asyncio.wait(
                pending,
                timeout=hedge_s if queue else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in done:
                answer = task.result()
                if answer is not None:
                    return answer
        return None
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
