"""Every Redis backend on a real Redis Cluster (3 masters + 3 replicas on loopback ports).

The prefix index, session pins, API keys and rate limits are built by the one factory
(:func:`gateway.redis_client.redis_client`) from a ``?cluster=true`` URL. Their keys and
scripts stay in one slot each (a cross-slot command would fail with CROSSSLOT here), two
gateways share state through the cluster, and a master killed mid-run fails over to its
replica with zero 5xx: the guards answer locally until the client has re-learnt the map.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from gateway.auth.redis_keys import RedisKeyStore, add_key, apikey_key, tenant_key
from gateway.auth.redis_limits import RedisRateLimiter, bucket_key
from gateway.auth.tenant import Tenant
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.prefix.redis import RedisPrefixIndex, endpoint_key
from gateway.redis_client import cluster_seeds, is_cluster_url, redis_client, redis_ports
from gateway.request.parse import session_key, tenant_session_key
from gateway.sessions.store import MemorySessionStore, RedisSessionStore
from loadtest.harness.redis_cluster import RedisCluster
from tests.deploy.live_fleet import KEY_OK, Load, Replica, tenant_request
from tests.support.harness import running_gateway

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server/redis-cli missing under CI: .ci/run installs redis-server")
        pytest.skip("redis-server not installed")
    started = RedisCluster(masters=3, replicas=1).start()
    try:
        yield started
    finally:
        started.stop()


def test_the_factory_reads_cluster_urls() -> None:
    url = "redis://10.0.0.1:7000?cluster=true&nodes=10.0.0.2:7001,10.0.0.3"
    assert is_cluster_url(url) and not is_cluster_url("redis://h:6379/0")
    assert cluster_seeds(url) == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379)]
    assert redis_ports(url) == {7000, 7001, 6379} and redis_ports("redis://h:6380/0") == {6380}
    assert isinstance(redis_client(url), ClusterClient)
    assert isinstance(redis_client("redis://h:6379/0"), aioredis.Redis)
    with pytest.raises(ValueError, match="database 0"):
        redis_client("redis://h:7000/3?cluster=true")


def test_every_backend_key_of_one_call_shares_a_slot() -> None:
    """The multi-key script (prefix match over every endpoint) and the per-tenant keys: one slot."""
    endpoints = [f"10.0.{i}.{j}:8000" for i in range(4) for j in range(25)]
    for model in ("llama-3-8b", "m", "qwen/Qwen2.5-7B"):
        assert len({key_slot(endpoint_key("gw", model, e).encode()) for e in endpoints}) == 1
    slots = {key_slot(endpoint_key("gw", m, "e:1").encode()) for m in ("a", "b", "c", "d")}
    assert len(slots) > 1  # … and models spread over the cluster
    # Single-key commands everywhere else (hash tags keep a tenant's bucket on its own slot).
    for key in (bucket_key("gw", "acme"), apikey_key("gw", "ab" * 32), tenant_key("gw", "acme")):
        assert isinstance(key_slot(key.encode()), int)


async def test_every_backend_works_on_the_cluster(cluster: RedisCluster) -> None:
    prefix = "t" + str(time.monotonic_ns())
    index = RedisPrefixIndex(
        await ready(cluster.url), MemoryPrefixIndex(default_capacity=1000, ttl_s=60),
        key_prefix=prefix, budget_s=1.0,
    )  # fmt: skip
    other = RedisPrefixIndex(
        await ready(cluster.url), MemoryPrefixIndex(default_capacity=1000, ttl_s=60),
        key_prefix=prefix, budget_s=1.0,
    )  # fmt: skip
    endpoints = [f"127.0.0.1:{9000 + i}" for i in range(40)]
    for model in ("a", "b", "c", "d"):
        index.record([1, 2, 3, 4], endpoints[7], model)
    await index.flush()
    for model in ("a", "b", "c", "d"):  # the other instance sees them: shared through the cluster
        assert (await other.match([1, 2, 3, 9], endpoints, model))[endpoints[7]] == 3
    index.set_capacity(endpoints[7], 2)
    await index.flush()
    await index.purge(endpoints[7])  # DEL over four models' slots: split per slot by the client
    assert (await other.match([1, 2, 3], endpoints, "b"))[endpoints[7]] == 0

    sessions = RedisSessionStore(
        await ready(cluster.url), MemorySessionStore(60, 100), key_prefix=prefix, budget_s=1.0
    )
    sessions_b = RedisSessionStore(
        await ready(cluster.url), MemorySessionStore(60, 100), key_prefix=prefix, budget_s=1.0
    )
    for i in range(20):  # session ids spread over every master
        sessions.pin(f"s-{i}", f"e-{i}")
    await sessions.flush()
    assert [await sessions_b.get(f"s-{i}") for i in range(20)] == [f"e-{i}" for i in range(20)]

    admin = await ready(cluster.url)
    await add_key(admin, prefix, "sk-1", Tenant("acme", requests_per_minute=2, tokens_per_minute=10**6))
    keys = RedisKeyStore(await ready(cluster.url), key_prefix=prefix, budget_s=1.0)
    tenant = await keys.lookup("sk-1")
    assert tenant is not None and tenant.name == "acme" and await keys.lookup("sk-2") is None

    limits = RedisRateLimiter(await ready(cluster.url), key_prefix=prefix, budget_s=1.0)
    limits_b = RedisRateLimiter(await ready(cluster.url), key_prefix=prefix, budget_s=1.0)
    assert (await limits.acquire(tenant, 10)).allowed and (await limits_b.acquire(tenant, 10)).allowed
    assert not (await limits.acquire(tenant, 10)).allowed  # the two instances share the bucket
    await limits.settle(tenant, 10, 3)
    await admin.script_flush()  # a NOSCRIPT (as after a failover) is answered by EVAL
    assert not (await limits_b.acquire(tenant, 10)).allowed
    for closable in (index, other, sessions, sessions_b, keys, limits, limits_b):
        await closable.close()
    await admin.aclose()


async def test_two_gateways_share_the_cluster_through_a_master_failover(
    cluster: RedisCluster, http, stack, tmp_path: Path
) -> None:
    prefix = "gw" + str(time.monotonic_ns())
    admin = await ready(cluster.url)
    stack.push_async_callback(admin.aclose)
    await add_key(admin, prefix, KEY_OK, Tenant("ok", requests_per_minute=10**5, tokens_per_minute=10**9))
    await add_key(admin, prefix, "sk-live-tiny", Tenant("tiny", requests_per_minute=1))
    shared = {"backend": "redis", "redis_url": cluster.url, "key_prefix": prefix, "redis_budget_s": 0.1}
    auth = {"enabled": True, "backend": "redis", "limits_backend": "redis", "redis_url": cluster.url,
            "key_prefix": prefix, "redis_budget_s": 0.1}  # fmt: skip
    replicas = [await Replica().start(), await Replica().start()]
    for r in replicas:
        stack.push_async_callback(r.stop)
    gateways = []
    for _ in range(2):
        gw = await stack.enter_async_context(
            running_gateway(
                [r.url for r in replicas], policy="session-aware", prefix=shared, sessions=shared, auth=auth
            )
        )
        gateways.append(gw)

    async def shared_pin(session: str) -> tuple[str | None, str | None]:
        """Pin through gateway A, read through gateway B."""
        headers = {"x-session-id": session, "authorization": f"Bearer {KEY_OK}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(gateways[0].url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:  # 503 while warming up: an uncached key, the key store not ready
                return None, "not answered"
            pinned = resp.headers.get("x-gateway-endpoint")
        await gateways[0].state.sessions.store.flush()
        return pinned, await gateways[1].state.sessions.store.get(
            tenant_session_key("ok", session_key(session))
        )

    # Warm-up: each client learns the slot map in the background; until then the guards answer locally.
    began = time.monotonic()
    while (pin := await shared_pin(f"before-{time.monotonic_ns()}"))[0] != pin[1]:
        assert time.monotonic() - began < 10, "the gateways never shared a session pin"
        await asyncio.sleep(0.2)
    for gw in gateways:  # every key the load uses, cached by both gateways' key stores
        for key in (KEY_OK, "sk-live-tiny", "sk-not-a-key"):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            while True:
                headers = {"authorization": f"Bearer {key}"}
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                    if resp.status != 503:
                        break
                assert time.monotonic() - began < 15, "a key store never answered"
                await asyncio.sleep(0.2)
    warm_after = time.monotonic() - began
    loads = [Load(http, gw.url, request=tenant_request).start() for gw in gateways]
    for load in loads:
        stack.push_async_callback(load.stop)
    await asyncio.sleep(2.0)

    # Kill the master serving the model's prefix keys (and some sessions' and buckets').
    victim = cluster.master_of(endpoint_key(prefix, "m", "x"))
    assert victim is not None
    for load in loads:
        load.phase = "failover"
    killed_at = time.monotonic()
    cluster.kill(victim)
    promoted_after = None
    last_fallback = 0.0
    seen_fallbacks = await fallbacks(http, gateways[0].url)
    while time.monotonic() - killed_at < 40:
        now = time.monotonic() - killed_at
        if promoted_after is None and cluster.master_of(endpoint_key(prefix, "m", "x")) not in (None, victim):
            promoted_after = now
        count = await fallbacks(http, gateways[0].url)
        if count != seen_fallbacks:
            seen_fallbacks, last_fallback = count, now
        if promoted_after is not None and now - max(last_fallback, promoted_after) > 4.0:
            break
        await asyncio.sleep(0.2)
    pinned, seen = await shared_pin("after")
    for load in loads:
        load.phase = "after"
    await asyncio.sleep(2.0)
    assert promoted_after is not None, "no replica took over the killed master's slots within 40 s"
    print(f"cluster clients shared state {warm_after:.2f}s after start; "
          f"failover: replica promoted after {promoted_after:.2f}s; last Redis fallback at "
          f"{last_fallback:.2f}s; statuses {[dict(load.statuses) for load in loads]}")  # fmt: skip
    assert promoted_after is not None and pinned == seen
    for load in loads:
        assert load.count(500, 600) == 0, load.statuses  # before, during and after the failover
        assert load.count(200, 300, "failover") > 0 and load.count(200, 300, "after") > 0


async def ready(url: str) -> ClusterClient:
    """A cluster client that has learnt the slot map (a fresh one takes ~0.5-2 s on a busy box).

    Socket deadlines are the production default's ×5: on a loaded host the reply to the
    cluster client's ``COMMAND`` (all of Redis' command table) once took over 1 s and the
    test failed before it began; what these tests time is the gateway's budget, not this."""
    client = redis_client(url, socket_connect_timeout=2.5, socket_timeout=5.0)
    assert isinstance(client, ClusterClient)
    await client.initialize()
    return client


async def fallbacks(http, url: str) -> float:
    """Every Redis fallback the gateway counted (prefix, sessions, rate limits, keys)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    names = tuple(
        f"llm_gateway_{name}_fallbacks_total"
        for name in ("redis", "session_store", "rate_limit", "auth_key_store")
    )
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))
