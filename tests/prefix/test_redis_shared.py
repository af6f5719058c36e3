"""The Redis-backed index shared by gateway instances: cross-instance affinity, warm restarts, outages.

Every gateway here runs in-process on its own port against real simulators and a real
Redis. The match budget is raised from the production 5 ms to 250 ms so a busy CI
machine does not turn a Redis answer into a (correct, but here confusing) local fallback;
the tests then assert that no fallback happened wherever Redis is supposed to answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp
import openai
import redis.asyncio as aioredis

from gateway.prefix.hashing import block_hashes
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.prefix.redis import RedisPrefixIndex
from gateway.request.prompt import canonical_chat_prompt
from tests.prefix.conftest import GatewayProcessless, RedisServer, gateway_config, scan_keys
from tests.support.harness import metric_value

MODEL = "sim-llama"


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}w{i}" for i in range(n))


def redis_prefix(redis_url: str, key_prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "redis",
        "redis_url": redis_url,
        "key_prefix": key_prefix,
        "redis_budget_s": 0.25,
        **extra,
    }


def client_for(gw: GatewayProcessless) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test", max_retries=0, timeout=15)


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> tuple[str, Any]:
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
    assert raw.status_code == 200
    return raw.headers["x-gateway-endpoint"], raw.parse()


async def fallbacks(http: aiohttp.ClientSession, gw: GatewayProcessless) -> float:
    async with http.get(gw.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return metric_value(text, "llm_gateway_redis_fallbacks_total") or 0.0


def conversation(c: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Agent {c}. " + words(f"sys{c}-", 200)},
        {"role": "user", "content": f"first question of {c}: " + words(f"q{c}-", 20)},
    ]


def continued(messages: list[dict[str, str]], reply: Any, c: int) -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": f"follow-up of {c}: " + words(f"f{c}-", 20)},
    ]


async def test_two_gateways_share_conversation_affinity(
    start_sims, start_gateway, http, redis_url, key_prefix
):
    sims = await start_sims(3)
    config = gateway_config([s.url for s in sims], prefix=redis_prefix(redis_url, key_prefix))
    gw_a = await start_gateway(config)
    gw_b = await start_gateway(config)
    a, b = client_for(gw_a), client_for(gw_b)
    try:
        homes = set()
        for c in range(6):  # each conversation starts on one gateway and continues on the other
            first_gw, second_gw = ((gw_a, a), (gw_b, b)) if c % 2 == 0 else ((gw_b, b), (gw_a, a))
            messages = conversation(c)
            home, reply = await chat(first_gw[1], messages)
            follow_up = continued(messages, reply, c)
            # the second gateway has never seen this conversation: only Redis can tell it
            assert second_gw[0].gateway is not None
            local = second_gw[0].gateway.state.prefix.index.local
            hashes = block_hashes(MODEL, canonical_chat_prompt(follow_up))
            assert local.match_now(hashes, [home]) == {home: 0}
            endpoint, resp = await chat(second_gw[1], follow_up)
            assert endpoint == home, f"conversation {c}: {home} via one gateway, {endpoint} via the other"
            assert resp.usage.prompt_tokens_details.cached_tokens >= 200
            homes.add(home)
        assert await fallbacks(http, gw_a) == 0
        assert await fallbacks(http, gw_b) == 0
        keys = scan_keys(redis_url, key_prefix)
        assert keys and all(k.startswith(f"{key_prefix}:{{{MODEL}}}:ep:") for k in keys)
        assert {k.rsplit(":ep:", 1)[1] for k in keys} == homes
    finally:
        await a.close()
        await b.close()


async def test_restarted_gateway_routes_warm(start_sims, start_gateway, http, redis_url, key_prefix):
    sims = await start_sims(3)
    config = gateway_config([s.url for s in sims], prefix=redis_prefix(redis_url, key_prefix))
    gw = await start_gateway(config)
    client = client_for(gw)
    started: list[tuple[list[dict[str, str]], Any, str]] = []
    try:
        for c in range(5):
            messages = conversation(c)
            home, reply = await chat(client, messages)
            started.append((messages, reply, home))
    finally:
        await client.close()

    await gw.stop()
    await gw.start()  # a new app, same config and port: an empty local index
    assert gw.gateway is not None
    state = gw.gateway.state
    assert all(state.prefix.index.size(s.url.split("://", 1)[1]) == 0 for s in sims)
    client = client_for(gw)
    try:
        for c, (messages, reply, home) in enumerate(started):
            endpoint, resp = await chat(client, continued(messages, reply, c))
            assert endpoint == home, f"conversation {c} went cold after the restart"
            assert resp.usage.prompt_tokens_details.cached_tokens >= 200
        assert await fallbacks(http, gw) == 0
    finally:
        await client.close()


async def test_redis_outage_falls_back_and_recovers(
    start_sims, start_gateway, http, redis_servers, key_prefix
):
    own: RedisServer = redis_servers()
    retry_after = 0.3
    sims = await start_sims(3)
    config = gateway_config(
        [s.url for s in sims],
        prefix=redis_prefix(own.url, key_prefix, redis_retry_after_s=retry_after),
    )
    gw = await start_gateway(config)
    client = client_for(gw)
    loop = asyncio.get_running_loop()
    try:
        # 1. Redis up: requests are matched in Redis, keys appear, no fallback.
        before_outage = []
        for c in range(3):
            messages = conversation(c)
            home, reply = await chat(client, messages)
            before_outage.append((messages, reply, home))
        assert scan_keys(own.url, key_prefix)
        assert await fallbacks(http, gw) == 0

        # 2. Redis killed: every request still succeeds, answered from the local mirror.
        own.kill()
        for c, (messages, reply, home) in enumerate(before_outage):
            endpoint, _ = await asyncio.wait_for(chat(client, continued(messages, reply, c)), 5)
            assert endpoint == home, "the local mirror should keep affinity while Redis is down"
        for c in range(10, 14):
            await asyncio.wait_for(chat(client, conversation(c)), 5)
        during = await fallbacks(http, gw)
        assert during > 0

        # 3. Redis back on the same port (empty): after retry_after_s, Redis is used again.
        restarted = RedisServer(own.port).start()
        own.proc, restarted.proc = restarted.proc, None  # the fixture kills it by PID at teardown
        deadline = loop.time() + 8
        recovered = False
        c = 100
        while loop.time() < deadline and not recovered:
            await asyncio.sleep(retry_after + 0.05)
            settled = await fallbacks(http, gw)
            for _ in range(3):
                c += 1
                await chat(client, conversation(c))
            await asyncio.sleep(0.05)  # background writes
            recovered = await fallbacks(http, gw) == settled and bool(scan_keys(own.url, key_prefix))
        assert recovered, "fallbacks kept increasing (or no key was written) after Redis came back"
        assert await fallbacks(http, gw) >= during
        # a conversation started after recovery is readable from the new Redis by key
        keys = scan_keys(own.url, key_prefix)
        assert all(k.startswith(f"{key_prefix}:{{{MODEL}}}:ep:") for k in keys)
    finally:
        await client.close()


async def test_a_purge_redis_missed_is_retried_and_its_stale_blocks_never_count(redis_servers) -> None:
    """A replica purged (down or restarted: its cache is gone) while Redis was paused kept its blocks
    in Redis for up to the TTL, and a restarted, empty replica was predicted a full hit. The purge
    is remembered: the stale remote count is ignored until it lands, then it is retried, and what
    was recorded after the purge survives the retry."""
    server = redis_servers()
    assert server.proc is not None
    old, fresh = list(range(1, 41)), list(range(100, 121))

    def index(budget_s: float) -> RedisPrefixIndex:
        return RedisPrefixIndex(
            aioredis.from_url(server.url), MemoryPrefixIndex(), key_prefix="purge", budget_s=budget_s
        )

    gateway, other = index(0.05), index(1.0)  # other: a second instance, nothing of its own
    try:
        gateway.record(old, "a", MODEL)
        await gateway.flush()
        assert await other.match(old, ["a"], MODEL) == {"a": 40}

        os.kill(server.proc.pid, signal.SIGSTOP)  # Redis pauses: one slow call, then the skip window
        try:
            assert await gateway.match(old, ["a"], MODEL) == {"a": 40}  # answered locally
            await gateway.purge("a", [MODEL])  # the replica restarted: skipped, not reaching Redis
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await other.match(old, ["a"], MODEL) == {"a": 40}  # still in Redis
        await asyncio.sleep(1.1)  # the window is over
        gateway.record(fresh, "a", MODEL)  # the restarted replica serves again
        await gateway.flush()
        assert await gateway.match(old, ["a"], MODEL) == {"a": 0}  # never the gone cache
        await gateway.flush()  # the retried purge has run
        assert await other.match(old, ["a"], MODEL) == {"a": 0}
        assert await other.match(fresh, ["a"], MODEL) == {"a": 21}
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await gateway.close()
        await other.close()
