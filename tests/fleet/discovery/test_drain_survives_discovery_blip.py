"""An admin drain of a discovered endpoint must survive that endpoint dropping out and back.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import chat_body, wait_until
from tests.web.test_admin import ADMIN, AUTH


async def test_drain_of_a_discovered_endpoint_survives_a_blip(start_sim, start_gateway, http):
    kept = await start_sim(model="m")
    drained = await start_sim(model="m")
    port = int(drained.url.rsplit(":", 1)[1])
    async with running_dns() as dns:
        dns.set("llm.test.", "A", "127.0.0.1")
        discovery = dns.discovery(port, interval_s=0.05)
        gw = await start_gateway([kept.url], auth=AUTH, discovery=discovery, policy="round-robin")

        async def joined() -> bool:
            e = gw.state.registry.get(drained.url)
            return e is not None and e.healthy

        await wait_until(joined, 3.0, "the discovered endpoint to be healthy")
        async with http.post(
            gw.url + "/admin/endpoints/drain", json={"url": drained.url}, headers=ADMIN
        ) as r:
            assert r.status == 200 and (await r.json())["draining"] is True

        dns.set("llm.test.", "A")  # a blip: the record is gone for an interval ...

        async def gone() -> bool:
            return gw.state.registry.get(drained.url) is None

        await wait_until(gone, 3.0, "the endpoint to drop out")
        dns.set("llm.test.", "A", "127.0.0.1")  # ... and back
        await wait_until(joined, 3.0, "the endpoint to come back")

        served = set()
        for _ in range(6):
            async with http.post(gw.url + "/v1/chat/completions", json=chat_body(model="m")) as resp:
                assert resp.status == 200
                served.add(resp.headers["x-gateway-endpoint"])
        assert gw.state.registry.get(drained.url).draining, "the drain was silently undone"
        assert drained.url.split("://")[1] not in served
