"""An endpoint removed while a stream runs on it stays gone from /metrics once the stream ends
(found by review, 2026-12-05: the stream's outcome re-created its series for good)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import chat_body, gateway_metrics, wait_until
from tests.web.test_admin import ADMIN, AUTH


def _series_of(text: str, name: str) -> list[str]:
    return sorted(
        {
            s.name
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("endpoint") == name
        }
    )


async def _stream(http, gw) -> tuple[int, str]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        return resp.status, (await resp.read()).decode()


async def stream_held_on(upstream, http, gw) -> asyncio.Task:
    """A stream that round-robin sent to ``upstream``, held open there (gated) until released."""
    upstream.mode = "gated"
    for _ in range(4):  # round-robin: one of the next requests lands on it
        task = asyncio.create_task(_stream(http, gw))
        await asyncio.sleep(0.1)
        if upstream.first_chunk_sent.is_set():
            return task
        await task
    raise AssertionError("no stream reached the gated upstream")


async def test_a_removed_endpoint_stays_gone_after_its_last_stream_ends(start_upstream, start_gateway, http):
    first, second = await start_upstream(), await start_upstream()
    gw = await start_gateway([first.url], auth=AUTH, policy="round-robin")
    async with http.post(gw.url + "/admin/endpoints", json={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 201

    async def healthy() -> bool:
        endpoint = gw.state.registry.get(second.url)
        return endpoint is not None and endpoint.healthy

    await wait_until(healthy, 3.0, "the added endpoint to be probed")
    stream = await stream_held_on(second, http, gw)

    async with http.delete(gw.url + "/admin/endpoints", params={"url": second.url}, headers=ADMIN) as resp:
        assert resp.status == 200
    assert _series_of(await gateway_metrics(http, gw), second.name) == []  # forgotten at once

    second.gate.set()
    status, text = await stream
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    await asyncio.sleep(0.5)  # a probe and a scrape round
    left = _series_of(await gateway_metrics(http, gw), second.name)
    assert left == [], f"series of the removed endpoint {second.name} are back: {left}"
