"""Deadlines of one upstream attempt: how long to wait for the next thing, never past the end.

An attempt has one absolute ``deadline`` (its total timeout); each wait (headers, first byte,
the next streamed event) gets its own budget within it.
"""

from __future__ import annotations

import asyncio

__all__ = ["extend_idle", "wait_limit"]


def wait_limit(deadline: float, budget_s: float) -> float:
    """Absolute loop time to stop waiting: ``budget_s`` from now, never past ``deadline``."""
    return min(asyncio.get_running_loop().time() + budget_s, deadline)


def extend_idle(limit: asyncio.Timeout, deadline: float, idle_s: float) -> None:
    """Push a stream's idle limit past ``idle_s`` from now, lazily: only once it falls short,
    and then by 1 % of ``idle_s`` more, so a stream of events rearms its timer about once
    every ``idle_s / 100`` instead of at every event (a timer rearmed per event was 7 % of a
    paced stream's profile). A stall is still cut at ``idle_s`` after the last event, at
    most 1 % late; never past ``deadline``. A limit further ahead than that (the first-byte
    limit, when the first chunk held half an event) is pulled in."""
    wanted = wait_limit(deadline, idle_s)
    when = limit.when()
    slack_s = idle_s / 100
    if when is None or when < wanted or when > wanted + slack_s:
        limit.reschedule(min(wanted + slack_s, deadline))
