"""A tenant pays for what its requests cost the engines (review findings, each failing before).

- usage past the up-front charge is a debt the next requests wait out (it was forgiven at 0:
  requests without ``max_tokens`` that used 6,000 tokens each passed 3x a 6,000/min limit);
- ``n`` and ``best_of`` multiply the completion estimate (each choice is generated);
- a client that gives up on an answer it was waiting for pays for the prompt the replica took;
- every answer after the limit check carries the tenant's ``x-ratelimit-*`` headers (a 404 for an
  unknown model did not, though its request was counted).
Real gateway, real replica, memory and Redis buckets.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.auth.ratelimit import MemoryRateLimiter
from gateway.auth.tenant import Tenant
from tests.auth.test_hostile_limits_accounting import keys_file, limited_gateway, prefix
from tests.support.harness import chat_body

__all__ = ["prefix"]  # the fixture, used here

AUTH = {"authorization": "Bearer sk-t"}


def _chat_answer(prompt_tokens: int, completion_tokens: int) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return json.dumps({"id": "c1", "object": "chat.completion", "choices": [], "usage": usage}).encode()


async def _post(
    http: aiohttp.ClientSession, gw, path: str = "/v1/chat/completions", **body
) -> aiohttp.ClientResponse:
    async with http.post(gw.url + path, json=body or chat_body(max_tokens=5), headers=AUTH) as resp:
        await resp.read()
        return resp


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_usage_past_the_charge_is_a_debt(
    start_upstream, start_gateway, http, tmp_path, prefix, backend
):
    upstream = await start_upstream()
    upstream.mode, upstream.status = "status", 200
    upstream.body, upstream.content_type = _chat_answer(10, 1190), "application/json"  # 2x the limit
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, tokens_per_minute=600)
    assert (await _post(http, gw)).status == 200  # charged ~10 up front, used 1,200
    await asyncio.sleep(1.5)  # 15 tokens refilled: enough for the next charge, had the debt been forgiven
    resp = await _post(http, gw)
    assert resp.status == 429  # old: 200
    assert int(resp.headers["Retry-After"]) >= 30  # ~a minute's debt to wait out
    assert resp.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_n_multiplies_the_completion_estimate(start_upstream, start_gateway, http, tmp_path, prefix):
    upstream = await start_upstream()
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, "memory", tokens_per_minute=1000)
    resp = await _post(http, gw, **chat_body(max_tokens=200, n=4))
    assert resp.status == 200
    assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 200  # 4 x 200 charged; old: ~790


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_client_that_gives_up_pays_for_the_prompt(
    start_upstream, start_gateway, http, tmp_path, prefix, backend
):
    upstream = await start_upstream()
    upstream.mode = "hold"  # the replica takes the request and answers nothing
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, backend, tokens_per_minute=10_000)
    # ~2,500 tokens estimated (10,000 characters), 10 of completion
    body = {**chat_body(max_tokens=10), "messages": [{"role": "user", "content": "word " * 2000}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as impatient:
        with pytest.raises(TimeoutError):
            await impatient.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert len(upstream.requests) == 1
    await asyncio.sleep(0.5)  # the gateway sees the client go, and settles off the response path
    upstream.mode = "ok"
    remaining = int(
        (await _post(http, gw, **chat_body(max_tokens=1))).headers["x-ratelimit-remaining-tokens"]
    )
    assert remaining < 8_000, remaining  # old: ~9,990 (the whole charge refunded)
    assert remaining > 6_000, remaining  # the prompt, not the 10 completion tokens nor more


async def test_a_client_that_gives_up_before_its_request_left_the_gateway_pays_nothing(
    start_upstream, start_gateway, http, tmp_path, prefix
):
    """It waited for the replica's only pooled connection (``upstream_connections_per_endpoint``):
    no replica saw it, so the whole charge is refunded (review finding: it was charged its prompt)."""
    upstream = await start_upstream()
    upstream.mode = "hold"
    auth = {"enabled": True, "keys_file": keys_file(tmp_path, tokens_per_minute=10_000)}
    gw = await start_gateway([upstream.url], auth=auth, limits={"upstream_connections_per_endpoint": 1})
    holder = asyncio.create_task(
        http.post(gw.url + "/v1/chat/completions", json=chat_body(max_tokens=1), headers=AUTH)
    )
    for _ in range(100):
        if upstream.requests:
            break
        await asyncio.sleep(0.02)
    body = {**chat_body(max_tokens=10), "messages": [{"role": "user", "content": "word " * 2000}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as impatient:
        with pytest.raises(TimeoutError):
            await impatient.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH)
    holder.cancel()
    await asyncio.sleep(0.5)
    upstream.mode = "ok"
    assert len(upstream.requests) == 1  # the impatient request never reached the replica
    remaining = int(
        (await _post(http, gw, **chat_body(max_tokens=1))).headers["x-ratelimit-remaining-tokens"]
    )
    assert remaining > 9_500, remaining  # old: ~7,700 (its ~2,500-token prompt estimate kept)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_errors_after_the_limit_carry_the_ratelimit_headers(
    start_upstream, start_gateway, http, tmp_path, prefix, path
):
    upstream = await start_upstream()
    gw = await limited_gateway(start_gateway, upstream, tmp_path, prefix, "memory", requests_per_minute=100)
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    resp = await _post(http, gw, path, **body)
    assert resp.status == 404
    assert resp.headers.get("x-ratelimit-remaining-requests") == "99"  # old: absent
    assert resp.headers.get("x-ratelimit-limit-requests") == "100"


def test_a_debt_outlives_a_minute_idle_among_many_tenants() -> None:
    """A bucket idle for a minute was taken for full and dropped when the tenant table was full:
    a minute's debt needs two minutes to refill (the Redis key's TTL is two minutes too)."""
    now = [-100.0]
    limiter = MemoryRateLimiter(clock=lambda: now[0], max_tenants=2)
    idle, debtor, newcomer = (Tenant(name, tokens_per_minute=600) for name in ("idle", "debtor", "newcomer"))
    assert limiter.acquire_now(idle, 10).allowed  # idle since -100 s: full again by now
    now[0] = 0.0
    assert limiter.acquire_now(debtor, 10).allowed
    limiter.settle_now(debtor, 10, 1_210)  # a minute's debt: -600
    now[0] = 90.0
    assert limiter.acquire_now(newcomer, 10).allowed  # the table is full: full buckets are dropped
    decision = limiter.acquire_now(debtor, 10)
    assert decision.allowed and decision.remaining_tokens == 290  # -600 + 900 refilled - 10; old: 590
