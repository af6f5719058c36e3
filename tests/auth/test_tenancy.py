"""API keys, tenants and their limits through the real gateway, with the real ``openai`` client and Redis."""

from __future__ import annotations

import asyncio

import openai
import pytest
import redis.asyncio as aioredis
import yaml

from gateway.auth import Tenant, hash_key
from gateway.auth.redis_keys import add_key
from gateway.http.reload import apply_config
from tests.prefix.conftest import key_prefix, redis_url
from tests.support.harness import chat_body, gateway_metrics, metric_value

__all__ = ["key_prefix", "redis_url"]  # fixtures

KEYS = {
    "tenants": {
        "acme": {"priority": "standard", "models": ["tiny"], "requests_per_minute": 600, "debug": True},
        "bulk": {"priority": "sheddable", "requests_per_minute": 3},
        "other": {"models": ["big"]},
    },
    "keys": [
        {"sha256": hash_key("sk-acme"), "tenant": "acme", "name": "acme-ci"},
        {"sha256": hash_key("sk-bulk"), "tenant": "bulk", "name": "bulk-batch"},
        {"sha256": hash_key("sk-other"), "tenant": "other", "name": "other"},
    ],
}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    return path


def client(gw, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)


async def test_keys_tenants_and_errors_with_the_openai_client(start_upstream, start_gateway, keys_file, http):
    upstream = await start_upstream(models=("tiny", "big"))
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys_file)})

    raw = await client(gw, "sk-acme").chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 599
    assert "x-ratelimit-limit-tokens" not in raw.headers  # acme has no token limit
    assert upstream.requests[-1].headers.get("authorization") is None  # the gateway key stays here

    with pytest.raises(openai.AuthenticationError) as bad:
        await client(gw, "sk-wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )
    assert bad.value.status_code == 401
    assert bad.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await client(gw, "sk-acme").chat.completions.create(
            model="big", messages=[{"role": "user", "content": "x"}]
        )
    assert denied.value.body["code"] == "model_not_allowed"

    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:  # no key at all
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "missing_api_key"
    async with http.get(gw.url + "/v1/models") as resp:
        assert resp.status == 401
    listed = await client(gw, "sk-other").models.list()
    assert [m.id for m in listed.data] == ["big"]  # only what the key may use
    text = await gateway_metrics(http, gw)
    for reason, count in (("invalid_key", 1), ("model_not_allowed", 1), ("missing_key", 2)):
        assert metric_value(text, "llm_gateway_auth_failures_total", reason=reason) == count


async def test_rate_limit_429_with_retry_after_and_headers(start_upstream, start_gateway, keys_file):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys_file)})
    bulk = client(gw, "sk-bulk")
    for _ in range(3):
        await bulk.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as limited:
        await bulk.completions.create(model="tiny", prompt="hello", max_tokens=2)
    response = limited.value.response
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    assert limited.value.body["code"] == "tenant_rate_limit_exceeded"
    assert len(upstream.requests) == 3  # the refused request never reached a replica


async def test_tenant_priority_cannot_be_raised_and_debug_needs_permission(
    start_upstream, start_gateway, keys_file, http
):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys_file)})
    headers = {"authorization": "Bearer sk-bulk", "x-priority": "critical", "x-gateway-debug": "1"}
    async with http.post(
        gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers
    ) as resp:
        assert resp.status == 200
        assert "x-gateway-scores" not in resp.headers  # bulk may not see routing internals
    headers = {"authorization": "Bearer sk-acme", "x-priority": "sheddable", "x-gateway-debug": "1"}
    async with http.post(
        gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers
    ) as resp:
        assert resp.status == 200
        assert "x-gateway-scores" in resp.headers  # acme may
    text = await gateway_metrics(http, gw)
    admitted = "llm_gateway_admission_decisions_total"
    assert metric_value(text, admitted, priority="critical") is None  # the header did not raise bulk
    assert metric_value(text, admitted, priority="sheddable") == 2  # bulk's default; acme lowered itself


async def test_keys_file_hot_reload_keeps_old_keys_on_a_broken_file(start_upstream, start_gateway, keys_file):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys_file)})
    new_keys = {**KEYS, "keys": [*KEYS["keys"], {"sha256": hash_key("sk-new"), "tenant": "acme"}]}
    keys_file.write_text(yaml.safe_dump(new_keys))
    await apply_config(gw.state, gw.state.config.model_copy(update={"policy": "round-robin"}))
    await client(gw, "sk-new").completions.create(model="tiny", prompt="x", max_tokens=1)

    keys_file.write_text("tenants: [not a mapping")
    with pytest.raises(Exception, match="keys_file"):
        await apply_config(gw.state, gw.state.config.model_copy(update={"policy": "least-load"}))
    await client(gw, "sk-new").completions.create(model="tiny", prompt="x", max_tokens=1)  # still valid


async def test_limits_hold_fleet_wide_across_two_gateways_sharing_redis(
    start_upstream, start_gateway, keys_file, redis_url, key_prefix
):
    upstream = await start_upstream()
    auth = {
        "enabled": True,
        "backend": "redis",
        "limits_backend": "redis",
        "redis_url": redis_url,
        "key_prefix": key_prefix,
        "redis_budget_s": 0.5,
    }
    redis = aioredis.from_url(redis_url)
    try:
        await add_key(redis, key_prefix, "sk-shared", Tenant(name="shared", requests_per_minute=10))
    finally:
        await redis.aclose()
    gateways = [await start_gateway([upstream.url], auth=auth) for _ in range(2)]
    clients = [client(gw, "sk-shared") for gw in gateways]

    async def one(i: int) -> int:
        try:
            await clients[i % 2].completions.create(model="tiny", prompt="x", max_tokens=1)
            return 200
        except openai.RateLimitError:
            return 429

    statuses = await asyncio.gather(*(one(i) for i in range(24)))
    assert statuses.count(200) == 10  # one bucket for the tenant, not one per instance
    assert statuses.count(429) == 14
    assert len(upstream.requests) == 10
