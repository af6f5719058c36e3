"""A request the gateway itself ends (the shutdown timeout's cut) is not a client disconnect.

``llm_gateway_client_disconnects_total`` counts clients that went away; before, every stream
the shutdown timeout cut was counted there too (both arrive as a cancelled handler), so a
deploy read as a burst of impatient clients. The cut now cancels with the gateway's own
message. Real gateway, real simulator streaming 10 ms per token, the real cut
(``InFlight.cut``, as ``serve``'s shutdown calls it).
"""

from __future__ import annotations

import asyncio
import json

from gateway.http.middleware import IN_FLIGHT
from tests.support.harness import gateway_metrics, metric_value, wait_idle, wait_until

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "a long story"}],
    "max_tokens": 2000,
    "stream": True,
}


async def _disconnects(http, gw) -> float | None:
    return metric_value(await gateway_metrics(http, gw), "llm_gateway_client_disconnects_total")


async def test_a_stream_the_gateway_cuts_is_not_counted_as_a_client_disconnect(
    start_sim, start_gateway, http
):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    gw = await start_gateway([sim.url], policy="round-robin")
    async with http.post(gw.url + "/v1/chat/completions", json=BODY) as resp:
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert gw.app[IN_FLIGHT].cut("the gateway is shutting down (test)") == 1
        text = (first + await resp.read()).decode()
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "gateway_shutting_down"
    await wait_idle(http, gw, within_s=3.0)
    assert await _disconnects(http, gw) == 0


async def test_a_client_that_leaves_mid_stream_is_counted(start_sim, start_gateway, http):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    gw = await start_gateway([sim.url], policy="round-robin")
    resp = await http.post(gw.url + "/v1/chat/completions", json=BODY)
    assert resp.status == 200
    await resp.content.readline()
    resp.close()  # the client goes away

    async def counted() -> bool:
        return await _disconnects(http, gw) == 1

    await wait_until(counted, 3.0, "the disconnect to be counted")
    await asyncio.sleep(0.2)
    assert await _disconnects(http, gw) == 1  # once, not per retry or per layer
