"""Fleet-wide rate limits: the tenant's two token buckets live in Redis, checked by one Lua script.

Key: ``<prefix>:ratelimit:{<tenant>}`` — a HASH ``r`` (requests left), ``t`` (tokens left),
``ts`` (last update, µs of Redis ``TIME``). The ``{tenant}`` hash tag keeps every key of a
tenant in one Redis Cluster slot. The key expires 61 s after its last use: by then both
buckets are full again, which is what a missing key means.

One script call refills both buckets from Redis's own clock (gateway clocks never
matter), then takes a request and the tokens from both or neither — or, for a
settlement, books a token correction clamped to [0, capacity]. It is sent by EVALSHA;
a Redis that lost its script cache (restart, ``SCRIPT FLUSH``, failover) answers NOSCRIPT
and gets the source by EVAL, which caches it again.

Redis slower than ``budget_s`` or down: the check is answered by a local
:class:`~gateway.auth.ratelimit.MemoryRateLimiter` with the same semantics, counted by
``on_fallback``, and Redis is skipped for ``retry_after_s`` before it is tried again
(:class:`~gateway.redis_guard.RedisGuard`). The local buckets start from the levels Redis
last reported, but each instance then enforces the limit alone: during an outage a fleet
of N instances admits up to N times the limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from gateway.auth.ratelimit import UNLIMITED, LimitDecision, MemoryRateLimiter, costs, decide, settle_delta
from gateway.auth.tenant import Tenant
from gateway.redis_guard import RedisGuard

__all__ = ["BUCKET_SCRIPT", "RedisRateLimiter", "bucket_key"]

# ARGV: request capacity, token capacity, request cost, token cost, mode ("take" | "settle"), ttl ms.
# Returns {allowed (1|0), requests left, tokens left}; levels as strings (Lua numbers would be truncated).
BUCKET_SCRIPT = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local rcap, tcap = tonumber(ARGV[1]), tonumber(ARGV[2])
local rcost, tcost = tonumber(ARGV[3]), tonumber(ARGV[4])
local kind = redis.call('TYPE', KEYS[1])
if type(kind) == 'table' then kind = kind['ok'] end
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]) end  -- not ours: start full
local state = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r = tonumber(state[1]) or rcap
local t = tonumber(state[2]) or tcap
local elapsed = math.max(0, now - (tonumber(state[3]) or now)) / 1000000
r = math.min(rcap, r + elapsed * rcap / 60)
t = math.min(tcap, t + elapsed * tcap / 60)
local allowed = 1
if ARGV[5] == 'settle' then
  t = math.max(-tcap, math.min(tcap, t - tcost))  -- ratelimit.settled_level: a debt, a minute's at most
elseif r >= rcost and t >= tcost then
  r = r - rcost
  t = t - tcost
else
  allowed = 0
end
redis.call('HSET', KEYS[1], 'r', r, 't', t, 'ts', now)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]))
return {allowed, tostring(r), tostring(t)}
"""
_SHA = hashlib.sha1(BUCKET_SCRIPT.encode()).hexdigest()
_TTL_MS = 121_000  # a bucket idle this long is full again, from a minute's debt too (settled_level)


def bucket_key(prefix: str, tenant: str) -> str:
    return f"{prefix}:ratelimit:{{{tenant}}}"


class RedisRateLimiter:
    """A :class:`~gateway.auth.ratelimit.RateLimiter` shared by every instance on one Redis and prefix."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = "llmgw",
        budget_s: float = 0.02,
        retry_after_s: float = 1.0,
        on_fallback: Callable[[str], None] | None = None,
        local: MemoryRateLimiter | None = None,
    ) -> None:
        self._client = client
        self._prefix = key_prefix
        self.local = local or MemoryRateLimiter()
        self._guard = RedisGuard(
            "rate limiter", budget_s=budget_s, retry_after_s=retry_after_s, on_fallback=on_fallback
        )

    async def _script(self, tenant: Tenant, request_cost: float, token_cost: float, mode: str) -> Any:
        args = (tenant.requests_per_minute, tenant.tokens_per_minute, request_cost, token_cost, mode, _TTL_MS)
        key = bucket_key(self._prefix, tenant.name)
        try:
            return await self._client.evalsha(_SHA, 1, key, *args)
        except NoScriptError:
            return await self._client.eval(BUCKET_SCRIPT, 1, key, *args)

    async def acquire(self, tenant: Tenant, tokens: int) -> LimitDecision:
        if not tenant.limited:
            return UNLIMITED
        request_cost, token_cost = costs(tenant, tokens)
        result = await self._guard.call(self._script(tenant, request_cost, token_cost, "take"))
        if result is None:
            return self.local.acquire_now(tenant, tokens, source="fallback")
        allowed, requests, available = int(result[0]) == 1, float(result[1]), float(result[2])
        self.local.mirror(tenant, requests, available)
        return decide(tenant, allowed, requests, available, request_cost, token_cost, "redis")

    async def settle(self, tenant: Tenant, charged_tokens: int, actual_tokens: int) -> None:
        delta = settle_delta(tenant, charged_tokens, actual_tokens)
        if delta == 0:
            return
        # After the response: not on a request's critical path, so it may wait a little longer.
        budget = max(self._guard.budget_s, 0.1)
        result = await self._guard.call(self._script(tenant, 0, delta, "settle"), budget_s=budget)
        if result is None:
            self.local.settle_now(tenant, charged_tokens, actual_tokens)
            return
        self.local.mirror(tenant, float(result[1]), float(result[2]))

    async def close(self) -> None:
        await self.local.close()
        await self._client.aclose()
