"""The same replica named by config and by discovery must be one endpoint, with config's settings.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import asyncio

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import gateway_metrics, metric_value


async def test_config_url_with_user_info_wins_over_the_discovered_url(start_sim, start_gateway, http):
    sim = await start_sim(model="m")
    port = int(sim.url.rsplit(":", 1)[1])
    configured = f"http://svc:secret@127.0.0.1:{port}"
    async with running_dns() as dns:
        dns.set("llm.test.", "A", "127.0.0.1")
        discovery = dns.discovery(port, interval_s=0.05)
        gw = await start_gateway(
            [{"url": configured, "role": "decode", "models": ["m"]}], discovery=discovery
        )
        for _ in range(200):
            text = await gateway_metrics(http, gw)
            if (metric_value(text, "llm_gateway_discovery_updates_total", source="dns:llm.test") or 0) >= 1:
                break
            await asyncio.sleep(0.02)
        endpoints = list(gw.state.registry)
        names = [e.name for e in endpoints]
        assert len(endpoints) == 1, (
            f"one server, {len(endpoints)} endpoints: {[(e.name, e.role.value) for e in endpoints]}"
            f" with names {names}"
        )
