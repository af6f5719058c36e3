"""Admin values that cannot be used are refused with a 400 when given, not found out later
(found by review, 2026-12-05): a URL that cannot be parsed answered 500 on drain, undrain and
delete; an API key with a line end was accepted, and its replica then never passed a health
probe (every request to it failed inside the HTTP client, logged at debug only)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, EndpointConfig
from gateway.fleet.registry import upstream_auth_header
from tests.support.edge_cases import ADMIN, ADMIN_SHA


async def test_an_unparsable_url_is_a_400_on_every_admin_route(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"admin_key_sha256": ADMIN_SHA})
    calls = [
        ("post", "/admin/endpoints/drain", {"json": {"url": "http://[::1"}}),
        ("post", "/admin/endpoints/undrain", {"json": {"url": "http://[::1"}}),
        ("delete", "/admin/endpoints", {"params": {"url": "http://[::1"}}),
        ("post", "/admin/endpoints", {"json": {"url": "http://[::1"}}),
    ]
    for method, path, given in calls:
        async with http.request(method, gw.url + path, headers=ADMIN, **given) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400, (method, path, resp.status, error)
            assert error["code"] == "invalid_admin_request", error
    async with http.post(
        gw.url + "/admin/endpoints/drain", json={"url": "http://h:1"}, headers=ADMIN
    ) as resp:
        assert resp.status == 404  # a well-formed URL the gateway does not know: still not found
    assert [e.url for e in gw.state.registry] == [upstream.url] and not gw.state.registry.get(
        upstream.url
    ).draining


@pytest.mark.parametrize("key", ["secret\r\n", "sec\nret", "a b", "\x00", "clé"])
async def test_an_api_key_that_cannot_be_a_header_is_refused(key, start_upstream, start_gateway, http):
    upstream, other = await start_upstream(), await start_upstream()
    gw = await start_gateway([upstream.url], auth={"admin_key_sha256": ADMIN_SHA})
    body = {"url": other.url, "models": ["tiny"], "api_key": key}
    async with http.post(gw.url + "/admin/endpoints", json=body, headers=ADMIN) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, (resp.status, error)
        assert "api_key" in error["message"], error
    assert [e.url for e in gw.state.registry] == [upstream.url]
    body["api_key"] = "secret-1"  # a usable key is taken, and its replica is probed
    async with http.post(gw.url + "/admin/endpoints", json=body, headers=ADMIN) as resp:
        assert resp.status == 201, await resp.text()


def test_a_key_file_with_a_line_end_inside_is_a_config_error(tmp_path):
    path = tmp_path / "key"
    path.write_text("first\nsecond\n")
    with pytest.raises(ConfigError, match="api_key_file"):
        upstream_auth_header(EndpointConfig(url="http://127.0.0.1:9", api_key_file=str(path)))
    path.write_text("token-1\n")  # a trailing line end is the file's, not the key's
    assert (
        upstream_auth_header(EndpointConfig(url="http://127.0.0.1:9", api_key_file=str(path)))
        == "Bearer token-1"
    )
