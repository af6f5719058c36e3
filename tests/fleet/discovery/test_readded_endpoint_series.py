"""A replica that leaves and comes back (same URL) must keep the series and state of its new self.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import asyncio

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import chat_body, gateway_metrics, metric_value, wait_until


async def test_old_stream_ending_after_rejoin_keeps_the_new_endpoints_series(start_sim, start_gateway, http):
    sim = await start_sim(model="m", time_scale=1.0, decode_step_ms=20.0)
    port = int(sim.url.rsplit(":", 1)[1])
    name = sim.url.split("://", 1)[1]
    async with running_dns() as dns:
        dns.set("llm.test.", "A", "127.0.0.1")
        discovery = dns.discovery(port, interval_s=0.05)
        gw = await start_gateway([], discovery=discovery)

        async def healthy() -> bool:
            e = gw.state.registry.get(sim.url)
            return e is not None and e.healthy

        await wait_until(healthy, 3.0, "the discovered endpoint to be healthy")
        first = gw.state.registry.get(sim.url)

        long_body = chat_body(model="m", stream=True, max_tokens=60)  # ~1.2 s of tokens
        async with http.post(gw.url + "/v1/chat/completions", json=long_body) as stream:
            assert stream.status == 200
            await stream.content.readline()
            dns.set("llm.test.", "A")  # the record drops out ...

            async def gone() -> bool:
                return gw.state.registry.get(sim.url) is None

            await wait_until(gone, 3.0, "the endpoint to leave")
            dns.set("llm.test.", "A", "127.0.0.1")  # ... and comes back at once

            async def back() -> bool:
                e = gw.state.registry.get(sim.url)
                return e is not None and e is not first and e.healthy

            await wait_until(back, 3.0, "the endpoint to re-join, healthy")
            # The re-joined endpoint serves a request: its own counter series.
            async with http.post(gw.url + "/v1/chat/completions", json=chat_body(model="m")) as resp:
                assert resp.status == 200
            text = await gateway_metrics(http, gw)
            served = metric_value(text, "llm_gateway_requests_total", endpoint=name)
            assert served is not None and served >= 1
            await stream.read()  # the old object's stream ends now

        await asyncio.sleep(0.05)
        assert gw.state.registry.get(sim.url) is not first
        text = await gateway_metrics(http, gw)
        after = metric_value(text, "llm_gateway_requests_total", endpoint=name)
        assert after is not None and after >= served, (
            f"the live endpoint's request counter went from {served} to {after}: "
            "the old stream's end forgot the re-joined endpoint's series"
        )
