"""Adversarial: limits under concurrency, and token charges of failed / cut requests."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
import redis
import yaml

from gateway.auth import hash_key
from tests.support.harness import chat_body

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix():
    p = f"advauth-{uuid.uuid4().hex[:10]}"
    yield p
    c = redis.Redis.from_url(URL)
    keys = list(c.scan_iter(match=f"{p}:*"))
    if keys:
        c.delete(*keys)
    c.close()


def keys_file(tmp_path, **limits):
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump({"tenants": {"t": limits}, "keys": [{"sha256": hash_key("sk-t"), "tenant": "t"}]})
    )
    return str(path)


async def limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, **limits):
    """A gateway whose one tenant ``t`` (key ``sk-t``) has ``limits``, kept in memory or Redis."""
    auth = {"enabled": True, "keys_file": keys_file(tmp_path, **limits), "limits_backend": backend}
    auth |= {"redis_url": URL, "key_prefix": prefix, "redis_budget_s": 1.0}
    return await start_gateway([upstream.url], auth=auth)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_concurrent_burst_admits_exactly_the_limit(
    start_upstream, start_gateway, http, tmp_path, prefix, backend
):
    upstream = await start_upstream()
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, requests_per_minute=10)

    async def one() -> int:
        async with http.post(
            gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer sk-t"}
        ) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(one() for _ in range(40)))
    assert statuses.count(200) == 10 and statuses.count(429) == 30, statuses


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_failed_request_refunds_its_tokens_once(
    start_upstream, start_gateway, http, tmp_path, prefix, backend
):
    upstream = await start_upstream()
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, tokens_per_minute=1000)
    upstream.mode = "status"
    upstream.status = 400
    for _ in range(5):  # each charges ~600 up front; each is refunded in full
        async with http.post(
            gw.url + "/v1/chat/completions",
            json=chat_body(max_tokens=600),
            headers={"authorization": "Bearer sk-t"},
        ) as resp:
            assert resp.status == 400, await resp.text()
            remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
        await asyncio.sleep(0.05)
        assert remaining >= 390, remaining  # one charge at a time, never two


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_client_cut_stream_charges_what_was_streamed(
    start_upstream, start_gateway, tmp_path, prefix, backend
):
    upstream = await start_upstream()
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, tokens_per_minute=100_000)
    upstream.mode = "hold"
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.url + "/v1/chat/completions",
            json=chat_body(stream=True, max_tokens=50_000),
            headers={"authorization": "Bearer sk-t"},
        )
        await resp.content.readany()
        resp.close()  # the client leaves mid-stream
    upstream.mode = "ok"
    await asyncio.sleep(0.5)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gw.url + "/v1/chat/completions",
            json=chat_body(max_tokens=1),
            headers={"authorization": "Bearer sk-t"},
        ) as resp:
            remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    # the cut request is settled to what was streamed (a few tokens), not kept at 50k
    assert remaining > 90_000, remaining
