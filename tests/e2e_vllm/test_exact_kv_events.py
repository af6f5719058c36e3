"""Exact prefix state from real vLLM KV events: two CPU replicas publishing on ZMQ.

The gateway finds each replica's stream itself (``GET /kv_event_sources``), builds its
exact index from the engines' ``BlockStored``/``BlockRemoved`` events, and asks the
engines' ``/tokenize`` for the prompt tokens (chat template included). Checked against
what the engines report:

- the engine-token path: ``/tokenize`` (chat template applied) gives as many tokens as
  ``usage.prompt_tokens``, and the blocks the engine then stores (``BlockStored.token_ids``)
  are exactly the request's block keys (``/v1/chat/completions/render`` gives the same
  tokens where vLLM runs with ``--enable-scale-out``);
- ``x-gateway-predicted-cached-tokens`` equals ``usage.prompt_tokens_details.cached_tokens``
  for ≥ 99 % of a multi-turn workload that overflows both replicas' 128-block caches;
- a restarted gateway converges to the same index (replay from sequence 0);
- a restarted replica's blocks are gone from the index (its stream starts over).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any

import aiohttp
import pytest

from gateway.fleet.kv_wire import BlockRemoved
from gateway.http.state import STATE
from gateway.prefix.exact import block_keys
from loadtest.realvllm.fleet import restart_replica
from loadtest.realvllm.kv_capture import capture
from tests.e2e_vllm.conftest import BLOCK_SIZE, NUM_BLOCKS, Fleet
from tests.e2e_vllm.helpers import MODEL
from tests.loadtest.test_kv_events_parity import CAPTURE, layout
from tests.prefix.conftest import GatewayProcessless, gateway_config

pytestmark = pytest.mark.slow
EXACT = {
    "exact": "auto",
    # the box's 2 cores are shared with two engines: a slow /tokenize must not fall back here
    "kv_events": {"rediscover_s": 0.5, "tokenize_timeout_s": 5.0},
}


def name_of(url: str) -> str:
    return url.split("://", 1)[1]


def exact_of(gw: GatewayProcessless) -> Any:
    assert gw.gateway is not None
    exact = gw.gateway.app[STATE].prefix.exact
    assert exact is not None
    return exact


async def started(fleet: Fleet, stack: Any) -> GatewayProcessless:
    gw = GatewayProcessless(gateway_config(fleet.urls, prefix=EXACT))
    await gw.start()
    stack.push_async_callback(gw.stop)
    await wait_live(gw, fleet.urls)
    return gw


async def wait_live(gw: GatewayProcessless, urls: list[str], timeout_s: float = 30.0) -> None:
    index = exact_of(gw).index
    async with asyncio.timeout(timeout_s):
        while not all(index.live(name_of(u)) for u in urls):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def quiet(gw: GatewayProcessless, urls: list[str], for_s: float = 0.25) -> None:
    """Until no KV event has arrived for ``for_s``: the engines' last steps are applied."""
    applied = exact_of(gw).metrics.applied

    def total() -> float:
        return sum(applied.labels(name_of(u))._value.get() for u in urls)

    last, since = total(), time.monotonic()
    async with asyncio.timeout(10):
        while time.monotonic() - since < for_s:
            await asyncio.sleep(0.05)
            now = total()
            if now != last:
                last, since = now, time.monotonic()


async def ask(
    http: aiohttp.ClientSession, gw: GatewayProcessless, messages: list[dict[str, str]], max_tokens: int = 8
) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        return {
            "endpoint": r.headers["x-gateway-endpoint"],
            "predicted": int(r.headers["x-gateway-predicted-cached-tokens"]),
            "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "text": answer["choices"][0]["message"]["content"],
        }


def document(i: int) -> str:
    return f"Survey {i}. " + " ".join(f"section {i}-{j} notes the arch {j * 7 % 13} stone" for j in range(40))


async def test_engine_tokens_are_the_tokens_the_engine_hashes(fleet: Fleet, http, stack) -> None:
    gw = await started(fleet, stack)
    url = fleet.urls[0]
    messages = [
        {"role": "system", "content": document(99)},
        {"role": "user", "content": "Which arches are made of stone?"},
    ]
    body = {"model": MODEL, "messages": messages}
    async with http.post(url + "/tokenize", json=body) as r:
        assert r.status == 200
        tokens = (await r.json())["tokens"]
    async with http.post(url + "/v1/chat/completions/render", json=body) as r:
        # 403 unless vLLM runs with --enable-scale-out; /tokenize is always there
        assert r.status in (200, 403), await r.text()
        render = await r.json() if r.status == 200 else None
    if render is not None:
        rendered = render["token_ids"] if isinstance(render, dict) else render[1]
        assert tokens == rendered  # chat template and special tokens: the same on both routes
    async with http.post(url + "/reset_prefix_cache") as r:
        assert r.status == 200
    async with http.post(url + "/v1/chat/completions", json={**body, "max_tokens": 1}) as r:
        usage = (await r.json())["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    await quiet(gw, [url])
    keys = block_keys(tokens, BLOCK_SIZE)
    assert keys and exact_of(gw).index.matched_blocks(name_of(url), keys) == len(keys)


async def test_predicted_cached_tokens_equal_the_engines_under_eviction(fleet: Fleet, http, stack) -> None:
    for url in fleet.urls:  # a cold start, so evictions come from this workload
        async with http.post(url + "/reset_prefix_cache") as r:
            assert r.status == 200
    gw = await started(fleet, stack)
    removed = count_removals(gw)
    rng = random.Random(14)
    docs = [document(d) for d in range(10)]  # ~10 × 15 blocks of documents, plus the turns
    conversations: list[list[dict[str, str]]] = []
    results: list[dict[str, Any]] = []
    for step in range(70):
        if len(conversations) < 3 or rng.random() < 0.35:
            doc = min(int(rng.paretovariate(1.0)) - 1, len(docs) - 1)
            conversations.append([{"role": "system", "content": docs[doc]}])
        conversation = rng.choice(conversations[-6:])
        words = " ".join(f"q{step}w{i}" for i in range(rng.randint(10, 60)))
        conversation.append({"role": "user", "content": f"Question {step}: {words}?"})
        await quiet(gw, fleet.urls)  # what a client's think time gives: the last answer's blocks are in
        result = await ask(http, gw, conversation)
        conversation.append({"role": "assistant", "content": result["text"]})
        results.append(result)
    exact = [r for r in results if r["predicted"] == r["cached"]]
    summary = {
        "requests": len(results),
        "exact": len(exact),
        "cached_tokens": sum(r["cached"] for r in results),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "per_endpoint": {e: sum(1 for r in results if r["endpoint"] == e) for e in map(name_of, fleet.urls)},
        "removed_blocks": dict(removed),
        "misses": [(r["predicted"], r["cached"]) for r in results if r["predicted"] != r["cached"]],
    }
    print("\nexact KV events on real vLLM:", json.dumps(summary))
    assert len(exact) >= 0.99 * len(results), summary
    assert summary["cached_tokens"] > 0.3 * summary["prompt_tokens"], summary  # hits happened
    assert summary["prompt_tokens"] > 2 * NUM_BLOCKS * BLOCK_SIZE * 2, summary  # 2× the fleet's KV
    assert all(removed.get(name_of(u), 0) > 0 for u in fleet.urls), summary  # both caches evicted

    # A restarted gateway converges: it replays each stream from sequence 0.
    before = {name_of(u): exact_of(gw).index.size(name_of(u)) for u in fleet.urls}
    await gw.stop()
    await gw.start()
    await wait_live(gw, fleet.urls)
    await quiet(gw, fleet.urls)
    after = {name_of(u): exact_of(gw).index.size(name_of(u)) for u in fleet.urls}
    assert after == before and all(after.values()), (before, after)
    again = await ask(http, gw, conversation[:-1])  # the last turn once more: a hit
    assert again["predicted"] == again["cached"] > 0, again


def count_removals(gw: GatewayProcessless) -> dict[str, int]:
    """Blocks each engine reported evicted (``BlockRemoved``), counted as the index applies them."""
    index = exact_of(gw).index
    removed: dict[str, int] = {}
    apply = index.apply

    def counting(endpoint: str, events: Any, published_at: float) -> None:
        for event in events:
            if isinstance(event, BlockRemoved):
                removed[endpoint] = removed.get(endpoint, 0) + len(event.block_hashes)
        apply(endpoint, events, published_at)

    index.apply = counting
    return removed


async def test_a_restarted_replica_has_no_blocks_in_the_index(fleet: Fleet, http, stack) -> None:
    gw = await started(fleet, stack)
    replica = fleet.replicas[1]
    name = name_of(replica.url)
    messages = [{"role": "user", "content": document(7)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    async with http.post(replica.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
    await quiet(gw, [replica.url])
    index = exact_of(gw).index
    assert index.size(name) > 0
    fleet.replicas[1] = await asyncio.to_thread(restart_replica, replica)  # same ports, a new engine
    await wait_live(gw, fleet.urls)
    await quiet(gw, fleet.urls)
    assert index.size(name) == 0  # the old engine's blocks are gone
    result = await ask(http, gw, messages)
    assert result["predicted"] == result["cached"], result


async def test_real_frames_keep_the_captured_structure(fleet: Fleet) -> None:
    """The scripted capture against a live replica has the layout stored in captures/ (which the
    simulator is checked against offline); ``LLMGW_RECAPTURE=1`` rewrites the stored capture."""
    replica = fleet.replicas[0]
    assert replica.kv_ports is not None
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in replica.kv_ports)
    record = await asyncio.to_thread(capture, replica.url, pub, replay)
    if os.environ.get("LLMGW_RECAPTURE") == "1":
        CAPTURE.write_text(json.dumps(record, indent=1) + "\n")
    stored = json.loads(CAPTURE.read_text())
    assert layout(record) == layout(stored)
    assert record["steps"]["first"]["events"], "no live KV-event frame reached the subscriber"
