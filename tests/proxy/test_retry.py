"""Retries before the first byte: on connect failure and on upstream 5xx, never to the same endpoint."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.harness import chat_body, debug_endpoints, gateway_metrics, metric_value, wait_idle

# Health probes far apart and never flipping on their own: only the proxy's view matters.
STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}


def by_url(*upstreams):
    return sorted(upstreams, key=lambda u: u.url)


async def retries(http, gw, reason: str) -> float:
    return metric_value(await gateway_metrics(http, gw), "llm_gateway_retries_total", reason=reason) or 0.0


async def test_refused_connection_is_retried_on_another_endpoint(start_upstream, start_gateway, http):
    dead, live = by_url(await start_upstream(), await start_upstream())
    gw = await start_gateway([dead.url, live.url], policy="round-robin", health=STICKY_HEALTH)
    assert all(r["healthy"] for r in (await debug_endpoints(http, gw)).values())
    await dead.stop()  # the gateway still believes it is healthy; its port now refuses

    for _ in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] == live.name
            assert (await resp.json())["choices"]
    # Round-robin started exactly two of the four requests on the dead endpoint.
    assert await retries(http, gw, "connect") == 2
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_upstream_errors_total", endpoint=dead.name, kind="connect") == 2
    assert len(live.requests) == 4
    await wait_idle(http, gw)


async def test_refused_connections_mark_the_endpoint_down(start_upstream, start_gateway, http):
    dead, live = by_url(await start_upstream(), await start_upstream())
    health = {"interval_s": 60, "unhealthy_threshold": 2}
    gw = await start_gateway([dead.url, live.url], policy="round-robin", health=health)
    await dead.stop()
    for _ in range(8):
        async with http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 200
    rows = await debug_endpoints(http, gw)
    assert rows[dead.url]["healthy"] is False
    assert rows[live.url]["healthy"] is True
    # Two refusals reach the threshold; after that the dead endpoint is no longer tried at all.
    assert await retries(http, gw, "connect") == 2


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_upstream_5xx_before_first_byte_is_retried(stream, start_sim, start_gateway, http):
    sims = sorted([await start_sim(), await start_sim()], key=lambda s: s.url)
    failing, healthy = sims
    gw = await start_gateway([s.url for s in sims], policy="round-robin")
    async with http.post(failing.url + "/admin/fault", json={"mode": "error", "status": 500}) as r:
        assert r.status == 200
    for _ in range(4):
        async with http.post(
            gw.url + "/v1/chat/completions", json=chat_body("sim-llama", stream=stream)
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] == healthy.url.split("://")[1]
            raw = await resp.read()
        if stream:
            assert raw.rstrip().endswith(b"data: [DONE]")
            assert b'"error"' not in raw
    assert await retries(http, gw, "http_500") == 2
    text = await gateway_metrics(http, gw)
    failing_name = failing.url.split("://")[1]
    assert (
        metric_value(text, "llm_gateway_upstream_errors_total", endpoint=failing_name, kind="http_500") == 2
    )
    await wait_idle(http, gw)


async def test_every_endpoint_refusing_is_502(start_upstream, start_gateway, http):
    ups = [await start_upstream(), await start_upstream()]
    gw = await start_gateway([u.url for u in ups], health=STICKY_HEALTH)
    for up in ups:
        await up.stop()
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["code"] == "upstream_unavailable"
    assert error["type"] == "upstream_error"
    assert await retries(http, gw, "connect") == 1
    await wait_idle(http, gw)


async def test_retries_zero_does_not_retry(start_upstream, start_gateway, http):
    dead, live = by_url(await start_upstream(), await start_upstream())
    gw = await start_gateway(
        [dead.url, live.url], policy="round-robin", health=STICKY_HEALTH, limits={"retries": 0}
    )
    await dead.stop()
    statuses = []
    for _ in range(2):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            statuses.append(resp.status)
    assert sorted(statuses) == [200, 502]
    assert await retries(http, gw, "connect") == 0


async def test_retries_walk_the_ranking_without_repeating(start_upstream, start_gateway, http):
    ups = by_url(await start_upstream(), await start_upstream(), await start_upstream())
    for up in ups[:2]:
        up.mode, up.status = "status", 503
    gw = await start_gateway([u.url for u in ups], policy="round-robin", limits={"retries": 2})
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-endpoint"] == ups[2].name
    assert [len(u.requests) for u in ups] == [1, 1, 1]
    assert await retries(http, gw, "http_503") == 2


async def test_failure_after_first_byte_is_not_retried(start_upstream, start_gateway, http):
    first, second = by_url(await start_upstream(), await start_upstream())
    first.mode = "die"
    gw = await start_gateway([first.url, second.url], policy="round-robin")
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        assert resp.headers["x-gateway-endpoint"] == first.name
        raw = await asyncio.wait_for(resp.read(), 2.0)
    assert b"upstream_stream_error" in raw
    assert second.requests == []
    assert await retries(http, gw, "connect") == 0
    await wait_idle(http, gw)


async def test_5xx_with_a_stalled_body_does_not_hang(start_upstream, start_gateway, http):
    stalled, live = by_url(await start_upstream(), await start_upstream())
    stalled.mode, stalled.status = "status-stall", 503
    gw = await start_gateway([stalled.url, live.url], policy="round-robin", timeouts={"first_byte_s": 0.3})
    async with asyncio.timeout(3):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            await resp.read()
    # Either retried on the live endpoint or a clean upstream timeout; never a hang.
    assert resp.status in (200, 504)
    if resp.status == 200:
        assert resp.headers["x-gateway-endpoint"] == live.name
    await wait_idle(http, gw)
