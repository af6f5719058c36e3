"""TimeSlice: a long loop yields to the event loop once its slice has run, and only then."""

from __future__ import annotations

import asyncio
import time

from gateway.ops.time_slice import TimeSlice


async def test_a_loop_yields_once_per_slice_so_other_tasks_run() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    ticks = 0
    time_slice = TimeSlice(0.005)
    started = time.monotonic()
    steps = yields = 0
    while yields < 10:  # work that never awaits by itself, until it yielded ten times
        before = ticks
        await time_slice.pause()
        steps += 1
        yields += ticks != before
    elapsed = time.monotonic() - started
    other.cancel()
    assert elapsed >= 10 * 0.005 * 0.99, elapsed  # never before its slice ran out
    assert steps > 10 * 50, steps  # many steps a slice: not a yield at every step


async def test_spent_says_when_the_slice_ran_out() -> None:
    time_slice = TimeSlice(0.01)
    assert not time_slice.spent()
    until = time.monotonic() + 0.015
    while time.monotonic() < until:  # the slice's time passes without a yield
        pass
    assert time_slice.spent()
    await time_slice.pause()  # yields and starts a new slice
    assert not time_slice.spent()
