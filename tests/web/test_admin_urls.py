"""Admin-added endpoint URLs are validated strictly, and run-time endpoints must lie in the
allowed networks (link-local refused by default): 400s in the gateway's JSON error format.

Regression: ``POST /admin/endpoints`` accepted ``\\r\\n`` and spaces (a request split in the
upstream request line), port 99999, the cloud metadata address 169.254.169.254 and the
Redis port, so an admin key was enough to aim the gateway anywhere.
"""

from __future__ import annotations

from gateway.config import DiscoveryConfig, EndpointConfig
from gateway.fleet.discovery import NetworkFiltered
from gateway.fleet.discovery.source import no_op
from gateway.fleet.networks import EndpointNetworks
from tests.web.test_admin import ADMIN, AUTH

BAD_URLS = [
    "http://127.0.0.1:8000\r\nX-Injected: 1",
    "http://127.0.0.1:8000/v1 x",
    "http://127.0.0.1 :8000",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://:8000",
    "ftp://127.0.0.1:8000",
    "http://127.0.0.1:8000/?q=1",
    "http://169.254.169.254/latest/meta-data",
    "http://169.254.169.254:80",
    "http://[fe80::1]:8000",
    "http://[::ffff:169.254.169.254]:8000",
    "http://127.0.0.1:6379",
]


async def _add(http, gw, url: str) -> tuple[int, dict]:
    async with http.post(gw.url + "/admin/endpoints", json={"url": url}, headers=ADMIN) as resp:
        return resp.status, await resp.json()


async def test_bad_urls_are_400_in_the_json_error_format(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth=AUTH)
    for url in BAD_URLS:
        status, body = await _add(http, gw, url)
        assert status == 400, (url, body)
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_admin_request", url
        assert error["message"].startswith("url"), (url, error)
    assert len(gw.state.registry) == 1
    status, _ = await _add(http, gw, (await start_upstream()).url)  # a good one still goes in
    assert status == 201


async def test_allowed_networks_bound_admin_added_endpoints(start_upstream, start_gateway, http):
    upstream, other = await start_upstream(), await start_upstream()
    closed = await start_gateway([upstream.url], auth=AUTH, discovery={"allowed_networks": ["10.0.0.0/8"]})
    status, body = await _add(http, closed, other.url)
    assert status == 400 and "allowed_networks" in body["error"]["message"]
    status, body = await _add(http, closed, f"http://localhost:{other.port}")  # names are resolved
    assert status == 400 and "allowed_networks" in body["error"]["message"]

    opened = await start_gateway([upstream.url], auth=AUTH, discovery={"allowed_networks": ["127.0.0.0/8"]})
    assert (await _add(http, opened, other.url))[0] == 201
    metadata = await start_gateway(
        [upstream.url], auth=AUTH, discovery={"allowed_networks": ["0.0.0.0/0"], "allow_link_local": True}
    )
    assert (await _add(http, metadata, "http://169.254.169.254:8000"))[0] == 201


async def test_discovered_endpoints_outside_the_allowed_networks_are_dropped():
    class Source:
        name = "dns:test"
        on_failure = staticmethod(no_op)

        async def run(self, apply) -> None:
            apply(
                self.name, [EndpointConfig(url=u) for u in ("http://10.1.2.3:8000", "http://10.9.9.9:8000")]
            )
            apply(self.name, [EndpointConfig(url="http://169.254.169.254:80")])

    calls: list[list[str]] = []
    config = DiscoveryConfig(allowed_networks=["10.1.0.0/16", "169.254.0.0/16"])
    await NetworkFiltered(Source(), EndpointNetworks.from_config(config)).run(
        lambda _, endpoints: calls.append([e.url for e in endpoints])
    )
    assert calls == [["http://10.1.2.3:8000"], []]  # link-local stays refused unless allowed
