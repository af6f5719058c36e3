"""A discovery source that keeps failing must show in /metrics, not only in the log.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

from tests.fleet.discovery.apiserver import running_apiserver
from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import gateway_metrics, metric_value, wait_until


def _failure_samples(text: str, source: str) -> float:
    """``llm_gateway_discovery_failures_total`` of this source."""
    return metric_value(text, "llm_gateway_discovery_failures_total", source=source) or 0.0


async def test_dns_failures_are_counted(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    async with running_dns() as dns:
        dns.mode = "servfail"
        discovery = {
            "dns": [
                {
                    "name": "llm.test",
                    "record": "A",
                    "port": 8000,
                    "nameserver": dns.nameserver,
                    "interval_s": 0.05,
                }
            ]
        }
        gw = await start_gateway([upstream.url], discovery=discovery)
        await dns.wait_asked("llm.test.", 3, within_s=5.0)  # at least three failed rounds
        text = await gateway_metrics(http, gw)
        assert _failure_samples(text, "dns:llm.test") >= 1, "no metric counts the failing DNS source"


async def test_kubernetes_failures_are_counted(start_upstream, start_gateway, http, tmp_path):
    upstream = await start_upstream()
    token = tmp_path / "token"
    token.write_text("t")
    async with running_apiserver("llm") as api:
        api.list_status = 403
        discovery = {
            "kubernetes": {
                "namespace": "llm",
                "api_server": api.url,
                "token_file": str(token),
                "ca_file": None,
            }
        }
        gw = await start_gateway([upstream.url], discovery=discovery)
        await api.wait_lists(2)

        async def counted() -> bool:
            return _failure_samples(await gateway_metrics(http, gw), "kubernetes:llm/") >= 1

        await wait_until(counted, 2.0, "a metric counting the failing Kubernetes source")
