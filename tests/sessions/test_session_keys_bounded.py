"""Session ids are hashed before they are stored: a huge ``user`` field is not a huge key.

Regression: with a session-keyed policy, 80 requests whose body ``user`` was 1 MB each
took the gateway's RSS from 63 to 147 MB — each pin was keyed by the raw value (up to
the 16 MB body limit) for 30 minutes, in memory and in Redis.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.request.parse import session_key
from tests.prefix.conftest import key_prefix, redis_url

__all__ = ["key_prefix", "redis_url"]  # fixtures

HUGE = "u" * 1_000_000


def _body(user: str, turn: int) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"turn {turn}"}],
        "max_tokens": 2,
        "user": user,
    }


async def test_a_megabyte_user_field_is_stored_as_a_32_digit_key_and_still_sticks(
    start_sim, start_gateway, http
):
    sims = [await start_sim(model="m") for _ in range(3)]
    gw = await start_gateway([s.url for s in sims], policy="session-aware")
    served = []
    for turn in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=_body(HUGE + "a", turn)) as resp:
            assert resp.status == 200
            served.append(resp.headers["x-gateway-endpoint"])
    async with http.post(gw.url + "/v1/chat/completions", json=_body(HUGE + "b", 0)) as resp:
        assert resp.status == 200
    assert len(set(served)) == 1  # the conversation stuck to one replica
    keys = list(gw.state.sessions.store._pins)
    assert len(keys) == 2
    assert all(len(k) == 32 for k in keys), [len(k) for k in keys]
    assert session_key(HUGE + "a") in keys


async def test_redis_session_keys_are_bounded_too(start_sim, start_gateway, http, redis_url, key_prefix):
    sims = [await start_sim(model="m") for _ in range(2)]
    sessions = {"backend": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "redis_budget_s": 0.5}
    gw = await start_gateway([s.url for s in sims], policy="session-aware", sessions=sessions)
    async with http.post(gw.url + "/v1/chat/completions", json=_body(HUGE, 0)) as resp:
        assert resp.status == 200
    redis = aioredis.from_url(redis_url)
    try:
        for _ in range(50):
            keys = [k async for k in redis.scan_iter(match=f"{key_prefix}:session:*")]
            if keys:
                break
            import asyncio

            await asyncio.sleep(0.02)
        assert keys and all(len(k) < 100 for k in keys), keys
    finally:
        await redis.aclose()
