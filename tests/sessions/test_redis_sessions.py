"""Redis-backed sessions end to end: gateways share pins; a Redis outage never fails a request."""

from __future__ import annotations

import asyncio
import os
import signal

import redis.asyncio as aioredis

from gateway.request.parse import session_key
from gateway.sessions.responses import MemoryResponseStore, RedisResponseStore, ResponseRecord
from gateway.sessions.store import MemorySessionStore, RedisSessionStore
from tests.sessions.conftest import started_gateway, turn
from tests.support.harness import chat_body, gateway_metrics, metric_value, wait_until

SESSIONS = 6


async def test_two_gateways_sharing_redis_keep_a_session_on_one_replica(
    redis_url: str, key_prefix: str, start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    urls = [s.url for s in sims]
    cfg = {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "redis_budget_s": 0.5}
    gw_a = await started_gateway(start_gateway, urls, **cfg)
    gw_b = await started_gateway(start_gateway, urls, **cfg)
    client_a, client_b = openai_client(gw_a), openai_client(gw_b)
    ids = [f"shared-{i}" for i in range(SESSIONS)]

    pinned = {sid: (await turn(client_a, headers={"x-session-id": sid}))[0] for sid in ids}
    redis = aioredis.from_url(redis_url, decode_responses=True)
    try:

        async def all_written() -> bool:
            values = [await redis.get(f"{key_prefix}:session:{{{session_key(sid)}}}") for sid in ids]
            return values == [pinned[sid] for sid in ids]

        await wait_until(all_written, 3.0, "gateway A's pins to reach Redis")
        # Turns alternate between the two gateways; B has never seen these sessions locally.
        for round_ in range(4):
            client = client_b if round_ % 2 == 0 else client_a
            for sid in ids:
                assert (await turn(client, headers={"x-session-id": sid}))[0] == pinned[sid], sid
    finally:
        await redis.aclose()

    for gw in (gw_a, gw_b):
        text = await gateway_metrics(http, gw)
        assert metric_value(text, "llm_gateway_session_hits_total") == 2 * SESSIONS
        assert (metric_value(text, "llm_gateway_session_moves_total") or 0) == 0
        assert (metric_value(text, "llm_gateway_session_store_fallbacks_total") or 0) == 0


async def test_redis_down_sessions_still_served_from_the_local_mirror(
    redis_servers, start_sims, start_gateway, openai_client, http
) -> None:
    server = redis_servers()  # private: this test kills it by PID
    sims = await start_sims(3)
    gw = await started_gateway(
        start_gateway,
        [s.url for s in sims],
        backend="redis",
        redis_url=server.url,
        key_prefix="down",
        redis_budget_s=0.5,
    )
    client = openai_client(gw)
    ids = [f"survivor-{i}" for i in range(4)]
    pinned = {sid: (await turn(client, headers={"x-session-id": sid}))[0] for sid in ids}
    text = await gateway_metrics(http, gw)
    assert (metric_value(text, "llm_gateway_session_store_fallbacks_total") or 0) == 0

    server.kill()
    for _ in range(3):
        for sid in ids:  # every turn is answered (200 via the SDK) and stays on its replica
            assert (await turn(client, headers={"x-session-id": sid}))[0] == pinned[sid]
    # New sessions are still served (and pinned locally) while Redis is gone.
    fresh, _ = await turn(client, headers={"x-session-id": "born-during-outage"})
    assert (await turn(client, headers={"x-session-id": "born-during-outage"}))[0] == fresh

    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_store_fallbacks_total") >= 1
    assert metric_value(text, "llm_gateway_session_store_fallbacks_total", reason="error") >= 1
    assert metric_value(text, "llm_gateway_session_hits_total") == 3 * len(ids) + 1
    assert (metric_value(text, "llm_gateway_session_moves_total") or 0) == 0


async def test_a_session_moved_while_redis_paused_is_not_sent_back_by_its_old_redis_pin(
    redis_servers, start_upstream, start_gateway, http
) -> None:
    """The move's write is dropped while the guard skips Redis (a second after one slow call); the
    old pin stayed in Redis and, read back once Redis answered again, sent the session back to the
    replica it had left. The move is now kept locally until its write lands, and rewritten."""
    server = redis_servers()
    a, b = await start_upstream(), await start_upstream()
    gw = await started_gateway(
        start_gateway, [a.url, b.url], backend="redis", redis_url=server.url, key_prefix="hiccup"
    )

    async def send(session: str) -> str:
        headers = {"x-session-id": session}
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers) as resp:
            assert resp.status == 200
            return resp.headers["x-gateway-endpoint"]

    first = await send("conv")
    await gw.state.sessions.store.flush()
    old, new = (a, b) if first == a.name else (b, a)
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # one slow call opens the guard's skip window
    try:
        await send("someone-else")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    old.mode, old.status = "status", 500  # within the window, the pinned replica fails once
    assert await send("conv") == new.name  # retried there, and re-pinned there
    old.mode = "ok"
    await asyncio.sleep(1.2)  # the window is over: Redis answers again
    assert [await send("conv") for _ in range(3)] == [new.name] * 3

    redis = aioredis.from_url(server.url, decode_responses=True)
    try:

        async def rewritten() -> bool:
            await send("conv")  # a lookup lets the mirror rewrite what did not reach Redis
            return await redis.get(f"hiccup:session:{{{session_key('conv')}}}") == new.name

        await wait_until(rewritten, 3.0, "the move's pin to be rewritten to Redis")
    finally:
        await redis.aclose()


async def test_a_change_redis_missed_never_overwrites_another_instances_later_one(redis_servers) -> None:
    """Instance A pins a session while Redis is paused (its write is lost); once Redis is back,
    instance B pins it elsewhere. A must take B's pin, and its rewrite of the lost change must
    not put its older pin back over B's."""
    server = redis_servers()
    assert server.proc is not None

    def instance() -> RedisSessionStore:
        local = MemorySessionStore(600.0, 1000)
        return RedisSessionStore(
            aioredis.from_url(server.url), local, key_prefix="two", budget_s=0.05, retry_after_s=0.3
        )

    a, b = instance(), instance()
    raw = aioredis.from_url(server.url)
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            a.pin("s", "r1")
            await a.flush()  # the write timed out
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.4)  # Redis is back
        assert await b.get("s") is None
        b.pin("s", "r2")
        await b.flush()
        assert await a.get("s") == "r2"  # B's later pin, not A's lost one
        await asyncio.sleep(0.4)
        await a.get("another")  # a lookup lets A rewrite what it lost: not over B's pin
        await a.flush()
        assert await raw.get("two:session:{s}") == b"r2"
        assert await b.get("s") == "r2"
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


async def test_a_record_stored_while_redis_was_away_reaches_it_even_if_read_back_first(redis_servers) -> None:
    """Stored in the guard's skip window (its write dropped), then read back by this instance once
    Redis answered (no such key there): the read took the absent key for another instance's
    write and dropped the change, so no other instance ever learned the record."""
    server = redis_servers()
    assert server.proc is not None
    store = RedisResponseStore(
        aioredis.from_url(server.url), MemoryResponseStore(600.0, 1000), key_prefix="lost",
        budget_s=0.05, retry_after_s=0.3,
    )  # fmt: skip
    raw = aioredis.from_url(server.url)
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            await store.get("warm-up")  # times out: the guard skips Redis for 0.3 s
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.15)
        store.put("resp_1", ResponseRecord("replica-a", "chain-1", None))  # in the window: dropped
        await asyncio.sleep(0.17)
        await store.get("other")  # the window is over: a rewrite pass, resp_1 not yet due in it
        await asyncio.sleep(0.17)  # resp_1 is past the window now, the next pass not yet due
        assert (await store.get("resp_1")) == ResponseRecord("replica-a", "chain-1", None)
        await asyncio.sleep(0.35)  # older than the window: rewritten at the next lookup

        async def landed() -> bool:
            await store.get("other")
            await store.flush()
            return await raw.get("lost:response:{resp_1}") is not None

        await wait_until(landed, 3.0, "the record to be rewritten to Redis")
    finally:
        await raw.aclose()
        await store.close()
