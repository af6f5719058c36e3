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

A purge (the replica went down, restarted or left: its cache is gone) that Redis missed — slow,
down, or skipped in the guard's window — left the replica's blocks there for up to the TTL,
and ``match`` took them as hits on a restarted, empty replica. Such a purge is remembered:
until it reaches Redis the replica's remote counts are ignored, and it is retried as
``ZREMRANGEBYSCORE … (purge time``, so blocks recorded after the purge survive it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from gateway.prefix.memory import MemoryPrefixIndex
from gateway.redis_guard import RedisGuard

__all__ = ["RedisPrefixIndex", "endpoint_key"]

log = logging.getLogger(__name__)

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
        self._unpurged: dict[str, int] = {}  # key → when (µs) a purge of it did not reach Redis
        self._purging: asyncio.Task[None] | None = None

    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        local = self.local.match_now(hashes, endpoints)
        if not hashes or not endpoints:
            return local
        keys = [endpoint_key(self._prefix, model, e) for e in endpoints]
        if self._unpurged:
            self._purge_again_soon()
        min_score = int((time.time() - self.local.ttl_s) * 1e6)
        started = time.perf_counter()
        counts = await self._guard.call(self._match_script(keys=keys, args=[min_score, _pack(hashes)]))
        if counts is None:
            return local  # Redis slow or down: this instance's own view
        self._on_latency(time.perf_counter() - started)
        # What this instance itself sent is known locally even when Redis lost it
        # (e.g. Redis restarted empty): take the better of the two views. A key whose purge
        # has not reached Redis yet holds a gone cache: only the local view counts.
        unpurged = self._unpurged
        return {
            e: local[e] if unpurged and k in unpurged else max(int(c), local[e])
            for e, k, c in zip(endpoints, keys, counts, strict=True)
        }

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
            purged_at = int(time.time() * 1e6)
            if await self._guard.call(self._client.delete(*keys), budget_s=0.5) is None:
                self._unpurged.update(dict.fromkeys(keys, purged_at))  # one key per endpoint and model

    def _purge_again_soon(self) -> None:
        if not self._guard.available() or (self._purging is not None and not self._purging.done()):
            return
        self._purging = asyncio.get_running_loop().create_task(self._purge_again())

    async def _purge_again(self) -> None:
        try:
            for key, purged_at in list(self._unpurged.items()):
                # Only what was there before the purge: the replica's new blocks stay.
                removed = self._client.zremrangebyscore(key, "-inf", f"({purged_at}")
                if await self._guard.call(removed, budget_s=0.5) is None:
                    return  # Redis is away again: the next match retries
                if self._unpurged.get(key) == purged_at:
                    del self._unpurged[key]
        except Exception:  # never unseen; the next match retries
            log.exception("retrying a purge of the Redis prefix index failed")

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
        """Wait for background writes and a purge being retried (tests, shutdown)."""
        await self._guard.flush()
        if self._purging is not None:
            await asyncio.gather(self._purging, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        await self._client.aclose()
