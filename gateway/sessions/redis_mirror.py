"""The Redis side of the session and response stores: one implementation for both.

Each store keeps its truth locally (a bounded LRU with a TTL) and mirrors it to Redis
under ``<prefix>:<kind>:{<id>}`` (the braces make a Redis Cluster hash tag of the id),
with ``PX`` set to the local TTL, so gateway instances share what each learns.

- :meth:`RedisMirror.get` is guarded (:class:`~gateway.redis_guard.RedisGuard`: a time
  budget, then a pause after a failure): ``None`` when Redis is slow, down or has no such
  key, and the caller answers from its local copy (which also covers its own write
  still in flight).
- :meth:`RedisMirror.set` and :meth:`RedisMirror.delete` never wait: they run later,
  under the same guard, and :meth:`RedisMirror.flush` waits for them (tests, shutdown).
- A change is *unsynced* until its write succeeded. A write dropped or failed while Redis
  was slow or down left the older value there: read back, it undid the change (a session
  moved during a one-second Redis hiccup went back to the replica it had left). Until its
  write lands, :meth:`RedisMirror.get` answers ``None`` for such an id (the local copy is
  newer), and once Redis answers again the oldest unsynced changes are written again
  (at most ``_MAX_UNSYNCED`` are remembered).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import redis.asyncio as aioredis

from gateway.redis_guard import RedisGuard

__all__ = ["MirroredStore", "RedisMirror"]

log = logging.getLogger(__name__)

_MAX_UNSYNCED = 10_000
_RESYNC_BATCH = 256  # rewritten per pass (one pass per retry_after_s at most)


# A change rewritten after an outage lands only if Redis still holds what this instance saw
# before making it (``base``; none: the key absent): another instance's later write wins.
# ARGV: [1] '1' with a base, [2] the base, [3] '1' to set, '0' to delete, [4] value, [5] PX ms
_REWRITE = """
local current = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if current ~= ARGV[2] then return 0 end
elseif current then
  return 0
end
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

Value = str | bytes


@dataclass(frozen=True, slots=True, eq=False)
class _Change:
    value: Value | None  # None: a delete
    at: float  # time.monotonic() of the change
    base: bytes | None  # what Redis held, as this instance last saw it, when the change was made
    base_known: bool


def _bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else value


class RedisMirror:
    def __init__(
        self,
        client: aioredis.Redis,
        kind: str,
        *,
        ttl_s: float,
        key_prefix: str = "llmgw",
        name: str | None = None,
        budget_s: float = 0.005,
        retry_after_s: float = 1.0,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._keys = f"{key_prefix}:{kind}:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._retry_after_s = retry_after_s
        self._guard = RedisGuard(
            name or f"{kind} store", budget_s=budget_s, retry_after_s=retry_after_s, on_fallback=on_fallback
        )
        self._rewrite_script = client.register_script(_REWRITE)
        self._unsynced: OrderedDict[str, _Change] = OrderedDict()  # changes not yet in Redis
        # The last value read from or written to Redis per id (None: no such key): a change's base.
        # A lookup and the change it leads to come in one request, so a small window suffices.
        self._seen: OrderedDict[str, bytes | None] = OrderedDict()
        self._next_resync = 0.0
        self._resync: asyncio.Task[None] | None = None

    def key(self, item_id: str) -> str:
        return f"{self._keys}{{{item_id}}}"

    async def get(self, item_id: str) -> bytes | None:
        """Redis's value; None when there is none, Redis is slow or down, or this instance's own
        change is newer than what Redis holds (the caller answers from its local copy)."""
        change = self._unsynced.get(item_id) if self._unsynced else None
        if self._unsynced:
            self._resync_soon()
        read = await self._guard.call(self._read(item_id))
        if read is None:
            return None  # Redis slow or down: the local copy
        value = read[0]
        if change is not None and self._unsynced.get(item_id) is change:
            if value == (None if change.value is None else _bytes(change.value)):
                del self._unsynced[item_id]  # it landed after all
            elif value is None or (change.base_known and value == change.base):
                return None  # absent, or what we saw before our change: ours is newer (rewritten soon)
            elif time.monotonic() - change.at > self._retry_after_s:
                del self._unsynced[item_id]  # another instance wrote since: its value wins
            else:
                return None  # our write may still be in flight
        return value

    async def _read(self, item_id: str) -> tuple[bytes | None]:
        value = await self._client.get(self.key(item_id))
        self._saw(item_id, value)
        return (value,)

    def _saw(self, item_id: str, value: bytes | None) -> None:
        self._seen[item_id] = value
        self._seen.move_to_end(item_id)
        while len(self._seen) > _MAX_UNSYNCED:
            self._seen.popitem(last=False)

    def set(self, item_id: str, value: Value) -> None:
        """Write (with the TTL) in the background."""
        self._change(item_id, value)

    def delete(self, item_id: str) -> None:
        self._change(item_id, None)

    def _change(self, item_id: str, value: Value | None) -> None:
        known = item_id in self._seen
        change = _Change(value, time.monotonic(), self._seen.get(item_id), known)
        self._unsynced[item_id] = change
        self._unsynced.move_to_end(item_id)
        while len(self._unsynced) > _MAX_UNSYNCED:
            self._unsynced.popitem(last=False)
        self._guard.spawn(self._write(item_id, change))

    async def _write(self, item_id: str, change: _Change) -> None:
        if change.value is None:
            await self._client.delete(self.key(item_id))
        else:
            await self._client.set(self.key(item_id), change.value, px=self._ttl_ms)
        self._landed(item_id, change)

    def _landed(self, item_id: str, change: _Change) -> None:
        self._saw(item_id, None if change.value is None else _bytes(change.value))
        if self._unsynced.get(item_id) is change:  # nothing newer since: it is in Redis
            del self._unsynced[item_id]

    def _resync_soon(self) -> None:
        """Rewrite changes whose write was dropped or failed, once Redis answers again."""
        now = time.monotonic()
        if now < self._next_resync or not self._guard.available():
            return
        if self._resync is not None and not self._resync.done():
            return
        self._next_resync = now + self._retry_after_s
        stale = now - self._retry_after_s  # younger ones may still be in flight
        due = [(i, c) for i, c in list(self._unsynced.items())[:_RESYNC_BATCH] if c.at < stale]
        if due:
            self._resync = asyncio.get_running_loop().create_task(self._rewrite(due))

    async def _rewrite(self, due: list[tuple[str, _Change]]) -> None:
        try:
            for item_id, change in due:
                if self._unsynced.get(item_id) is not change:
                    continue  # changed again meanwhile: that write carries it
                if await self._guard.call(self._rewritten(item_id, change), budget_s=0.1) is None:
                    return  # Redis is away again: the next pass goes on
        except Exception:  # a bug here must not pass unseen; the next pass tries again
            log.exception("rewriting unsynced changes to Redis failed")

    async def _rewritten(self, item_id: str, change: _Change) -> bool:
        base = change.base or b""
        args = ["1" if change.base_known and change.base is not None else "0", base]
        args += ["0", b""] if change.value is None else ["1", change.value]
        landed = await self._rewrite_script(keys=[self.key(item_id)], args=[*args, self._ttl_ms])
        if landed:
            self._landed(item_id, change)
        elif self._unsynced.get(item_id) is change:
            del self._unsynced[item_id]  # Redis moved on (another instance's write): that wins
        return True

    async def flush(self) -> None:
        await self._guard.flush()
        if self._resync is not None:
            await asyncio.gather(self._resync, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        await self._client.aclose()


class _Local(Protocol):
    @property
    def ttl_s(self) -> float: ...


L = TypeVar("L", bound=_Local)


class MirroredStore(Generic[L]):
    """A store whose truth is ``local`` and whose copy is in Redis under ``kind`` (the base of
    :class:`~gateway.sessions.store.RedisSessionStore` and
    :class:`~gateway.sessions.responses.RedisResponseStore`)."""

    kind: ClassVar[str]

    def __init__(
        self,
        client: aioredis.Redis,
        local: L,
        *,
        key_prefix: str = "llmgw",
        budget_s: float = 0.005,
        retry_after_s: float = 1.0,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self.local = local
        self._redis = RedisMirror(
            client,
            self.kind,
            ttl_s=local.ttl_s,
            key_prefix=key_prefix,
            budget_s=budget_s,
            retry_after_s=retry_after_s,
            on_fallback=on_fallback,
        )

    async def flush(self) -> None:
        """Wait for the background writes (tests, shutdown)."""
        await self._redis.flush()

    async def close(self) -> None:
        await self._redis.close()
