"""The exact prefix index end to end: simulators publishing KV events, an in-process gateway.

The gateway's predicted cached tokens (``x-gateway-predicted-cached-tokens`` with
``x-gateway-debug: 1``) must equal what the engine reports (``cached_tokens``) on a
workload that overflows the simulators' caches; a restart, malformed frames, unknown
event types, a sequence gap and a dead publisher are logged, counted and fallen back
from — never a failed request.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from gateway.http.state import STATE
from loadtest.simulator import RunningSimulator, SimConfig, running_simulator
from loadtest.simulator.server import start_runner
from tests.prefix.conftest import GatewayProcessless, gateway_config
from tests.support.harness import metric_value

MODEL = "sim-llama"
EXACT = {"kv_events": {"rediscover_s": 0.3, "replay_timeout_s": 1.0}}


def name_of(sim: RunningSimulator) -> str:
    return sim.url.split("://", 1)[1]


async def ask(
    http: aiohttp.ClientSession, gw: GatewayProcessless, messages: list[dict[str, str]]
) -> tuple[str, int, int, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        predicted = int(r.headers["x-gateway-predicted-cached-tokens"])
        endpoint = r.headers["x-gateway-endpoint"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return endpoint, predicted, cached, answer["choices"][0]["message"]["content"]


def exact_of(gw: GatewayProcessless) -> Any:
    assert gw.gateway is not None
    exact = gw.gateway.app[STATE].prefix.exact
    assert exact is not None
    return exact


async def wait_live(gw: GatewayProcessless, sims: list[RunningSimulator], live: bool = True) -> None:
    index = exact_of(gw).index
    async with asyncio.timeout(10):
        while any(index.live(name_of(s)) != live and (live or index.known(name_of(s))) for s in sims):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def metrics(http: aiohttp.ClientSession, gw: GatewayProcessless) -> str:
    async with http.get(gw.url + "/metrics") as resp:
        return await resp.text()


async def settle(gw: GatewayProcessless, sims: list[RunningSimulator]) -> None:
    """Until the gateway holds exactly the blocks each engine holds (its events applied)."""
    index = exact_of(gw).index
    async with asyncio.timeout(5):
        while any(index.size(name_of(s)) != s.engine.kv.num_cached for s in sims):  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_predictions_equal_engine_reported_cached_tokens_under_eviction(
    start_sims, start_gateway, http
) -> None:
    sims = await start_sims(2, kv_blocks=40, kv_events=True)  # 640 tokens each: the workload overflows
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix={"exact": "auto", **EXACT}))
    await wait_live(gw, sims)
    rng = random.Random(7)
    systems = [f"You are assistant {g}. " + " ".join(f"rule{g}x{i}" for i in range(40)) for g in range(4)]
    conversations: list[list[dict[str, str]]] = []
    results = []
    for step in range(110):
        if len(conversations) < 4 or rng.random() < 0.3:  # new conversation, Zipf-ish system prompt
            group = min(int(rng.paretovariate(1.2)) - 1, 3)
            conversations.append([{"role": "system", "content": systems[group]}])
        conversation = rng.choice(conversations[-8:])
        conversation.append({"role": "user", "content": f"question {step} " + "word " * rng.randint(5, 40)})
        await settle(gw, sims)  # the turn after the answer: what a real client's think time gives
        _, predicted, cached, text = await ask(http, gw, conversation)
        conversation.append({"role": "assistant", "content": text})
        results.append((predicted, cached))
    equal = sum(1 for p, c in results if p == c)
    assert equal >= 0.99 * len(results), [r for r in results if r[0] != r[1]]
    assert sum(c for _, c in results) > 0  # hits happened
    assert all(s.engine.kv.evictions > 0 for s in sims)  # and blocks were evicted
    text = await metrics(http, gw)
    assert metric_value(text, "llm_gateway_prefix_tokenize_total", outcome="ok") > 0
    assert metric_value(text, "llm_gateway_kv_events_applied_total", endpoint=name_of(sims[0])) > 0
    assert metric_value(text, "llm_gateway_prefix_cached_tokens_prediction_error_count", index="exact") > 0


async def test_restart_drops_the_endpoints_blocks(start_gateway, http, stack) -> None:
    config = SimConfig(port=0, time_scale=20.0, kv_events=True, kv_blocks=256)
    runner, sim = await start_runner(config)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT, health={"interval_s": 0.1}))
    await wait_live(gw, [sim])
    messages = [{"role": "user", "content": "a prompt long enough to fill a few blocks " * 6}]
    await ask(http, gw, messages)
    await settle(gw, [sim])
    assert exact_of(gw).index.size(name_of(sim)) > 0
    _, predicted, cached, _ = await ask(http, gw, messages)
    assert predicted == cached > 0

    # Restart: same HTTP port, a new engine (empty cache, new KV-event ports).
    await runner.cleanup()
    await wait_live(gw, [sim], live=False)
    restarted = await stack.enter_async_context(running_simulator(config))
    await wait_live(gw, [restarted])
    assert exact_of(gw).index.size(name_of(restarted)) == 0  # the old engine's blocks are gone
    _, predicted, cached, _ = await ask(http, gw, messages)
    assert predicted == cached == 0


async def test_malformed_unknown_gap_and_dead_publisher_never_fail_a_request(
    start_sims, start_gateway, http
) -> None:
    (sim,) = await start_sims(1, kv_events=True, kv_blocks=256)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_live(gw, [sim])
    publisher = sim.state.kv_events
    assert publisher is not None
    name = name_of(sim)
    topic = publisher.topic.encode()
    publisher.send_raw([topic])  # one frame
    publisher.send_raw([topic, b"\x00\x01", b"x"])  # a short sequence frame
    publisher.send_raw([topic, (10**6).to_bytes(8, "big"), b"\xc1"])  # not msgpack
    publisher.inject([{"type": "BlockFrobbed", "block_hashes": [1]}, {"type": "BlockStored"}])
    messages = [{"role": "user", "content": "tell me about the river and the stone bridge " * 5}]
    await ask(http, gw, messages)
    await settle(gw, [sim])
    _, predicted, cached, _ = await ask(http, gw, messages)
    assert predicted == cached > 0
    text = await metrics(http, gw)
    assert metric_value(text, "llm_gateway_kv_events_decode_errors_total", endpoint=name) >= 4
    assert metric_value(text, "llm_gateway_kv_events_unknown_total", endpoint=name, type="BlockFrobbed") == 1

    # A gap: the next batch is only in the replay buffer; the gateway replays it.
    publisher.skip(1)
    other = [{"role": "user", "content": "another prompt with different words for new blocks " * 5}]
    await ask(http, gw, other)
    await ask(http, gw, [*other, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    await settle(gw, [sim])
    _, predicted, cached, _ = await ask(http, gw, other)
    assert predicted == cached > 0
    text = await metrics(http, gw)
    assert metric_value(text, "llm_gateway_kv_events_replays_total", endpoint=name, outcome="gap") >= 1

    # A dead publisher: the approximate index answers, requests still succeed.
    await publisher.close()
    await wait_live(gw, [sim], live=False)
    for _ in range(3):
        await ask(http, gw, messages)
    text = await metrics(http, gw)
    fallbacks = metric_value(
        text, "llm_gateway_prefix_exact_fallbacks_total", endpoint=name, reason="not_live"
    )
    assert fallbacks is not None and fallbacks >= 3
    assert metric_value(text, "llm_gateway_kv_events_live", endpoint=name) == 0


async def test_exact_off_and_endpoints_without_events_use_the_approximate_index(
    start_sims, start_gateway, http
) -> None:
    (sim,) = await start_sims(1)
    gw = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    messages = [{"role": "user", "content": "plain simulator without kv events " * 8}]
    await ask(http, gw, messages)
    _, predicted, _, _ = await ask(http, gw, messages)
    assert predicted > 0  # the approximate index's estimate
    assert not exact_of(gw).index.live(name_of(sim))
    off = await start_gateway(gateway_config([sim.url], prefix={"exact": "off"}))
    assert off.gateway is not None and off.gateway.app[STATE].prefix.exact is None
