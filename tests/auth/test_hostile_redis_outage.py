"""A private Redis that gets slow (DEBUG SLEEP), dies and comes back empty, under load."""

from __future__ import annotations

import asyncio
import collections

import pytest
import redis.asyncio as aioredis

from gateway.auth import Tenant
from gateway.auth.redis_keys import add_key
from gateway.auth.redis_limits import bucket_key
from loadtest.harness.redis_server import RedisServer
from tests.support.harness import chat_body


@pytest.fixture
async def debug_redis():
    server = RedisServer(extra_args=("--enable-debug-command", "yes"))
    await server.start_async()
    yield server
    await server.kill_async()


async def _sleep_redis(url: str, seconds: float) -> None:
    c = aioredis.from_url(url, socket_timeout=seconds + 5)
    try:
        await c.execute_command("DEBUG", "SLEEP", seconds)
    finally:
        await c.aclose()


async def test_slow_then_dead_then_back_redis_never_5xx_and_limits_reshare(
    start_upstream, start_gateway, http, debug_redis
):
    upstream = await start_upstream()
    admin = aioredis.from_url(debug_redis.url)
    tenant = Tenant("a", requests_per_minute=1_000_000, tokens_per_minute=100_000_000)
    await add_key(admin, "adv", "sk-a", tenant)
    gw = await start_gateway(
        [upstream.url],
        auth={
            "enabled": True,
            "backend": "redis",
            "redis_url": debug_redis.url,
            "key_prefix": "adv",
            "limits_backend": "redis",
        },
    )
    statuses: collections.Counter[int] = collections.Counter()
    bodies: list[str] = []
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            async with http.post(
                gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer sk-a"}
            ) as resp:
                statuses[resp.status] += 1
                if resp.status >= 500:
                    bodies.append(await resp.text())

    workers = [asyncio.create_task(worker()) for _ in range(8)]
    try:
        await asyncio.sleep(0.5)
        for _ in range(3):
            await _sleep_redis(debug_redis.url, 0.3)
            await asyncio.sleep(0.3)
        await admin.aclose()
        await debug_redis.kill_async()
        await asyncio.sleep(1.5)
        await debug_redis.start_async()  # same port, empty
        admin = aioredis.from_url(debug_redis.url)
        await add_key(admin, "adv", "sk-a", tenant)
        await asyncio.sleep(2.0)
    finally:
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
    assert sum(statuses.values()) > 50
    assert all(s < 500 for s in statuses), (statuses, bodies[:3])
    # Back on Redis: the shared bucket exists again and moves with each request.
    before = await admin.hget(bucket_key("adv", "a"), "r")
    assert before is not None, "rate limiter never went back to Redis"
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer sk-a"}
    ) as resp:
        assert resp.status == 200
    after = await admin.hget(bucket_key("adv", "a"), "r")
    assert float(after) < float(before) + 1  # refill of ~0 s at most + 1 taken
    await admin.aclose()
