"""Adversarial: odd API-key bytes, odd keys-file values, through a real gateway."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from gateway.auth import hash_key
from gateway.auth.keyfile import KeyFileError, load_keys_file
from tests.support.harness import chat_body


def keys_yaml(tmp_path, tenants, keys):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants, "keys": keys}))
    return path


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send raw bytes (headers that aiohttp's client would refuse to build) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data


def _head(path: str, headers: list[bytes], body: bytes) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1".encode(),
        b"Host: 127.0.0.1",
        b"Content-Type: application/json",
        f"Content-Length: {len(body)}".encode(),
        b"Connection: close",
        *headers,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.parametrize("header", [b"Authorization: Bearer sk-\xff\xfe", b"x-api-key: sk-\xc3\x28"])
async def test_non_utf8_api_key_is_a_401_not_a_500(start_upstream, start_gateway, tmp_path, header):
    upstream = await start_upstream()
    path = keys_yaml(tmp_path, {"acme": {}}, [{"sha256": hash_key("sk-good"), "tenant": "acme"}])
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(path)})
    port = int(gw.url.rsplit(":", 1)[1])
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    status, data = await raw_request(port, _head("/v1/chat/completions", [header], body), body)
    assert status == 401, data[:400]
    # and the gateway keeps serving
    status, data = await raw_request(
        port, _head("/v1/chat/completions", [b"Authorization: Bearer sk-good"], body), body
    )
    assert status == 200, data[:400]


async def test_non_utf8_admin_key_is_a_401_not_a_500(start_upstream, start_gateway, tmp_path):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"admin_key_sha256": hash_key("admin-secret")})
    port = int(gw.url.rsplit(":", 1)[1])
    head = b"GET /admin/endpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-admin-key: adm\xff\r\n\r\n"
    status, data = await raw_request(port, head)
    assert status == 401, data[:400]


def test_boolean_rate_limit_is_refused_like_the_slo_fields(tmp_path):
    # `requests_per_minute: yes` is YAML for true; the SLO fields refuse booleans, the limits take them as 1.
    path = keys_yaml(
        tmp_path, {"acme": {"requests_per_minute": True}}, [{"sha256": hash_key("k"), "tenant": "acme"}]
    )
    with pytest.raises(KeyFileError):
        load_keys_file(path)


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute"])
async def test_astronomical_limit_is_refused_at_load_or_served(
    start_upstream, start_gateway, tmp_path, http, field
):
    """A limit too large for a float passes validation; every request of the tenant must not then be a 500."""
    tenants = {"acme": {field: 10**400}}
    path = keys_yaml(tmp_path, tenants, [{"sha256": hash_key("sk-good"), "tenant": "acme"}])
    try:
        load_keys_file(path)
    except KeyFileError:
        return  # refused at load with a clear message: fine
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(path)})
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer sk-good"}
    ) as resp:
        assert resp.status == 200, await resp.text()
