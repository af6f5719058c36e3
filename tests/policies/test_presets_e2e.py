"""Routing presets end to end: real gateway, real upstreams, counted on the upstream side."""

from __future__ import annotations

import asyncio
from collections import Counter

from tests.support.harness import chat_body, debug_endpoints, wait_idle, wait_until
from tests.support.upstreams import vllm_metrics

FAST_SCRAPE = {"interval_s": 0.05, "timeout_s": 0.2, "stale_after_s": 1.0}


async def test_round_robin_spreads_exactly_evenly(start_upstream, start_gateway, http):
    ups = [await start_upstream() for _ in range(3)]
    gw = await start_gateway([u.url for u in ups], policy="round-robin")

    async def one() -> str:
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            await resp.read()
            return resp.headers["x-gateway-endpoint"]

    headers = Counter(await asyncio.gather(*(one() for _ in range(30))))
    assert headers == {u.name: 10 for u in ups}
    assert [len(u.requests) for u in ups] == [10, 10, 10]
    await wait_idle(http, gw)


async def test_round_robin_skips_an_unhealthy_endpoint(start_upstream, start_gateway, http):
    ups = [await start_upstream() for _ in range(3)]
    gw = await start_gateway(
        [u.url for u in ups], policy="round-robin", health={"interval_s": 0.05, "unhealthy_threshold": 1}
    )
    ups[1].healthy = False

    async def down() -> bool:
        return not (await debug_endpoints(http, gw))[ups[1].url]["healthy"]

    await wait_until(down, 2.0, "the endpoint to be marked down")
    for _ in range(10):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
    assert [len(u.requests) for u in ups] == [5, 0, 5]


async def _scraped(http, gw, expected: dict[str, float]) -> None:
    async def ready() -> bool:
        rows = await debug_endpoints(http, gw)
        return all(
            rows[url]["waiting"] == w and not rows[url]["metrics_stale"] for url, w in expected.items()
        )

    await wait_until(ready, 2.0, f"scraped queues {expected}")


async def test_least_load_avoids_a_deep_queue(start_upstream, start_gateway, http):
    deep = await start_upstream(metrics_text=vllm_metrics(waiting=50, running=8, kv=0.9))
    idle = await start_upstream(metrics_text=vllm_metrics(waiting=0, running=0, kv=0.1))
    gw = await start_gateway([deep.url, idle.url], policy="least-load", scrape=FAST_SCRAPE)
    await _scraped(http, gw, {deep.url: 50.0, idle.url: 0.0})
    for _ in range(10):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] == idle.name
    assert (len(deep.requests), len(idle.requests)) == (0, 10)

    # The load moves; so does the traffic.
    deep.metrics_text = vllm_metrics(waiting=0, running=0, kv=0.1)
    idle.metrics_text = vllm_metrics(waiting=50, running=8, kv=0.9)
    await _scraped(http, gw, {deep.url: 0.0, idle.url: 50.0})
    for _ in range(10):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.headers["x-gateway-endpoint"] == deep.name
    assert (len(deep.requests), len(idle.requests)) == (10, 10)


async def test_least_load_queue_alone_decides(start_upstream, start_gateway, http):
    """Same KV use on both: only the waiting queue differs (isolates the queue-depth scorer)."""
    deep = await start_upstream(metrics_text=vllm_metrics(waiting=3, running=0, kv=0.5))
    idle = await start_upstream(metrics_text=vllm_metrics(waiting=0, running=0, kv=0.5))
    gw = await start_gateway([deep.url, idle.url], policy="least-load", scrape=FAST_SCRAPE)
    await _scraped(http, gw, {deep.url: 3.0, idle.url: 0.0})
    for _ in range(6):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.headers["x-gateway-endpoint"] == idle.name


async def test_debug_header_names_every_candidate(start_upstream, start_gateway, http):
    ups = [await start_upstream() for _ in range(3)]
    gw = await start_gateway([u.url for u in ups], policy="least-load")
    for stream in (False, True):
        async with http.post(
            gw.url + "/v1/chat/completions", json=chat_body(stream=stream), headers={"x-gateway-debug": "1"}
        ) as resp:
            assert resp.status == 200
            scores = resp.headers["x-gateway-scores"]
            await resp.read()
        assert scores.startswith("default: ")
        for up in ups:
            assert f"{up.name}=" in scores
        for plugin in ("queue-depth", "kv-utilization", "in-flight"):
            assert scores.count(f"{plugin}=") == 3
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert "x-gateway-scores" not in resp.headers
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-gateway-debug": "0"}
    ) as resp:
        assert "x-gateway-scores" not in resp.headers


async def test_debug_header_lists_only_candidates_for_the_model(start_upstream, start_gateway, http):
    a, b = await start_upstream(models=("one",)), await start_upstream(models=("two",))
    gw = await start_gateway([a.url, b.url], policy="round-robin")
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body("two"), headers={"x-gateway-debug": "1"}
    ) as resp:
        scores = resp.headers["x-gateway-scores"]
    assert b.name in scores
    assert a.name not in scores
