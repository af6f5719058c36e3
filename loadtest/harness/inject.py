"""Fault injection by PID or by a replica's own fault switch, timed against the load's clock."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from loadtest.harness.processes import ManagedProcess
from loadtest.harness.redis_server import RedisServer

__all__ = ["REPLICA_FAULTS", "fault_replica", "redis_outage", "sleep_until"]

#: The simulator's ``POST /admin/fault`` bodies, by scenario name.
REPLICA_FAULTS: dict[str, dict[str, Any]] = {
    "error": {"mode": "error", "status": 500},
    "hang": {"mode": "hang"},
    "drop": {"mode": "drop", "after_chunks": 3},  # role chunk + 2 content chunks, then the cut
}


async def sleep_until(t0: float, at_s: float) -> None:
    """Sleep until ``at_s`` seconds after ``t0`` (a ``perf_counter`` reading)."""
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))


async def fault_replica(session: aiohttp.ClientSession, replica: ManagedProcess, fault: str) -> None:
    """``kill``: SIGKILL by PID; otherwise switch the replica's fault mode (``REPLICA_FAULTS``)."""
    if fault == "kill":
        await replica.kill()
        return
    async with session.post(replica.url + "/admin/fault", json=REPLICA_FAULTS[fault]) as resp:
        resp.raise_for_status()


async def redis_outage(redis: RedisServer, down_s: float, t0: float) -> tuple[float, float]:
    """SIGKILL Redis, restart it on the same port ``down_s`` later; (killed at, back at) since t0."""
    killed = time.perf_counter() - t0
    await redis.kill_async()
    await asyncio.sleep(down_s)
    await redis.start_async()
    return killed, time.perf_counter() - t0
