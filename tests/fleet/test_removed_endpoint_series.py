"""A removed endpoint leaves no trace in /metrics and no pooled connection behind.

Regression: after ``DELETE /admin/endpoints`` (or discovery churn) the removed replica was
exported for ever as ``llm_gateway_endpoint_healthy{endpoint=…} 1`` with its queue, running,
KV, stale and saturation gauges and its counters, and its keep-alive connections stayed
open in the upstream client.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client.parser import text_string_to_metric_families

from tests.fleet.servers import Engine, running_engine
from tests.support.harness import chat_body, gateway_metrics, wait_until
from tests.web.test_admin import ADMIN, AUTH


def _series_of(text: str, name: str) -> list[str]:
    return [
        s.name
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("endpoint") == name
    ]


async def test_removed_endpoint_has_no_series_and_no_pool(
    stack: contextlib.AsyncExitStack, start_upstream, start_gateway, http
):
    first = await start_upstream()
    second = await stack.enter_async_context(running_engine(Engine()))
    gw = await start_gateway([first.url], auth=AUTH, policy="round-robin")
    async with http.post(gw.url + "/admin/endpoints", json={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 201

    async def scraped() -> bool:
        series = _series_of(await gateway_metrics(http, gw), second.name)
        return {"llm_gateway_endpoint_healthy", "llm_gateway_endpoint_queue_depth"} <= set(series)

    await wait_until(scraped, 3.0, "the added endpoint to be probed and scraped")
    served = set()
    for _ in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            served.add(resp.headers["x-gateway-endpoint"])
    assert second.name in served
    client = gw.state.proxy._client
    assert client.has_pool(second.url)
    assert second.transports
    before = set(_series_of(await gateway_metrics(http, gw), second.name))
    assert "llm_gateway_requests_total" in before and "llm_gateway_endpoint_metrics_stale" in before

    async with http.delete(gw.url + "/admin/endpoints", params={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 200

    assert not client.has_pool(second.url)
    assert not [k for k in gw.state.metrics._children if second.name in k[1]]
    # Across a few probe and scrape rounds nothing brings a series back.
    for _ in range(3):
        await wait_until(lambda: _no_series(http, gw, second.name), 1.0, "no series of the removed endpoint")
        await asyncio.sleep(0.4)
    assert _series_of(await gateway_metrics(http, gw), first.name)  # the remaining one is untouched

    # Its keep-alive connection was closed by the gateway: the upstream saw it go.
    async def closed() -> bool:
        return all(t.is_closing() for t in second.transports)

    await wait_until(closed, 2.0, "the removed endpoint's pooled connection to close")


async def _no_series(http, gw, name: str) -> bool:
    return _series_of(await gateway_metrics(http, gw), name) == []
