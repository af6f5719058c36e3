"""Deadlines of one upstream attempt: how long to wait for the next thing, never past the end.

An attempt has one absolute ``deadline`` (its total timeout); each wait (headers, first byte,
the next streamed event) gets its own budget within it.
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_limit"]


def wait_limit(deadline: float, budget_s: float) -> float:
    """Absolute loop time to stop waiting: ``budget_s`` from now, never past ``deadline``."""
    return min(asyncio.get_running_loop().time() + budget_s, deadline)
