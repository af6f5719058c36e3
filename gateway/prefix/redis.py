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

The local :class:`MemoryPrefixIndex` sees every decision this instance makes. When
Redis is slow (over ``budget_s``) or down, ``match`` answers from it, logs once,
counts a fallback, and skips Redis for ``retry_after_s`` before trying again — a
request never fails because of Redis. Writes run in the background, off the
request's critical path, bounded in number.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.prefix.memory import MemoryPrefixIndex

__all__ = ["RedisPrefixIndex", "endpoint_key"]

log = logging.getLogger(__name__)

# ARGV[2] is every block hash packed into one string, 8 bytes each: one argument to
# encode instead of hundreds, which is most of the client-side cost of a call.
_MATCH = """
local min_score = tonumber(ARGV[1])
local blob = ARGV[2]
local n = #blob / 8
local result = {}
for k = 1, #KEYS do
  local low, high = 0, n
  while low < high do
    local mid = math.floor((low + high + 1) / 2)
    local score = redis.call('ZSCORE', KEYS[k], string.sub(blob, mid * 8 - 7, mid * 8))
    if score and tonumber(score) >= min_score then low = mid else high = mid - 1 end
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
    """``PrefixIndex`` over Redis for one model namespace per call (``model`` argument)."""

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
        self._budget_s = budget_s
        self._retry_after_s = retry_after_s
        self._max_pending = max_pending_writes
        self._on_fallback = on_fallback or (lambda reason: None)
        self._on_latency = on_latency or (lambda seconds: None)
        self._match_script = client.register_script(_MATCH)
        self._record_script = client.register_script(_RECORD)
        self._skip_until = 0.0
        self._logged_down = False
        self._pending: set[asyncio.Task[None]] = set()
        self._models: dict[str, set[str]] = {}  # endpoint → model namespaces it was recorded under

    # -- health of the Redis connection -------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._skip_until

    def _failed(self, reason: str, exc: BaseException | None) -> None:
        self._skip_until = time.monotonic() + self._retry_after_s
        self._on_fallback(reason)
        if not self._logged_down:
            self._logged_down = True
            log.warning("prefix index: Redis %s (%s); using the local index until it is back", reason, exc)

    def _succeeded(self) -> None:
        if self._logged_down:
            self._logged_down = False
            log.warning("prefix index: Redis is back")

    # -- PrefixIndex --------------------------------------------------------------------
    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        if not hashes or not endpoints or not self._available():
            if hashes and endpoints:
                self._on_fallback("skipped")
            return self.local.match_now(hashes, endpoints)
        keys = [endpoint_key(self._prefix, model, e) for e in endpoints]
        min_score = int((time.time() - self.local.ttl_s) * 1e6)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._budget_s):
                counts = await self._match_script(keys=keys, args=[min_score, _pack(hashes)])
        except TimeoutError as exc:
            self._failed("timeout", exc)
            return self.local.match_now(hashes, endpoints)
        except (RedisError, OSError) as exc:
            self._failed("error", exc)
            return self.local.match_now(hashes, endpoints)
        self._on_latency(time.perf_counter() - started)
        self._succeeded()
        # What this instance itself sent is known locally even when Redis lost it
        # (e.g. Redis restarted empty): take the better of the two views.
        local = self.local.match_now(hashes, endpoints)
        return {e: max(int(c), local[e]) for e, c in zip(endpoints, counts, strict=True)}

    def record(self, hashes: Sequence[int], endpoint: str, model: str = "") -> None:
        self.local.record(hashes, endpoint)
        if not hashes or not self._available():
            return
        if len(self._pending) >= self._max_pending:
            self._on_fallback("write_dropped")
            return
        self._models.setdefault(endpoint, set()).add(model)
        self._spawn(self._record_remote(list(hashes), endpoint, model))

    async def _record_remote(self, hashes: list[int], endpoint: str, model: str) -> None:
        key = endpoint_key(self._prefix, model, endpoint)
        ttl_us = int(self.local.ttl_s * 1e6)
        args = [int(time.time() * 1e6), ttl_us, self.local.capacity(endpoint), _pack(hashes)]
        try:
            async with asyncio.timeout(max(self._budget_s * 20, 0.1)):
                await self._record_script(keys=[key], args=args)
        except TimeoutError as exc:
            self._failed("timeout", exc)
        except (RedisError, OSError) as exc:
            self._failed("error", exc)

    async def purge(self, endpoint: str, models: Sequence[str] = ()) -> None:
        await self.local.purge(endpoint)
        names = set(models) | self._models.pop(endpoint, set())
        if not names:
            return
        try:
            async with asyncio.timeout(0.5):
                await self._client.delete(*(endpoint_key(self._prefix, m, endpoint) for m in names))
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed("error", exc)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self.local.set_capacity(endpoint, blocks)
        models = self._models.get(endpoint)
        if models and self._available():
            keys = [endpoint_key(self._prefix, m, endpoint) for m in models]
            self._spawn(self._trim_remote(keys, self.local.capacity(endpoint)))

    async def _trim_remote(self, keys: list[str], capacity: int) -> None:
        try:
            async with asyncio.timeout(0.5):
                for key in keys:  # one key per model: each in its own cluster slot
                    await self._client.zremrangebyrank(key, 0, -capacity - 1)
        except TimeoutError as exc:
            self._failed("timeout", exc)
        except (RedisError, OSError) as exc:
            self._failed("error", exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (configuration time): the next record trims instead
            coro.close()
            return
        task = loop.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def size(self, endpoint: str) -> int:
        return self.local.size(endpoint)

    def capacity(self, endpoint: str) -> int:
        return self.local.capacity(endpoint)

    async def flush(self) -> None:
        """Wait for background writes (tests, shutdown)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        await self._client.aclose()
