"""One contract for both session stores: the in-memory LRU and the Redis store (real Redis).

The Redis store writes remotely in the background (``pin`` never waits), so the contract
lets a store settle (``flush``) before reading; read-your-writes without settling is a
separate, Redis-specific test below.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from gateway.sessions.store import MemorySessionStore, RedisSessionStore

Factory = Callable[..., MemorySessionStore | RedisSessionStore]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request, redis_url: str, key_prefix: str) -> AsyncIterator[Factory]:
    made: list[MemorySessionStore | RedisSessionStore] = []

    def make(ttl_s: float = 60.0, max_sessions: int = 1000) -> MemorySessionStore | RedisSessionStore:
        local = MemorySessionStore(ttl_s=ttl_s, max_sessions=max_sessions)
        store: MemorySessionStore | RedisSessionStore = local
        if request.param == "redis":
            client = aioredis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
            store = RedisSessionStore(client, local, key_prefix=key_prefix, budget_s=0.5)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def settle(store: MemorySessionStore | RedisSessionStore) -> None:
    if isinstance(store, RedisSessionStore):
        await store.flush()


async def test_unknown_session_is_not_pinned(make_store: Factory) -> None:
    store = make_store()
    assert await store.get("nobody") is None
    assert store.active() == 0


async def test_pin_then_get_and_repin_moves(make_store: Factory) -> None:
    store = make_store()
    assert not inspect.iscoroutinefunction(store.pin), "pin must never wait"
    store.pin("s1", "10.0.0.1:8000")
    store.pin("s2", "10.0.0.2:8000")
    await settle(store)
    assert await store.get("s1") == "10.0.0.1:8000"
    assert await store.get("s2") == "10.0.0.2:8000"
    store.pin("s1", "10.0.0.3:8000")
    await settle(store)
    assert await store.get("s1") == "10.0.0.3:8000"
    assert await store.get("s2") == "10.0.0.2:8000"


async def test_session_ids_are_opaque_strings(make_store: Factory) -> None:
    store = make_store()
    odd = ["a:b", "{braces}", "with space", "ünïcode", "x" * 300]
    for index, session_id in enumerate(odd):
        store.pin(session_id, f"h{index}:1")
    await settle(store)
    for index, session_id in enumerate(odd):
        assert await store.get(session_id) == f"h{index}:1"
    assert await store.get("a") is None and await store.get("b}") is None


async def test_ttl_expires_and_every_pin_refreshes_it(make_store: Factory) -> None:
    store = make_store(ttl_s=0.8)
    store.pin("s", "e:1")
    await settle(store)
    await asyncio.sleep(0.5)
    store.pin("s", "e:1")  # refresh: expiry now 0.8 s from here, not from the first pin
    await settle(store)
    await asyncio.sleep(0.5)  # 1.0 s after the first pin, 0.5 s after the refresh
    assert await store.get("s") == "e:1", "a pin must refresh the TTL"
    await asyncio.sleep(0.6)  # 1.1 s after the refresh
    assert await store.get("s") is None, "the pin must expire after its TTL"


async def test_active_counts_distinct_sessions(make_store: Factory) -> None:
    store = make_store()
    for session_id in ("a", "b", "c"):
        store.pin(session_id, "e:1")
    store.pin("a", "e:2")  # a re-pin is the same session
    await settle(store)
    assert store.active() == 3


async def test_active_does_not_count_expired_sessions(make_store: Factory) -> None:
    """Regression: active() once counted expired pins until something happened to get() them."""
    store = make_store(ttl_s=0.2)
    for session_id in ("a", "b", "c"):
        store.pin(session_id, "e:1")
    await settle(store)
    await asyncio.sleep(0.35)
    assert store.active() == 0


async def test_memory_store_is_a_bounded_lru() -> None:
    """Memory backend only: Redis bounds itself by TTL (its local mirror uses this same class)."""
    store = MemorySessionStore(ttl_s=60.0, max_sessions=3)
    for session_id in ("a", "b", "c"):
        store.pin(session_id, f"{session_id}:1")
    store.pin("a", "a:1")  # used again: now the most recent
    store.pin("d", "d:1")  # over the bound: evicts the least recently pinned, b
    assert store.active() == 3
    assert await store.get("b") is None
    assert [await store.get(s) for s in ("a", "c", "d")] == ["a:1", "c:1", "d:1"]
    for index in range(100):
        store.pin(f"flood-{index}", "x:1")
    assert store.active() == 3


async def test_redis_store_writes_ttl_keys_under_its_prefix(redis_url: str, key_prefix: str) -> None:
    client = aioredis.from_url(redis_url, decode_responses=True)
    store = RedisSessionStore(
        aioredis.from_url(redis_url), MemorySessionStore(5.0, 100), key_prefix=key_prefix, budget_s=0.5
    )
    try:
        store.pin("conv-1", "10.1.1.1:8000")
        await store.flush()
        key = f"{key_prefix}:session:{{conv-1}}"
        assert await client.get(key) == "10.1.1.1:8000"
        assert 0 < await client.pttl(key) <= 5000
        # The Redis copy is authoritative for another instance with an empty local mirror.
        other = RedisSessionStore(
            aioredis.from_url(redis_url), MemorySessionStore(5.0, 100), key_prefix=key_prefix, budget_s=0.5
        )
        assert await other.get("conv-1") == "10.1.1.1:8000"
        await other.close()
    finally:
        await store.close()
        await client.aclose()


async def test_redis_store_reads_its_own_writes(redis_url: str, key_prefix: str) -> None:
    """Regression: a Redis miss (the background SET not landed yet) once beat the local pin."""
    store = RedisSessionStore(
        aioredis.from_url(redis_url), MemorySessionStore(5.0, 100), key_prefix=key_prefix, budget_s=0.5
    )
    try:
        assert await store.get("warm-up") is None  # a pooled connection: the GET goes out at once
        for index in range(20):
            store.pin(f"conv-ryw-{index}", f"10.2.2.{index}:8000")
            assert await store.get(f"conv-ryw-{index}") == f"10.2.2.{index}:8000"
    finally:
        await store.close()


async def test_redis_store_keeps_outage_pins_after_redis_returns(redis_servers) -> None:
    """Regression: pins made during an outage were dropped once an empty Redis answered again."""
    server = redis_servers()
    store = RedisSessionStore(
        aioredis.from_url(server.url, socket_connect_timeout=0.3, socket_timeout=0.3),
        MemorySessionStore(30.0, 100),
        key_prefix="outage",
        budget_s=0.3,
        retry_after_s=0.2,
    )
    try:
        port = server.port
        server.kill()
        assert await store.get("during") is None  # fails over to the local mirror
        store.pin("during", "10.3.3.3:8000")
        await store.flush()
        assert await store.get("during") == "10.3.3.3:8000"  # still served locally
        redis_servers(port)  # Redis is back (empty, as after a restart)
        await asyncio.sleep(0.3)  # past retry_after_s: the store asks Redis again
        assert await store.get("during") == "10.3.3.3:8000"
    finally:
        await store.close()
