"""A long loop on the event loop, in slices: it yields once a few milliseconds have run.

Replays of 10,000 KV-event batches and bursts of events held the loop for 0.6 s before they
were cut into slices; every request's timing waited behind them.
"""

from __future__ import annotations

import asyncio

__all__ = ["TimeSlice"]


class TimeSlice:
    __slots__ = ("_budget_s", "_loop", "_until")

    def __init__(self, budget_s: float = 0.005) -> None:
        self._loop = asyncio.get_running_loop()
        self._budget_s = budget_s
        self._until = self._loop.time() + budget_s

    def spent(self) -> bool:
        """The slice's time has run out (a loop that stops there rather than yield)."""
        return self._loop.time() > self._until

    async def pause(self) -> None:
        """Yield to the loop if the slice's time has run out, then start a new slice."""
        if self._loop.time() > self._until:
            await asyncio.sleep(0)
            self._until = self._loop.time() + self._budget_s
