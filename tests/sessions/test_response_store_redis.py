"""The Redis response store against a real Redis (127.0.0.1:6379, or a private
``redis-server``; under ``CI=true`` a missing Redis fails): one contract with the memory
store, the key format and TTL, a second instance reading what the first wrote, Redis
down → the local mirror, and two gateways sharing it so that a ``previous_response_id``
chain started through one continues through the other on the replica that stored it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from gateway.sessions.responses import MemoryResponseStore, RedisResponseStore, ResponseRecord
from gateway.sessions.store import MemorySessionStore, RedisSessionStore
from tests.sessions.conftest import MODEL
from tests.support.harness import gateway_metrics, metric_value

Store = MemoryResponseStore | RedisResponseStore


def _client(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)


def _redis_store(redis_url: str, key_prefix: str) -> RedisResponseStore:
    local = MemoryResponseStore(ttl_s=30, max_entries=10)
    return RedisResponseStore(_client(redis_url), local, key_prefix=key_prefix, budget_s=0.5)


@pytest.fixture(params=["memory", "redis"])
async def make_store(request, redis_url: str, key_prefix: str) -> AsyncIterator[Callable[..., Store]]:
    made: list[Store] = []

    def make(ttl_s: float = 60.0, max_entries: int = 100) -> Store:
        local = MemoryResponseStore(ttl_s=ttl_s, max_entries=max_entries)
        store: Store = local
        if request.param == "redis":
            store = RedisResponseStore(_client(redis_url), local, key_prefix=key_prefix, budget_s=0.5)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def settle(store: Store) -> None:
    if isinstance(store, RedisResponseStore):
        await store.flush()


async def test_contract_put_get_forget(make_store) -> None:
    store = make_store()
    assert await store.get("resp_none") is None
    store.put("resp_a", ResponseRecord("10.0.0.1:8000", "chain-a"))
    store.put("resp_b", ResponseRecord("10.0.0.2:8000", "chain-a"))
    await settle(store)
    assert await store.get("resp_a") == ResponseRecord("10.0.0.1:8000", "chain-a")
    assert await store.get("resp_b") == ResponseRecord("10.0.0.2:8000", "chain-a")
    store.forget("resp_a")
    await settle(store)
    assert await store.get("resp_a") is None
    assert await store.get("resp_b") is not None


async def test_contract_the_tenant_is_kept(make_store) -> None:
    store = make_store()
    store.put("resp_t", ResponseRecord("10.0.0.1:8000", "chain-t", tenant="acme"))
    store.put("resp_none", ResponseRecord("10.0.0.1:8000", "chain-t"))
    await settle(store)
    assert await store.get("resp_t") == ResponseRecord("10.0.0.1:8000", "chain-t", "acme")
    assert (await store.get("resp_none")).tenant is None


async def test_contract_entries_expire(make_store) -> None:
    store = make_store(ttl_s=0.2)
    store.put("resp_short", ResponseRecord("r", "c"))
    await settle(store)
    assert await store.get("resp_short") is not None
    await asyncio.sleep(0.35)
    assert await store.get("resp_short") is None  # gone locally and (PX) in Redis


async def test_the_redis_keys_their_value_and_ttl(redis_url: str, key_prefix: str) -> None:
    store = _redis_store(redis_url, key_prefix)
    raw = _client(redis_url)
    try:
        store.put("resp_k", ResponseRecord("10.0.0.9:8000", "chain-k"))
        await store.flush()
        key = f"{key_prefix}:response:{{resp_k}}"  # a Redis Cluster hash tag around the id
        assert json.loads(await raw.get(key)) == {"e": "10.0.0.9:8000", "c": "chain-k"}
        assert 29_000 < await raw.pttl(key) <= 30_000
    finally:
        await raw.aclose()
        await store.close()


async def test_the_tenant_in_redis_and_a_legacy_value_without_one(redis_url: str, key_prefix: str) -> None:
    """``"t"`` names the tenant; a value written before tenants were recorded still loads (no
    tenant), read by an instance that has no local copy; a damaged ``"t"`` is never a tenant."""
    writer, reader = _redis_store(redis_url, key_prefix), _redis_store(redis_url, key_prefix)
    raw = _client(redis_url)
    try:
        writer.put("resp_t", ResponseRecord("10.0.0.9:8000", "chain-t", "acme"))
        await writer.flush()
        key = f"{key_prefix}:response:{{resp_t}}"
        assert json.loads(await raw.get(key)) == {"e": "10.0.0.9:8000", "c": "chain-t", "t": "acme"}
        assert await reader.get("resp_t") == ResponseRecord("10.0.0.9:8000", "chain-t", "acme")
        legacy = f"{key_prefix}:response:{{resp_old}}"
        await raw.set(legacy, json.dumps({"e": "10.0.0.9:8000", "c": "chain-o"}), px=30_000)
        assert await reader.get("resp_old") == ResponseRecord("10.0.0.9:8000", "chain-o", None)
        await raw.set(key, json.dumps({"e": "10.0.0.9:8000", "c": "chain-t", "t": 7}), px=30_000)
        assert await reader.get("resp_t") is None  # unreadable, and no local copy to fall back on
        assert await writer.get("resp_t") == ResponseRecord("10.0.0.9:8000", "chain-t", "acme")
    finally:
        await raw.aclose()
        await writer.close()
        await reader.close()


async def test_a_second_instance_reads_what_the_first_wrote(redis_url: str, key_prefix: str) -> None:
    writer, reader = _redis_store(redis_url, key_prefix), _redis_store(redis_url, key_prefix)
    try:
        writer.put("resp_shared", ResponseRecord("10.0.0.5:8000", "chain-s"))
        await writer.flush()
        assert len(reader.local) == 0
        assert await reader.get("resp_shared") == ResponseRecord("10.0.0.5:8000", "chain-s")
        writer.forget("resp_shared")
        await writer.flush()
        assert await reader.get("resp_shared") is None
    finally:
        await writer.close()
        await reader.close()


async def test_an_unreadable_value_falls_back_to_the_local_copy(redis_url: str, key_prefix: str) -> None:
    store = _redis_store(redis_url, key_prefix)
    raw = _client(redis_url)
    try:
        store.put("resp_bad", ResponseRecord("local:1", "c"))
        await store.flush()
        await raw.set(f"{key_prefix}:response:{{resp_bad}}", b"not json")
        assert await store.get("resp_bad") == ResponseRecord("local:1", "c")
    finally:
        await raw.aclose()
        await store.close()


async def test_redis_down_answers_from_the_local_mirror(redis_servers) -> None:
    server = redis_servers()
    fallbacks: list[str] = []
    store = RedisResponseStore(
        _client(server.url),
        MemoryResponseStore(ttl_s=30, max_entries=10),
        key_prefix="down",
        budget_s=0.2,
        on_fallback=fallbacks.append,
    )
    try:
        store.put("resp_before", ResponseRecord("r1", "c1"))
        await store.flush()
        server.kill()
        assert await store.get("resp_before") == ResponseRecord("r1", "c1")
        store.put("resp_during", ResponseRecord("r2", "c2"))  # never waits, never raises
        assert await store.get("resp_during") == ResponseRecord("r2", "c2")
        assert fallbacks
    finally:
        await store.close()


async def test_session_and_response_stores_share_one_redis_implementation(
    redis_url: str, key_prefix: str
) -> None:
    """Both stores write through the same mirror: same key shape, same TTL handling."""
    sessions = RedisSessionStore(
        _client(redis_url), MemorySessionStore(ttl_s=30, max_sessions=10), key_prefix=key_prefix, budget_s=0.5
    )
    responses = _redis_store(redis_url, key_prefix)
    raw = _client(redis_url)
    try:
        assert type(sessions._redis) is type(responses._redis)
        sessions.pin("sess-1", "10.0.0.1:8000")
        responses.put("resp_1", ResponseRecord("10.0.0.1:8000", "sess-1"))
        await sessions.flush()
        await responses.flush()
        assert await raw.get(f"{key_prefix}:session:{{sess-1}}") == b"10.0.0.1:8000"
        assert await raw.exists(f"{key_prefix}:response:{{resp_1}}") == 1
    finally:
        await raw.aclose()
        await sessions.close()
        await responses.close()


async def test_two_gateways_sharing_redis_continue_a_chain_on_its_replica(
    redis_url: str, key_prefix: str, start_sims, start_gateway, http
) -> None:
    """Plain HTTP, not the SDK: the client shares the gateways' event loop here, and the SDK's
    first parse of a Response blocks it for ~0.5 s, which times a gateway's Redis connect out."""
    sims = await start_sims(3)
    urls = [s.url for s in sims]
    cfg = {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "redis_budget_s": 0.5}
    # Probes that only a dead replica fails (a loaded CI box must not mark live ones down).
    health = {"interval_s": 1.0, "timeout_s": 2.0, "unhealthy_threshold": 3}
    gw_a = await start_gateway(urls, policy="round-robin", sessions=cfg, health=health)
    gw_b = await start_gateway(urls, policy="round-robin", sessions=cfg, health=health)

    async def create(gw, **body) -> tuple[str, str]:
        async with http.post(
            gw.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **body}
        ) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["id"], resp.headers["x-gateway-endpoint"]

    previous, stored_on = await create(gw_a, input="start")
    await gw_a.state.sessions.responses.flush()
    redis = _client(redis_url)
    try:
        assert await redis.exists(f"{key_prefix}:response:{{{previous}}}") == 1
    finally:
        await redis.aclose()
    for step in range(4):  # alternate: B first, which has never seen the chain locally
        gw = (gw_b, gw_a)[step % 2]
        response_id, served_by = await create(gw, input=f"step {step}", previous_response_id=previous)
        assert served_by == stored_on, step
        if step == 0:  # B found A's record in Redis (a probe of the replicas would have kept it locally)
            assert gw_b.state.sessions.responses.local.get_now(previous) is None
        await gw.state.sessions.responses.flush()  # the other gateway reads the new record from Redis
        previous = response_id
    async with http.get(f"{gw_b.url}/v1/responses/{previous}") as resp:
        assert resp.status == 200 and resp.headers["x-gateway-endpoint"] == stored_on
    for gw in (gw_a, gw_b):
        text = await gateway_metrics(http, gw)
        assert (metric_value(text, "llm_gateway_session_store_fallbacks_total") or 0) == 0
