"""Adversarial: key headers, admin key placement, priority escalation — checks that should hold."""

from __future__ import annotations

import json

import yaml

from gateway.auth import hash_key
from tests.support.harness import chat_body

KEYS = {
    "tenants": {"bulk": {"priority": "sheddable"}, "vip": {"priority": "critical"}},
    "keys": [
        {"sha256": hash_key("sk-bulk"), "tenant": "bulk"},
        {"sha256": hash_key("sk-vip"), "tenant": "vip"},
    ],
}


async def gateway(start_upstream, start_gateway, tmp_path):
    upstream = await start_upstream()
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    gw = await start_gateway(
        [upstream.url],
        auth={"enabled": True, "keys_file": str(path), "admin_key_sha256": hash_key("adm")},
        admission={"engine_priority": {"critical": 1, "standard": 5, "sheddable": 9}},
    )
    return upstream, gw


async def test_key_header_variants(start_upstream, start_gateway, tmp_path, http):
    _, gw = await gateway(start_upstream, start_gateway, tmp_path)
    cases = [
        ({"authorization": "Bearer sk-wrong", "x-api-key": "sk-bulk"}, 401),  # Bearer wins, documented
        ({"authorization": "Basic Zm9vOmJhcg==", "x-api-key": "sk-bulk"}, 200),
        ({"authorization": "bearer   sk-bulk  "}, 200),
        ({"x-api-key": "  sk-bulk\t"}, 200),
        ({"authorization": "Bearer "}, 401),
        ({"x-api-key": "sk-" + "x" * 6000}, 401),
        ({"authorization": "Bearer sk-bulk sk-vip"}, 401),
        ({"x-admin-key": "adm"}, 401),  # the admin key is not an API key
    ]
    for headers, expected in cases:
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers) as resp:
            body = await resp.json(content_type=None)
            assert resp.status == expected, (headers, body)
            if expected == 401:
                assert body["error"]["type"] and body["error"]["code"], body


async def test_admin_key_placement(start_upstream, start_gateway, tmp_path, http):
    _, gw = await gateway(start_upstream, start_gateway, tmp_path)
    cases = [
        ({}, 401),
        ({"x-admin-key": "adm"}, 200),
        ({"authorization": "Bearer adm"}, 200),
        ({"x-api-key": "adm"}, 401),
        ({"authorization": "Bearer sk-vip"}, 401),
        ({"authorization": "Bearer wrong", "x-admin-key": "adm"}, 401),
        ({"x-admin-key": "ADM"}, 401),
    ]
    for headers, expected in cases:
        async with http.get(gw.url + "/admin/endpoints", headers=headers) as resp:
            assert resp.status == expected, (headers, await resp.text())


async def test_sheddable_tenant_cannot_raise_itself(start_upstream, start_gateway, tmp_path, http):
    upstream, gw = await gateway(start_upstream, start_gateway, tmp_path)
    for extra, headers in (
        ({}, {"x-priority": "critical"}),
        ({"priority": -100}, {}),
        ({"priority": -100}, {"x-priority": "CRITICAL "}),
    ):
        async with http.post(
            gw.url + "/v1/chat/completions",
            json=chat_body(**extra),
            headers={"authorization": "Bearer sk-bulk", **headers},
        ) as resp:
            assert resp.status == 200, await resp.text()
        assert json.loads(upstream.requests[-1].raw)["priority"] == 9
    async with http.post(
        gw.url + "/v1/chat/completions",
        json=chat_body(),
        headers={"authorization": "Bearer sk-vip", "x-priority": "sheddable"},
    ) as resp:
        assert resp.status == 200
    assert json.loads(upstream.requests[-1].raw)["priority"] == 9  # lowering is allowed


import pytest  # noqa: E402

from gateway.config import ConfigError, load_config  # noqa: E402


@pytest.mark.parametrize("configured", [hash_key("adm") + "\n", "adm"], ids=["trailing-newline", "raw-key"])
async def test_malformed_admin_key_hash_is_refused_or_works(start_upstream, start_gateway, http, configured):
    """The keys file refuses a non-hex sha256 ("not the key itself"); auth.admin_key_sha256 must too,
    or the admin API is silently locked forever."""
    upstream = await start_upstream()
    try:
        load_config(
            overrides={"endpoints": [{"url": upstream.url}], "auth": {"admin_key_sha256": configured}},
            environ={},
        )
    except (ConfigError, ValueError):
        return
    gw = await start_gateway([upstream.url], auth={"admin_key_sha256": configured})
    async with http.get(gw.url + "/admin/endpoints", headers={"x-admin-key": "adm"}) as resp:
        assert resp.status == 200, await resp.text()
