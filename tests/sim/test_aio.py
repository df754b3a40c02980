"""The simulator's asyncio loop: virtual time for sleeps, timeouts and waits, FIFO order of
ready callbacks, cancelled timers that never fire, and unhandled errors kept."""

from __future__ import annotations

import asyncio
import random

import pytest

from p2ptrain.sim.aio import SimLoop
from p2ptrain.sim.engine import Simulator


def _loop() -> tuple[Simulator, SimLoop]:
    sim = Simulator(random.Random(1))
    return sim, SimLoop(sim)


def test_sleeps_and_timeouts_run_on_virtual_time_in_order() -> None:
    sim, loop = _loop()
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        seen.append((name, loop.time()))

    async def waiter() -> None:
        try:
            async with asyncio.timeout(5.0):
                await asyncio.Event().wait()
        except TimeoutError:
            seen.append(("timed out", loop.time()))

    with loop.running():
        for name, delay in [("b", 2.0), ("a", 1.0), ("c", 2.0)]:
            loop.create_task(sleeper(name, delay))
        loop.create_task(waiter())
        sim.run(until=3600.0)
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0), ("timed out", 5.0)]
    assert loop.errors == []


def test_a_cancelled_timer_never_fires_and_leaves_no_event() -> None:
    sim, loop = _loop()
    fired: list[float] = []
    with loop.running():
        handle = loop.call_later(10.0, lambda: fired.append(loop.time()))
        loop.call_later(1.0, handle.cancel)
        sim.run(until=60.0)
    assert fired == []
    assert sim.pending == 0


def test_the_same_program_gives_the_same_trace() -> None:
    def trace() -> list[tuple[int, float]]:
        sim, loop = _loop()
        rng = random.Random(7)
        out: list[tuple[int, float]] = []

        async def worker(i: int) -> None:
            for _ in range(5):
                await asyncio.sleep(rng.choice([0.0, 0.5, 1.0]))
                out.append((i, loop.time()))

        async def main() -> None:
            async with asyncio.TaskGroup() as group:
                for i in range(4):
                    group.create_task(worker(i))

        with loop.running():
            loop.create_task(main())
            sim.run(until=100.0)
        return out

    first = trace()
    assert len(first) == 20
    assert trace() == first


def test_an_unhandled_error_is_kept_and_pending_tasks_settle() -> None:
    sim, loop = _loop()

    def boom() -> None:
        raise ValueError("a bug")

    async def forever() -> None:
        await asyncio.Event().wait()

    with loop.running():
        loop.call_soon(boom)
        task = loop.create_task(forever())
        sim.run(until=1.0)
        loop.settle()
    assert task.cancelled()
    assert len(loop.errors) == 1 and "a bug" in loop.errors[0]


@pytest.mark.parametrize("delay", [0.0, 0.25])
def test_wait_for_first_completed_hedges_on_virtual_time(delay: float) -> None:
    sim, loop = _loop()
    result: list[object] = []

    async def slow() -> str:
        await asyncio.sleep(3.0)
        return "slow"

    async def fast() -> str:
        await asyncio.sleep(delay)
        return "fast"

    async def main() -> None:
        first = loop.create_task(slow())
        done, _ = await asyncio.wait({first}, timeout=1.0)
        assert not done and loop.time() == 1.0
        second = loop.create_task(fast())
        done, pending = await asyncio.wait({first, second}, return_when="FIRST_COMPLETED")
        result.extend(t.result() for t in done)
        result.append(loop.time())
        for task in pending:
            task.cancel()

    with loop.running():
        loop.create_task(main())
        sim.run(until=10.0)
    assert result == ["fast", 1.0 + delay]
