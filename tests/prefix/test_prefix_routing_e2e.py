"""Prefix-aware routing end to end: simulated replicas, an in-process gateway, the real OpenAI client.

Default policy (``prefix-aware``). Each routing property is checked over several
prompts or conversations, so a random or round-robin router cannot pass by chance.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import openai

from loadtest.simulator import RunningSimulator
from tests.prefix.conftest import GatewayProcessless, gateway_config
from tests.support.harness import metric_value

MODEL = "sim-llama"


def words(tag: str, n: int) -> str:
    """``n`` distinct words (one simulator token each), about 8-10 bytes apiece."""
    return " ".join(f"{tag}w{i}" for i in range(n))


def name_of(sim: RunningSimulator) -> str:
    return sim.url.split("://", 1)[1]


def client_for(gw: GatewayProcessless) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test", max_retries=0, timeout=15)


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> tuple[str, Any]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, extra_headers={"x-gateway-debug": "1"}
    )
    assert raw.status_code == 200
    return raw.headers["x-gateway-endpoint"], raw.parse()


async def metrics_text(http: aiohttp.ClientSession, gw: GatewayProcessless) -> str:
    async with http.get(gw.url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def index_blocks(http: aiohttp.ClientSession, gw: GatewayProcessless, endpoint: str) -> float:
    value = metric_value(await metrics_text(http, gw), "llm_gateway_prefix_index_blocks", endpoint=endpoint)
    return value or 0.0


async def test_repeated_long_prefix_returns_to_its_replica(start_sims, start_gateway, http):
    sims = await start_sims(3)
    gw = await start_gateway(gateway_config([s.url for s in sims]))
    client = client_for(gw)
    try:
        homes = []
        for doc in range(3):  # three different documents, each asked about four times
            document = words(f"doc{doc}", 400)
            home, first = await chat(client, [{"role": "user", "content": document}])
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            for q in range(4):
                content = f"{document} question {q}: summarise part {q}"
                endpoint, resp = await chat(client, [{"role": "user", "content": content}])
                assert endpoint == home, f"doc {doc} q {q} left {home} for {endpoint}"
                cached = resp.usage.prompt_tokens_details.cached_tokens
                assert cached >= 350, f"expected the 400-word document cached, got {cached}"
            homes.append(home)
        text = await metrics_text(http, gw)
        assert (metric_value(text, "llm_gateway_observed_cached_tokens_total") or 0) >= 3 * 4 * 350
        assert (metric_value(text, "llm_gateway_prefix_predicted_hit_blocks_total") or 0) > 0
    finally:
        await client.close()


async def test_multi_turn_conversations_stick_to_their_replica(start_sims, start_gateway):
    sims = await start_sims(3)
    gw = await start_gateway(gateway_config([s.url for s in sims]))
    client = client_for(gw)
    try:
        conversations: list[list[dict[str, str]]] = [
            [{"role": "system", "content": f"You are agent {c}. " + words(f"sys{c}", 150)}] for c in range(4)
        ]
        homes: dict[int, str] = {}
        cached_seen: dict[int, list[int]] = {c: [] for c in range(4)}
        for turn in range(4):
            for c, messages in enumerate(conversations):  # interleaved, like concurrent users
                messages.append({"role": "user", "content": f"turn {turn}: " + words(f"c{c}t{turn}", 30)})
                endpoint, resp = await chat(client, messages)
                homes.setdefault(c, endpoint)
                assert endpoint == homes[c], f"conversation {c} moved at turn {turn}"
                cached_seen[c].append(resp.usage.prompt_tokens_details.cached_tokens)
                messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        for c, cached in cached_seen.items():
            assert cached[0] == 0
            # each later turn reuses at least the whole previous conversation's system prompt
            assert all(x >= 150 for x in cached[1:]), (c, cached)
            assert cached == sorted(cached), (c, cached)  # the cached part grows turn by turn
    finally:
        await client.close()


async def test_shared_system_prompt_under_load_is_spread(start_sims, start_gateway, http):
    sims = await start_sims(3)
    gw = await start_gateway(gateway_config([s.url for s in sims]))
    client = client_for(gw)
    system = "Shared company system prompt. " + words("policy", 500)
    try:

        async def one(i: int) -> str:
            endpoint, _ = await chat(
                client,
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"user {i} asks: " + words(f"u{i}", 20)},
                ],
            )
            return endpoint

        endpoints = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(30))), 20)
        counts = Counter(endpoints)
        assert set(counts) == {name_of(s) for s in sims}, counts
        assert max(counts.values()) <= 18, f"hot spot: {counts}"
        text = await metrics_text(http, gw)
        # the spread came from load overriding affinity, not from the prompt being uncached
        assert (metric_value(text, "llm_gateway_affinity_overridden_by_load_total") or 0) > 0
    finally:
        await client.close()


async def test_index_purged_when_endpoint_goes_down(start_sims, start_gateway, http, stack):
    from loadtest.simulator import SimConfig, running_simulator

    sims = await start_sims(2)
    doomed_cm = running_simulator(SimConfig(port=0, time_scale=20, block_size=16, model=MODEL))
    doomed = await doomed_cm.__aenter__()
    stopped = False

    async def stop_doomed() -> None:
        if not stopped:
            await doomed_cm.__aexit__(None, None, None)

    stack.push_async_callback(stop_doomed)
    gw = await start_gateway(gateway_config([*(s.url for s in sims), doomed.url]))
    client = client_for(gw)
    try:
        for i in range(12):  # enough distinct documents that every replica gets some
            await chat(client, [{"role": "user", "content": words(f"d{i}", 120)}])
        name = name_of(doomed)
        state = gw.gateway.state if gw.gateway else None
        assert state is not None
        if await index_blocks(http, gw, name) == 0:  # make sure the doomed replica holds something
            for i in range(30):
                endpoint, _ = await chat(client, [{"role": "user", "content": words(f"extra{i}", 120)}])
                if endpoint == name:
                    break
        assert await index_blocks(http, gw, name) > 0
        others_before = {name_of(s): await index_blocks(http, gw, name_of(s)) for s in sims}
        await doomed_cm.__aexit__(None, None, None)
        stopped = True
        deadline = asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < deadline:
            if await index_blocks(http, gw, name) == 0:
                break
            await asyncio.sleep(0.05)
        assert await index_blocks(http, gw, name) == 0
        assert state.prefix.index.size(name) == 0
        assert not next(e for e in state.registry if e.name == name).healthy
        # the healthy replicas keep what they hold
        for s in sims:
            assert await index_blocks(http, gw, name_of(s)) == others_before[name_of(s)]
        # and traffic keeps flowing to the survivors
        endpoint, _ = await chat(client, [{"role": "user", "content": words("after", 120)}])
        assert endpoint in {name_of(s) for s in sims}
    finally:
        await client.close()


async def test_index_capacity_follows_engine_kv_size(start_sims, start_gateway, http):
    kv_blocks, block_size = 48, 16
    (small,) = await start_sims(1, kv_blocks=kv_blocks)
    gw = await start_gateway(gateway_config([small.url]))
    name = name_of(small)
    bound = kv_blocks * block_size * 4 // 64  # engine tokens × 4 chars/token ÷ 64-byte blocks = 48
    state = gw.gateway.state if gw.gateway else None
    assert state is not None

    for _ in range(60):  # at most 3 s for the first scrape to land
        if state.prefix.index.capacity(name) <= bound:
            break
        await asyncio.sleep(0.05)
    assert state.prefix.index.capacity(name) <= bound  # learnt from vllm:cache_config_info
    async with http.get(gw.url + "/metrics") as resp:  # and visible from outside
        text = await resp.text()
    assert f'llm_gateway_prefix_index_capacity_blocks{{endpoint="{name}"}} {float(bound)}' in text
    client = client_for(gw)
    try:
        recorded = 0
        for i in range(15):  # 15 unique prompts of ~10 blocks each: ~3× the engine's capacity
            await chat(client, [{"role": "user", "content": words(f"flood{i}-", 60)}])
            recorded += 10
            assert await index_blocks(http, gw, name) <= bound
        assert recorded > 2 * bound
        blocks = await index_blocks(http, gw, name)
        assert bound // 2 < blocks <= bound, blocks  # full, but never beyond the engine's size
    finally:
        await client.close()
