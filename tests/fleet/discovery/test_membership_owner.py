"""An endpoint's source must be the source that names it now, not the first that ever did.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import asyncio

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import wait_until
from tests.web.test_admin import ADMIN, AUTH


async def test_endpoint_left_to_discovery_reports_discovery_as_its_source(start_sim, start_gateway, http):
    config_sim = await start_sim(model="m")
    shared = await start_sim(model="m")
    port = int(shared.url.rsplit(":", 1)[1])
    async with running_dns() as dns:
        discovery = dns.discovery(port, interval_s=0.05)
        gw = await start_gateway([config_sim.url], auth=AUTH, discovery=discovery)
        async with http.post(gw.url + "/admin/endpoints", json={"url": shared.url}, headers=ADMIN) as resp:
            assert resp.status == 201, await resp.text()
        dns.set("llm.test.", "A", "127.0.0.1")  # DNS now names the same URL, same settings
        await wait_until(lambda: _true(dns.asked("llm.test.") >= 3), 3.0, "DNS to be asked a few times")
        async with http.delete(
            gw.url + "/admin/endpoints", params={"url": shared.url}, headers=ADMIN
        ) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.2)
        rows = await _rows(http, gw)
        assert shared.url in rows  # still named by DNS: it stays (right)
        assert rows[shared.url]["source"] == "dns:llm.test", (
            f"source is {rows[shared.url]['source']!r}; only DNS names it now"
        )


async def _true(value: bool) -> bool:
    return value


async def _rows(http, gw) -> dict:
    async with http.get(gw.url + "/admin/endpoints", headers=ADMIN) as resp:
        assert resp.status == 200
        return {r["url"]: r for r in (await resp.json())["endpoints"]}
