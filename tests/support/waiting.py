"""Polling for a condition that another process or socket makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["until"]


async def until(check: Callable[[], bool], within_s: float = 2.0) -> bool:
    """Whether ``check()`` became true within ``within_s`` (polled every 10 ms)."""
    for _ in range(int(within_s / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()
