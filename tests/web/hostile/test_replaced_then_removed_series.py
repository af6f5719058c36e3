"""An endpoint changed in place (a reload) and then removed while a stream runs on it: once
the stream ends its series are gone, as for an endpoint removed without the change. Found by
the final review (2026-12-05): the counts had moved to the successor, so they stayed."""

from __future__ import annotations

import asyncio

from gateway.config import EndpointConfig
from gateway.http.reload import apply_config
from tests.support.harness import chat_body, gateway_metrics, wait_until
from tests.web.hostile.test_removed_endpoint_series_stay_gone import _series_of, stream_held_on


async def _stream(http, gw) -> tuple[int, str]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        return resp.status, (await resp.read()).decode()


async def test_replaced_then_removed_endpoint_series_stay_gone(start_upstream, start_gateway, http):
    first, second = await start_upstream(), await start_upstream()
    gw = await start_gateway([first.url, {"url": second.url, "labels": {"rev": "1"}}], policy="round-robin")
    state = gw.state
    stream = await stream_held_on(second, http, gw)
    try:
        changed = EndpointConfig(url=second.url, labels={"rev": "2"})  # replaced in place
        kept = EndpointConfig(url=first.url)
        await apply_config(state, state.config.model_copy(update={"endpoints": [kept, changed]}))
        await apply_config(state, state.config.model_copy(update={"endpoints": [kept]}))
        assert state.registry.get(second.url) is None

        async def forgotten() -> bool:
            return _series_of(await gateway_metrics(http, gw), second.name) == []

        await wait_until(forgotten, 2.0, "the removed endpoint's series to be forgotten")
        second.gate.set()
        status, text = await stream
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        await asyncio.sleep(0.5)
        left = _series_of(await gateway_metrics(http, gw), second.name)
        assert left == [], f"series of the removed endpoint {second.name} are back: {left}"
    finally:
        second.gate.set()
        await asyncio.gather(stream, return_exceptions=True)
