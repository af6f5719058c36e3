"""The load generators: open-loop Poisson arrivals and a closed loop, under one budget.

A request may start only through :meth:`Budget.take`, which refuses at or after the
deadline and returns the instant it said yes; callers stamp that instant as the request's
start. So no request ever starts at or after the deadline, however late the event loop
wakes a sleeping generator (on a busy machine it can be tens of milliseconds late).

Open loop: arrivals at seeded exponential gaps (``rate=inf``: all at once); the client
never queues in front of the target (no coordinated omission). Closed loop: ``concurrency``
workers each start the next unit of work when their last one finished.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

__all__ = ["Budget", "closed_loop", "open_loop"]

T = TypeVar("T")


class Budget:
    """At most ``max_requests`` starts (None: no cap), none at or after ``t0 + duration_s``."""

    def __init__(self, duration_s: float, max_requests: int | None = None, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.deadline = self.t0 + duration_s
        self.left = math.inf if max_requests is None else max_requests
        self.stopped_by = "completed"  # | "deadline" | "max_requests"

    def exhausted(self, now: float | None = None) -> bool:
        if (time.perf_counter() if now is None else now) >= self.deadline:
            self.stopped_by = "deadline"
            return True
        if self.left <= 0:
            self.stopped_by = "max_requests"
            return True
        return False

    def take(self) -> float | None:
        """The start time of one more request (``perf_counter``), or None: stop."""
        now = time.perf_counter()
        if self.exhausted(now):
            return None
        self.left -= 1
        return now


async def open_loop(
    work: Callable[[float], Awaitable[None] | None],
    *,
    rate: float,
    budget: Budget,
    rng: random.Random,
) -> float:
    """Call ``work(scheduled_at)`` at each arrival and run what it returns as a task.

    ``work`` returns None when it has nothing more to send. Arrivals stop at the budget;
    then every task is awaited (bounded by the caller's own timeouts). Returns how long
    arrivals ran (seconds). If the generator is cancelled, its tasks are cancelled too.
    """
    tasks: set[asyncio.Task[None]] = set()
    next_at = budget.t0
    try:
        while not budget.exhausted():
            if math.isfinite(rate):
                next_at += rng.expovariate(rate)
                if next_at >= budget.deadline:
                    budget.stopped_by = "deadline"
                    break
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                if budget.exhausted():  # woke at or after the deadline
                    break
            job = work(next_at)
            if job is None:
                break
            task = asyncio.ensure_future(job)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        load_s = time.perf_counter() - budget.t0
        if tasks:
            await asyncio.gather(*tasks)
        return load_s
    finally:
        pending = list(tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def closed_loop(
    items: Iterator[T], run: Callable[[T], Awaitable[None]], *, concurrency: int, budget: Budget
) -> None:
    """``concurrency`` workers share ``items``; each runs one to the end, then takes the next."""

    async def worker() -> None:
        for item in items:  # shared iterator: each item goes to one worker
            if budget.exhausted():
                return
            await run(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
