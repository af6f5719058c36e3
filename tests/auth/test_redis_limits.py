"""The Redis limiter: one fleet-wide limit, its key layout, and what happens when Redis is not there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from gateway.auth import MemoryRateLimiter, Tenant, build_rate_limiter
from gateway.auth.redis_limits import _SHA, RedisRateLimiter, bucket_key
from gateway.config import AuthConfig
from tests.prefix.conftest import free_port

MakeClient = Callable[[str], aioredis.Redis]


def limiter_on(client: aioredis.Redis, prefix: str, fallbacks: list[str], **kw: Any) -> RedisRateLimiter:
    kw.setdefault("budget_s", 0.5)
    return RedisRateLimiter(client, key_prefix=prefix, on_fallback=fallbacks.append, **kw)


async def test_two_instances_share_one_fleet_wide_limit(
    redis_url: str, key_prefix: str, redis_client: MakeClient
) -> None:
    fallbacks: list[str] = []
    gateways = [limiter_on(redis_client(redis_url), key_prefix, fallbacks) for _ in range(2)]
    acme = Tenant("acme", requests_per_minute=10)
    decisions = await asyncio.gather(*(gateways[i % 2].acquire(acme, 0) for i in range(20)))
    assert sum(d.allowed for d in decisions) == 10
    assert {d.source for d in decisions} == {"redis"}

    tokens = Tenant("tok", tokens_per_minute=1000)
    decisions = await asyncio.gather(*(gateways[i % 2].acquire(tokens, 100) for i in range(20)))
    assert sum(d.allowed for d in decisions) == 10
    # A settlement on one instance is seen by the other.
    await gateways[0].settle(tokens, charged_tokens=100, actual_tokens=0)
    seen = await gateways[1].acquire(tokens, 0)
    assert 100 <= seen.remaining_tokens <= 110
    assert fallbacks == []


async def test_memory_limiters_do_not_share() -> None:
    """The control for the test above: separate in-memory buckets admit twice the limit."""
    gateways = [MemoryRateLimiter(), MemoryRateLimiter()]
    acme = Tenant("acme", requests_per_minute=10)
    decisions = await asyncio.gather(*(gateways[i % 2].acquire(acme, 0) for i in range(20)))
    assert sum(d.allowed for d in decisions) == 20


async def test_bucket_key_layout_ttl_and_redis_clock(
    redis_url: str, key_prefix: str, redis_client: MakeClient
) -> None:
    client = redis_client(redis_url)
    limiter = limiter_on(client, key_prefix, [])
    await limiter.acquire(Tenant("acme", requests_per_minute=60, tokens_per_minute=600), 100)
    key = bucket_key(key_prefix, "acme")
    assert key == f"{key_prefix}:ratelimit:{{acme}}"  # the hash tag keeps a tenant in one cluster slot
    state = {k.decode(): float(v) for k, v in (await client.hgetall(key)).items()}
    assert state["r"] == 59 and state["t"] == 500
    seconds, micros = await client.time()
    assert abs(state["ts"] - (seconds * 1_000_000 + micros)) < 5_000_000  # Redis's own clock, in µs
    assert 119_000 < await client.pttl(key) <= 121_000  # full again from a minute's debt: 2 min
    assert await client.keys(f"{key_prefix}:*") == [key.encode()]


async def test_script_is_reloaded_after_redis_forgets_it(
    redis_servers: Any, redis_client: MakeClient
) -> None:
    server = redis_servers()  # private: SCRIPT FLUSH must not touch the shared Redis
    client = redis_client(server.url)
    fallbacks: list[str] = []
    limiter = limiter_on(client, "p", fallbacks)
    acme = Tenant("acme", requests_per_minute=5)
    assert (await limiter.acquire(acme, 0)).source == "redis"  # first call: NOSCRIPT → EVAL
    await client.script_flush()
    second = await limiter.acquire(acme, 0)
    assert second.source == "redis" and second.remaining_requests == 3
    assert await client.script_exists(_SHA) == [True]
    assert fallbacks == []


async def test_closed_port_falls_back_to_local_buckets(redis_client: MakeClient) -> None:
    fallbacks: list[str] = []
    limiter = limiter_on(redis_client(f"redis://127.0.0.1:{free_port()}/0"), "p", fallbacks, retry_after_s=30)
    acme = Tenant("acme", requests_per_minute=3, tokens_per_minute=300)
    decisions = [await limiter.acquire(acme, 10) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]  # same semantics, locally
    assert {d.source for d in decisions} == {"fallback"}
    await limiter.settle(acme, charged_tokens=10, actual_tokens=50)  # no exception either
    assert (await limiter.acquire(acme, 0)).remaining_tokens < 270
    assert fallbacks[0] == "error"  # the connection was refused once…
    assert set(fallbacks[1:]) == {"skipped"}  # …then Redis is not asked during the back-off
    assert len(fallbacks) == 6


async def test_redis_outage_falls_back_and_recovers(redis_servers: Any, redis_client: MakeClient) -> None:
    server = redis_servers()
    fallbacks: list[str] = []
    limiter = limiter_on(redis_client(server.url), "p", fallbacks, budget_s=0.3, retry_after_s=0.2)
    acme = Tenant("acme", requests_per_minute=5)
    for _ in range(3):
        assert (await limiter.acquire(acme, 0)).source == "redis"

    server.kill()
    during = [await limiter.acquire(acme, 0) for _ in range(3)]
    assert {d.source for d in during} == {"fallback"}
    # The local bucket took over from the level Redis last reported (2 left), not from full.
    assert [d.allowed for d in during] == [True, True, False]
    assert fallbacks and set(fallbacks) <= {"error", "timeout", "skipped"}

    redis_servers(port=server.port)  # Redis is back, empty (killed by PID after the test)
    deadline = time.monotonic() + 5
    decision = await limiter.acquire(acme, 0)
    while decision.source != "redis" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        decision = await limiter.acquire(acme, 0)
    assert decision.source == "redis" and decision.allowed
    assert decision.remaining_requests == 4  # a fresh shared bucket
    count = len(fallbacks)
    assert (await limiter.acquire(acme, 0)).source == "redis"
    assert len(fallbacks) == count


async def test_slow_redis_answers_within_the_budget(redis_servers: Any, redis_client: MakeClient) -> None:
    server = redis_servers()  # private: CLIENT PAUSE stops every client of the server
    fallbacks: list[str] = []
    limiter = limiter_on(redis_client(server.url), "p", fallbacks, budget_s=0.1, retry_after_s=0.2)
    acme = Tenant("acme", requests_per_minute=5)
    assert (await limiter.acquire(acme, 0)).source == "redis"
    await redis_client(server.url).execute_command("CLIENT", "PAUSE", 1000, "ALL")
    started = time.monotonic()
    decision = await limiter.acquire(acme, 0)
    assert time.monotonic() - started < 0.5
    assert decision.source == "fallback" and decision.allowed
    assert fallbacks == ["timeout"]


async def test_build_rate_limiter_follows_the_config(redis_url: str, key_prefix: str) -> None:
    assert isinstance(build_rate_limiter(AuthConfig()), MemoryRateLimiter)
    fallbacks: list[str] = []
    config = AuthConfig(
        limits_backend="redis", redis_url=redis_url, key_prefix=key_prefix, redis_budget_s=0.5
    )
    limiter = build_rate_limiter(config, on_fallback=fallbacks.append)
    try:
        decision = await limiter.acquire(Tenant("acme", requests_per_minute=2), 0)
        assert decision.source == "redis" and decision.remaining_requests == 1
    finally:
        await limiter.close()
    assert fallbacks == []
