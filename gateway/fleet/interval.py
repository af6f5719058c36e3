"""The pause between a background loop's rounds, which a config reload can change mid-pause.

A plain ``asyncio.sleep(interval)`` keeps the old interval until it ends: a reload from a
30 s health interval to 2 s would wait up to 30 s to take effect. Here the pause is measured
from its start against whatever the interval is now, so a shorter one ends it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

__all__ = ["Interval"]


class Interval:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._changed = asyncio.Event()

    def set(self, seconds: float) -> None:
        self.seconds = seconds
        self._changed.set()

    async def wait(self) -> None:
        """Until ``seconds`` (as it is now, re-read on every change) after this call."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while (remaining := started + self.seconds - loop.time()) > 0:
            self._changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                return

    async def rounds(self, *, pause_first: bool = False) -> AsyncIterator[None]:
        """Forever: a round (the loop's body), then the pause; ``pause_first``: a round was just made."""
        if pause_first:
            await self.wait()
        while True:
            yield
            await self.wait()
