"""Background tasks that cannot die silently: each runs under a supervisor that logs, counts
and restarts it (with back-off) when it raises, until it is cancelled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["supervise"]

log = logging.getLogger(__name__)


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    *,
    on_crash: Callable[[str], None] | None = None,
    first_backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
) -> None:
    """Run ``run()`` forever: a crash is logged with its traceback, reported, and restarted."""
    backoff = first_backoff_s
    while True:
        try:
            await run()
            log.error("background task %s returned; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s crashed; restarting in %.1fs", name, backoff)
        if on_crash is not None:
            on_crash(name)
        await asyncio.sleep(backoff)
        backoff = min(max_backoff_s, backoff * 2)
