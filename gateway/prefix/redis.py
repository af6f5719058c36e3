"""Redis-backed prefix index, shared by every gateway instance, with a local fallback.

Key layout (all keys of one model share the hash tag ``{<model>}``, so one request's
keys sit in one Redis Cluster slot and a single script call answers a match):

    <prefix>:{<model>}:ep:<endpoint>   ZSET  member = 8-byte big-endian block hash
                                          score  = last use in µs since epoch, minus the block's
                                                   position (the root is the newest block)

``record`` (Lua, atomic) adds a request's blocks with the root newest (``ZADD GT``:
scores never go down, so "parent at least as recent as child" holds), drops entries
older than the TTL, trims the set to the endpoint's capacity (oldest first) and sets
the key's TTL. ``match`` (Lua) binary-searches each endpoint's longest prefix, so it
costs O(endpoints × log blocks) Redis operations in one round trip.

The local :class:`MemoryPrefixIndex` sees every decision this instance makes; when
Redis is slow or down, ``match`` answers from it under the shared fallback policy of
:class:`gateway.redis_guard.RedisGuard` (budget, skip window, log once, count, writes
in the background) — a request never fails because of Redis.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from gateway.prefix.memory import MemoryPrefixIndex
from gateway.redis_guard import RedisGuard

__all__ = ["RedisPrefixIndex", "endpoint_key"]

# ARGV[2] is every block hash packed into one string, 8 bytes each: one argument to
# encode instead of hundreds, which is most of the client-side cost of a call.
_MATCH = """
local min_score = tonumber(ARGV[1])
local blob = ARGV[2]
local n = #blob / 8
local result = {}
local function present(key, i)
  local score = redis.call('ZSCORE', key, string.sub(blob, i * 8 - 7, i * 8))
  return score and tonumber(score) >= min_score
end
for k = 1, #KEYS do
  local low, high = 0, n
  -- Most endpoints hold nothing of a given prompt: answer those with one lookup.
  if n == 0 or not present(KEYS[k], 1) then high = 0 end
  while low < high do
    local mid = math.floor((low + high + 1) / 2)
    if present(KEYS[k], mid) then low = mid else high = mid - 1 end
  end
  result[k] = low
end
return result
"""

_RECORD = """
local now = tonumber(ARGV[1])
local ttl_us = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3])
local blob = ARGV[4]
local n = #blob / 8
local args = {}
for i = 1, n do
  args[#args + 1] = now - i
  args[#args + 1] = string.sub(blob, i * 8 - 7, i * 8)
end
for start = 1, #args, 4000 do
  -- GT: scores only ever rise (new members are still added), so a parent stays newer
  -- than its children across records, instances and small clock skews.
  redis.call('ZADD', KEYS[1], 'GT', unpack(args, start, math.min(start + 3999, #args)))
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl_us)
local size = redis.call('ZCARD', KEYS[1])
if size > capacity then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, size - capacity - 1)
end
redis.call('PEXPIRE', KEYS[1], math.floor(ttl_us / 1000))
return size
"""


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


def endpoint_key(prefix: str, model: str, endpoint: str) -> str:
    return f"{prefix}:{{{model}}}:ep:{endpoint}"


class RedisPrefixIndex:
    """``PrefixIndex`` over Redis; ``model`` names the key namespace (hash tag) of each call."""

    def __init__(
        self,
        client: aioredis.Redis,
        local: MemoryPrefixIndex,
        *,
        key_prefix: str = "llmgw",
        budget_s: float = 0.005,
        retry_after_s: float = 1.0,
        max_pending_writes: int = 1024,
        on_fallback: Callable[[str], None] | None = None,
        on_latency: Callable[[float], None] | None = None,
    ) -> None:
        self._client = client
        self.local = local
        self._prefix = key_prefix
        self._guard = RedisGuard(
            "prefix index",
            budget_s=budget_s,
            retry_after_s=retry_after_s,
            max_pending_writes=max_pending_writes,
            on_fallback=on_fallback,
        )
        self._on_latency = on_latency or (lambda seconds: None)
        self._match_script = client.register_script(_MATCH)
        self._record_script = client.register_script(_RECORD)
        self._models: dict[str, set[str]] = {}  # endpoint → model namespaces it was recorded under

    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        local = self.local.match_now(hashes, endpoints)
        if not hashes or not endpoints:
            return local
        keys = [endpoint_key(self._prefix, model, e) for e in endpoints]
        min_score = int((time.time() - self.local.ttl_s) * 1e6)
        started = time.perf_counter()
        counts = await self._guard.call(self._match_script(keys=keys, args=[min_score, _pack(hashes)]))
        if counts is None:
            return local  # Redis slow or down: this instance's own view
        self._on_latency(time.perf_counter() - started)
        # What this instance itself sent is known locally even when Redis lost it
        # (e.g. Redis restarted empty): take the better of the two views.
        return {e: max(int(c), local[e]) for e, c in zip(endpoints, counts, strict=True)}

    def record(self, hashes: Sequence[int], endpoint: str, model: str = "") -> None:
        self.local.record(hashes, endpoint)
        if hashes:
            self._models.setdefault(endpoint, set()).add(model)
            self._guard.spawn(self._record_remote(list(hashes), endpoint, model))

    async def _record_remote(self, hashes: list[int], endpoint: str, model: str) -> None:
        key = endpoint_key(self._prefix, model, endpoint)
        ttl_us = int(self.local.ttl_s * 1e6)
        args = [int(time.time() * 1e6), ttl_us, self.local.capacity(endpoint), _pack(hashes)]
        await self._record_script(keys=[key], args=args)

    async def purge(self, endpoint: str, models: Sequence[str] = ()) -> None:
        await self.local.purge(endpoint)
        names = set(models) | self._models.pop(endpoint, set())
        if names:
            keys = [endpoint_key(self._prefix, m, endpoint) for m in names]
            await self._guard.call(self._client.delete(*keys), budget_s=0.5)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self.local.set_capacity(endpoint, blocks)
        models = self._models.get(endpoint)
        if models:
            keys = [endpoint_key(self._prefix, m, endpoint) for m in models]
            self._guard.spawn(self._trim_remote(keys, self.local.capacity(endpoint)))

    async def _trim_remote(self, keys: list[str], capacity: int) -> None:
        for key in keys:  # one key per model: each in its own cluster slot
            await self._client.zremrangebyrank(key, 0, -capacity - 1)

    def size(self, endpoint: str) -> int:
        return self.local.size(endpoint)

    def capacity(self, endpoint: str) -> int:
        return self.local.capacity(endpoint)

    async def flush(self) -> None:
        """Wait for background writes (tests, shutdown)."""
        await self._guard.flush()

    async def close(self) -> None:
        await self.flush()
        await self._client.aclose()
