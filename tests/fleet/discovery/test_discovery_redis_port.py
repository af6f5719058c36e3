"""Discovery must refuse endpoints on the port of a configured Redis URL, as the admin API does.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import asyncio

from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import free_port, gateway_metrics, metric_value


async def test_discovered_endpoint_on_the_configured_redis_port_is_refused(start_gateway, http):
    redis_port = free_port()  # the operator's Redis (here: on a non-default port)
    allowed_port = free_port()
    async with running_dns() as dns:
        dns.set("llm.test.", "A", "127.0.0.1")
        dns.set("ok.test.", "A", "127.0.0.1")  # before the start: the first round finds it
        dns_source = {"name": "llm.test", "record": "A", "nameserver": dns.nameserver, "interval_s": 0.1}
        gw = await start_gateway(
            [],
            sessions={"redis_url": f"redis://127.0.0.1:{redis_port}/0"},
            discovery={
                "dns": [
                    {**dns_source, "port": redis_port},
                    {**dns_source, "name": "ok.test", "port": allowed_port},
                ]
            },
        )
        # Both sources have applied at least once.
        for _ in range(300):
            text = await gateway_metrics(http, gw)
            if all(
                (metric_value(text, "llm_gateway_discovery_updates_total", source=f"dns:{n}") or 0) >= 1
                for n in ("llm.test", "ok.test")
            ):
                break
            await asyncio.sleep(0.02)
        urls = {e.url for e in gw.state.registry}
        assert f"http://127.0.0.1:{allowed_port}" in urls  # the control: discovery works
        assert f"http://127.0.0.1:{redis_port}" not in urls, "an endpoint on the gateway's Redis port joined"
