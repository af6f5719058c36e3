"""The load-test harness: ports, the budget and generators, the redis-server wrapper."""

from __future__ import annotations

import asyncio
import random
import shutil
import time

import pytest

from loadtest.harness.load import Budget, closed_loop, open_loop
from loadtest.harness.ports import free_port, free_ports
from loadtest.harness.redis_server import RedisServer


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)
    assert free_port() > 0


def test_budget_stops_at_the_cap_and_at_the_deadline() -> None:
    budget = Budget(60.0, max_requests=2)
    assert budget.take() is not None and budget.take() is not None
    assert budget.take() is None and budget.stopped_by == "max_requests"
    late = Budget(0.0)
    assert late.take() is None and late.stopped_by == "deadline"


async def test_open_loop_never_starts_at_or_after_the_deadline() -> None:
    """A starved event loop wakes the generator late; no request may start past the deadline."""
    budget = Budget(0.3)
    starts: list[float] = []

    async def request() -> None:
        await asyncio.sleep(0)

    def work(_scheduled_at: float):
        time.sleep(0.02)  # the loop is busy elsewhere: every wake-up comes late
        sent = budget.take()
        if sent is None:
            return None
        starts.append(sent)
        return request()

    await open_loop(work, rate=200.0, budget=budget, rng=random.Random(1))
    assert starts and max(starts) < budget.deadline
    assert budget.stopped_by == "deadline"


async def test_closed_loop_keeps_the_concurrency() -> None:
    budget = Budget(10.0, max_requests=12)
    running, peak = 0, 0

    async def run(_item: int) -> None:
        nonlocal running, peak
        if budget.take() is None:
            return
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    await closed_loop(iter(range(100)), run, concurrency=3, budget=budget)
    assert peak == 3 and budget.left == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not on PATH")
async def test_redis_server_starts_dies_and_comes_back(tmp_path) -> None:
    server = await RedisServer(log_dir=tmp_path).start_async()
    try:
        assert server.running
        port = server.port
        await server.kill_async()
        assert not server.running
        await server.start_async()
        assert server.running and server.port == port
    finally:
        await server.stop_async()
    assert not server.running
    sync = RedisServer().start()
    sync.kill()
    assert sync.proc is None
