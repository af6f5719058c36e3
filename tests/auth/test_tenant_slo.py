"""Per-tenant latency objectives, end to end through a gateway with auth on.

A request without ``x-slo-*`` headers takes its tenant's objectives (keys file), else the
defaults of the priority the tenant gives it — not of the priority its headers named before
the tenant was known. Observable as ``llm_gateway_slo_requests_total{priority,result}``,
counted at each streamed answer's first byte against its deadline: a 60 s objective is met,
a 1 ms one missed, a request with no objective not counted at all.
"""

from __future__ import annotations

import aiohttp
import pytest
import yaml

from gateway.auth import hash_key
from gateway.auth.tenant import TenantSpec
from tests.support.harness import gateway_metrics, metric_value

KEYS = {"relaxed": "sk-relaxed", "plain": "sk-plain", "vip": "sk-vip"}


def _keys_file(path) -> str:
    tenants = {
        "relaxed": {"slo_ttft_ms": 60_000},  # its own objective, standard priority
        "plain": {},  # no objective of its own, standard: the class has none either
        "vip": {"priority": "critical"},  # no objective of its own: critical's default applies
    }
    keys = [{"sha256": hash_key(key), "tenant": tenant} for tenant, key in KEYS.items()]
    path.write_text(yaml.safe_dump({"tenants": tenants, "keys": keys}))
    return str(path)


async def _stream(http: aiohttp.ClientSession, url: str, tenant: str, **headers: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    headers = {"authorization": f"Bearer {KEYS[tenant]}", **headers}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


def _slo_count(text: str, priority: str, result: str) -> float:
    return metric_value(text, "llm_gateway_slo_requests_total", priority=priority, result=result) or 0.0


async def test_requests_take_their_tenants_objectives_then_their_tenants_class_defaults(
    start_upstream, start_gateway, http, tmp_path
):
    upstream = await start_upstream(models=("m",))
    gw = await start_gateway(
        [upstream.url],
        auth={"enabled": True, "keys_file": _keys_file(tmp_path / "keys.yaml")},
        admission={"slo": {"defaults": {"critical": {"ttft_ms": 0.001}}}},  # never met: counted as missed
    )
    await _stream(http, gw.url, "relaxed")
    await _stream(http, gw.url, "plain")
    await _stream(http, gw.url, "vip")  # no x-priority: the tenant's critical, and critical's default
    await _stream(http, gw.url, "relaxed", **{"x-slo-ttft-ms": "0.001"})  # a header beats the tenant's
    text = await gateway_metrics(http, gw)
    assert _slo_count(text, "standard", "met") == 1  # relaxed's 60 s; plain has no objective
    assert _slo_count(text, "standard", "missed") == 1  # relaxed with its header's 1 µs
    assert _slo_count(text, "critical", "missed") == 1  # before: parsed as standard, no objective


def test_tenant_objectives_are_validated_like_the_headers():
    assert TenantSpec(slo_ttft_ms=500).to_tenant("t").slo_objectives == (500, None)
    assert TenantSpec.from_tenant(TenantSpec(slo_tpot_ms=40).to_tenant("t")).slo_tpot_ms == 40
    for bad in (0, -1, 3_600_001, "fast"):
        with pytest.raises(ValueError, match="slo_ttft_ms"):
            TenantSpec(slo_ttft_ms=bad)
