"""The Redis key store: layout, the local cache, revocation, and lookups while Redis is down."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.auth import KeyStoreUnavailable, Tenant, build_key_store, hash_key
from gateway.auth.redis_keys import RedisKeyStore, add_key, apikey_key, remove_key, tenant_key
from gateway.config import AuthConfig

MakeClient = Callable[[str], aioredis.Redis]
ACME = Tenant(
    "acme",
    priority="critical",
    models=frozenset({"llama-3-8b"}),
    requests_per_minute=600,
    tokens_per_minute=200_000,
    debug=True,
    key_name="ci-key",
)
RAW = "sk-redis-acme-0001"


def store_on(
    client: aioredis.Redis, prefix: str, fallbacks: list[str] | None = None, **kw: Any
) -> RedisKeyStore:
    kw.setdefault("budget_s", 0.5)
    on_fallback = fallbacks.append if fallbacks is not None else None
    return RedisKeyStore(client, key_prefix=prefix, on_fallback=on_fallback, **kw)


async def test_add_key_writes_the_documented_layout_and_lookup_reads_it(
    redis_url: str, key_prefix: str, redis_client: MakeClient
) -> None:
    client = redis_client(redis_url)
    digest = await add_key(client, key_prefix, RAW, ACME)
    assert digest == hash_key(RAW)
    assert await client.hgetall(apikey_key(key_prefix, digest)) == {b"tenant": b"acme", b"name": b"ci-key"}
    assert json.loads(await client.get(tenant_key(key_prefix, "acme"))) == {
        "priority": "critical",
        "models": ["llama-3-8b"],
        "requests_per_minute": 600,
        "tokens_per_minute": 200000,
        "debug": True,
    }
    assert RAW.encode() not in b"".join(await client.keys(f"{key_prefix}:*"))  # only the hash is stored

    store = store_on(redis_client(redis_url), key_prefix)
    tenant = await store.lookup(RAW)
    assert tenant == ACME and tenant is not None and tenant.key_name == "ci-key"
    assert await store.lookup("sk-not-a-key") is None


async def test_lookups_are_cached_then_follow_redis(
    redis_url: str, key_prefix: str, redis_client: MakeClient
) -> None:
    admin = redis_client(redis_url)
    await add_key(admin, key_prefix, RAW, ACME)
    store = store_on(redis_client(redis_url), key_prefix, cache_ttl_s=0.3, negative_ttl_s=0.3)
    assert await store.lookup(RAW) == ACME

    assert await remove_key(admin, key_prefix, RAW)
    assert await store.lookup(RAW) == ACME  # cached: no round trip per request
    await asyncio.sleep(0.35)
    assert await store.lookup(RAW) is None  # the revocation is seen after the TTL

    # An unknown key is cached too (briefly), and a key added later is then found.
    await add_key(admin, key_prefix, RAW, Tenant("acme", requests_per_minute=5))
    assert await store.lookup(RAW) is None
    await asyncio.sleep(0.35)
    changed = await store.lookup(RAW)
    assert changed is not None and changed.requests_per_minute == 5 and changed.priority == "standard"

    await admin.set(tenant_key(key_prefix, "acme"), json.dumps({"priority": "sheddable"}))
    store.reload()  # SIGHUP: forget the cache at once
    changed = await store.lookup(RAW)
    assert changed is not None and changed.priority == "sheddable" and changed.requests_per_minute == 0


async def test_concurrent_misses_share_one_fetch(redis_servers: Any, redis_client: MakeClient) -> None:
    server = redis_servers()  # private: its command counters are ours alone
    admin = redis_client(server.url)
    await add_key(admin, "p", RAW, ACME)
    await admin.config_resetstat()
    store = store_on(redis_client(server.url), "p")
    tenants = await asyncio.gather(*(store.lookup(RAW) for _ in range(20)))
    assert tenants == [ACME] * 20
    stats = await admin.info("commandstats")
    assert stats["cmdstat_hgetall"]["calls"] == 1
    assert stats["cmdstat_get"]["calls"] == 1


async def test_redis_down_serves_cached_keys_and_refuses_to_guess(
    redis_servers: Any, redis_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_servers()
    await add_key(redis_client(server.url), "p", RAW, ACME)
    fallbacks: list[str] = []
    store = store_on(
        redis_client(server.url), "p", fallbacks, cache_ttl_s=0.05, budget_s=0.3, retry_after_s=0.2
    )
    assert await store.lookup(RAW) == ACME

    caplog.set_level(logging.INFO)
    server.kill()
    await asyncio.sleep(0.1)  # the cached entry is now stale
    assert await store.lookup(RAW) == ACME  # stale beats refusing every request
    with pytest.raises(KeyStoreUnavailable):
        await store.lookup("sk-never-seen")  # unknown ≠ invalid: the caller answers 503, not 401
    assert fallbacks[0] == "error" and set(fallbacks) <= {"error", "skipped"}
    assert "sk-never-seen" not in caplog.text and RAW not in caplog.text

    redis_servers(port=server.port)  # back, but empty: the key is gone
    await asyncio.sleep(0.25)  # past the back-off
    assert await store.lookup(RAW) is None


async def test_random_keys_do_not_push_valid_keys_out_of_the_cache(
    redis_servers: Any, redis_client: MakeClient
) -> None:
    """Unknown keys cost anyone nothing to send: they must not evict the valid keys that carry
    the gateway through a Redis outage (100,500 random keys flushed a 100,000-entry cache)."""
    server = redis_servers()
    await add_key(redis_client(server.url), "p", RAW, ACME)
    store = store_on(redis_client(server.url), "p", cache_ttl_s=0.05, budget_s=0.3, max_cached=50)
    assert await store.lookup(RAW) == ACME
    for i in range(500):
        assert await store.lookup(f"sk-random-{i}") is None
    server.kill()
    await asyncio.sleep(0.1)  # stale: only the cache can answer now
    assert await store.lookup(RAW) == ACME
    assert await store.lookup("sk-random-499") is None  # known unknown, still refused while Redis is down


async def test_a_broken_tenant_record_refuses_its_keys_and_says_why(
    redis_url: str, key_prefix: str, redis_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis_client(redis_url)
    await add_key(admin, key_prefix, RAW, ACME)
    await admin.set(tenant_key(key_prefix, "acme"), json.dumps({"priority": "urgent"}))
    orphan = "sk-orphan-key"
    await admin.hset(apikey_key(key_prefix, hash_key(orphan)), mapping={"tenant": "ghost", "name": "old"})
    store = store_on(redis_client(redis_url), key_prefix)
    with caplog.at_level(logging.WARNING, logger="gateway.auth"):
        assert await store.lookup(RAW) is None
        assert await store.lookup(orphan) is None
    assert "tenant 'acme' in Redis is invalid (priority: Input should be" in caplog.text
    assert f"API key {hash_key(orphan)[:8]}… (old): tenant 'ghost' has no spec" in caplog.text
    for secret in (RAW, orphan, hash_key(RAW), hash_key(orphan)):
        assert secret not in caplog.text


async def test_build_key_store_for_redis(redis_url: str, key_prefix: str, redis_client: MakeClient) -> None:
    await add_key(redis_client(redis_url), key_prefix, RAW, ACME)
    store = build_key_store(
        AuthConfig(enabled=True, backend="redis", redis_url=redis_url, key_prefix=key_prefix)
    )
    try:
        assert isinstance(store, RedisKeyStore)
        assert await store.lookup(RAW) == ACME
    finally:
        await store.close()
