"""Adversarial: wrong types and odd bytes under the gateway's own Redis keys (shared Redis, own prefix)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from gateway.auth import Tenant, hash_key
from gateway.auth.redis_keys import add_key, apikey_key
from gateway.auth.redis_limits import RedisRateLimiter, bucket_key
from gateway.request.parse import session_key
from tests.support.harness import chat_body

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"advauth-{uuid.uuid4().hex[:10]}"
    yield p
    client = redis.Redis.from_url(URL)
    try:
        keys = list(client.scan_iter(match=f"{p}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
async def admin(stack) -> aioredis.Redis:
    client = aioredis.from_url(URL)
    stack.push_async_callback(client.aclose)
    return client


def auth_redis(prefix: str, **kw) -> dict:
    return {"enabled": True, "backend": "redis", "redis_url": URL, "key_prefix": prefix, **kw}


async def post(http, gw, key: str, **headers) -> tuple[int, dict]:
    async with http.post(
        gw.url + "/v1/chat/completions",
        json=chat_body(),
        headers={"authorization": f"Bearer {key}", **headers},
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_one_wrongtype_apikey_record_does_not_503_every_other_key(
    start_upstream, start_gateway, http, prefix, admin
):
    """A corrupt record (a STRING where a HASH is expected) is a data error for that key, not an outage."""
    upstream = await start_upstream()
    await add_key(admin, prefix, "sk-good", Tenant("acme"))
    await admin.set(apikey_key(prefix, hash_key("sk-corrupt")), "oops")
    gw = await start_gateway([upstream.url], auth=auth_redis(prefix))
    corrupt_status, corrupt_body = await post(http, gw, "sk-corrupt")
    status, body = await post(http, gw, "sk-good")  # a healthy, never-seen key right after
    assert status == 200, body
    assert corrupt_status in (401, 403), corrupt_body  # not "the key store is unreachable"


async def test_non_utf8_tenant_name_in_apikey_record_is_not_a_500(
    start_upstream, start_gateway, http, prefix, admin
):
    upstream = await start_upstream()
    await admin.hset(apikey_key(prefix, hash_key("sk-bytes")), mapping={"tenant": b"\xff\xfe", "name": "x"})
    gw = await start_gateway([upstream.url], auth=auth_redis(prefix))
    status, body = await post(http, gw, "sk-bytes")
    assert status == 401, body


async def test_non_utf8_session_pin_in_redis_is_not_a_500(start_upstream, start_gateway, http, prefix, admin):
    upstream = await start_upstream()
    gw = await start_gateway(
        [upstream.url],
        policy="session-aware",
        sessions={"backend": "redis", "redis_url": URL, "key_prefix": prefix, "redis_budget_s": 0.5},
    )
    await admin.set(f"{prefix}:session:{{{session_key('s-1')}}}", b"\xff\xfe")
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-session-id": "s-1"}
    ) as resp:
        assert resp.status == 200, await resp.text()


async def test_wrongtype_bucket_of_one_tenant_does_not_unshare_every_tenants_limits(prefix, admin):
    """Tenant a's bucket key holds a STRING: b's limits must still be checked in Redis, and a's must heal."""
    fallbacks: list[str] = []
    client = aioredis.from_url(URL, socket_timeout=2)
    limiter = RedisRateLimiter(client, key_prefix=prefix, budget_s=0.5, on_fallback=fallbacks.append)
    try:
        a, b = Tenant("a", requests_per_minute=100), Tenant("b", requests_per_minute=100)
        await admin.set(bucket_key(prefix, "a"), "not-a-hash")
        await limiter.acquire(a, 1)
        decision_b = await limiter.acquire(b, 1)
        assert decision_b.source == "redis", (decision_b.source, fallbacks)
        await asyncio.sleep(1.1)
        decision_a = await limiter.acquire(a, 1)
        assert decision_a.source == "redis", (decision_a.source, fallbacks)
    finally:
        await limiter.close()
