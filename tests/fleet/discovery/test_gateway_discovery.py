"""Discovery wired into a running gateway: pods and DNS records become routable endpoints, live."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.fleet.discovery.apiserver import make_pod, running_apiserver
from tests.fleet.discovery.dnsserver import running_dns
from tests.support.harness import chat_body, debug_endpoints, wait_until


def pod_for(name: str, sim_url: str, **kw) -> dict:
    port = sim_url.rsplit(":", 1)[1]
    return make_pod(name, "127.0.0.1", annotations={"llm-gateway.io/port": port}, **kw)


async def served_by(http: aiohttp.ClientSession, gw_url: str) -> str:
    async with http.post(gw_url + "/v1/chat/completions", json=chat_body(model="m")) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-gateway-endpoint"]


async def test_pods_join_and_leave_without_dropping_in_flight_requests(
    start_sim, start_gateway, http, tmp_path
):
    a = await start_sim(model="m", time_scale=1.0, decode_step_ms=10.0)
    b = await start_sim(model="m")
    token = tmp_path / "token"
    token.write_text("sa-token")
    async with running_apiserver("llm") as api:
        api.put(pod_for("vllm-a", a.url, labels={"llm-d.ai/role": "both"}))
        discovery = {
            "kubernetes": {
                "namespace": "llm",
                "label_selector": "app=vllm",
                "api_server": api.url,
                "token_file": str(token),
                "ca_file": None,
            }
        }
        gw = await start_gateway([], discovery=discovery, policy="round-robin")
        await wait_until(lambda: _routable(http, gw.url, {a.url}), 3.0, "the first pod to be routable")
        assert (await debug_endpoints(http, gw))[a.url]["source"].startswith("kubernetes")

        api.put(pod_for("vllm-b", b.url, ready=False))  # not ready: not an endpoint yet
        await asyncio.sleep(0.3)
        assert set(await debug_endpoints(http, gw)) == {a.url}
        api.put(pod_for("vllm-b", b.url))
        await wait_until(lambda: _routable(http, gw.url, {a.url, b.url}), 3.0, "the second pod to join")

        # A long stream on pod a; then pod a is deleted. The stream still completes.
        long_body = chat_body(model="m", stream=True, max_tokens=100)
        async with http.post(gw.url + "/v1/chat/completions", json=long_body) as resp:
            first_endpoint = resp.headers["x-gateway-endpoint"]
            if first_endpoint != a.url.split("://")[1]:  # round-robin: make sure the stream is on a
                await resp.read()
                resp = await http.post(gw.url + "/v1/chat/completions", json=long_body)
            assert resp.headers["x-gateway-endpoint"] == a.url.split("://")[1]
            await resp.content.readline()
            api.delete("vllm-a")
            await wait_until(lambda: _routable(http, gw.url, {b.url}), 3.0, "the deleted pod to leave")
            text = (await resp.read()).decode()
        assert text.rstrip().endswith("data: [DONE]") and "error" not in text
        for _ in range(3):
            assert await served_by(http, gw.url) == b.url.split("://")[1]
        assert gw.state.registry.get(a.url) is None
        assert api.watches[-1].authorization == "Bearer sa-token"


async def test_dns_records_become_endpoints(start_sim, start_gateway, http):
    sim = await start_sim(model="m")
    port = int(sim.url.rsplit(":", 1)[1])
    async with running_dns() as dns:
        dns.set("llm.test.", "A", "127.0.0.1")
        discovery = dns.discovery(port, interval_s=0.1)
        gw = await start_gateway([], discovery=discovery)
        await wait_until(
            lambda: _routable(http, gw.url, {sim.url}), 3.0, "the resolved address to be routable"
        )
        dns.set("llm.test.", "A")  # the record goes away: no endpoints
        await wait_until(lambda: _routable(http, gw.url, set()), 3.0, "the endpoint to leave")
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(model="m")) as resp:
            assert resp.status in (404, 503)
            assert (await resp.json())["error"]["code"] in ("model_not_found", "no_healthy_endpoint")


async def _routable(http: aiohttp.ClientSession, gw_url: str, urls: set[str]) -> bool:
    async with http.get(gw_url + "/debug/endpoints") as resp:
        rows = (await resp.json())["endpoints"]
    return {r["url"] for r in rows} == urls and all(r["healthy"] for r in rows)
