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
from typing import ClassVar, Generic, Protocol, TypeVar

import redis.asyncio as aioredis

from gateway.redis_guard import RedisGuard

__all__ = ["MirroredStore", "RedisMirror"]

log = logging.getLogger(__name__)

_MAX_UNSYNCED = 10_000
_RESYNC_BATCH = 256  # rewritten per pass (one pass per retry_after_s at most)


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
        # id → (value, or None for a delete; when it was changed): changes not yet in Redis
        self._unsynced: OrderedDict[str, tuple[str | bytes | None, float]] = OrderedDict()
        self._next_resync = 0.0
        self._resync: asyncio.Task[None] | None = None

    def key(self, item_id: str) -> str:
        return f"{self._keys}{{{item_id}}}"

    async def get(self, item_id: str) -> bytes | None:
        if self._unsynced:
            self._resync_soon()
            if item_id in self._unsynced:
                return None  # Redis holds an older value, or none: the local copy is the newer
        return await self._guard.call(self._client.get(self.key(item_id)))

    def set(self, item_id: str, value: str | bytes) -> None:
        """Write (with the TTL) in the background."""
        self._change(item_id, value)

    def delete(self, item_id: str) -> None:
        self._change(item_id, None)

    def _change(self, item_id: str, value: str | bytes | None) -> None:
        change = (value, time.monotonic())
        self._unsynced[item_id] = change
        self._unsynced.move_to_end(item_id)
        while len(self._unsynced) > _MAX_UNSYNCED:
            self._unsynced.popitem(last=False)
        self._guard.spawn(self._write(item_id, change))

    async def _write(self, item_id: str, change: tuple[str | bytes | None, float]) -> None:
        value = change[0]
        if value is None:
            await self._client.delete(self.key(item_id))
        else:
            await self._client.set(self.key(item_id), value, px=self._ttl_ms)
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
        due = [(i, c) for i, c in list(self._unsynced.items())[:_RESYNC_BATCH] if c[1] < stale]
        if due:
            self._resync = asyncio.get_running_loop().create_task(self._rewrite(due))

    async def _rewrite(self, due: list[tuple[str, tuple[str | bytes | None, float]]]) -> None:
        try:
            for item_id, change in due:
                if self._unsynced.get(item_id) is not change:
                    continue  # changed again meanwhile: that write carries it
                if await self._guard.call(self._rewritten(item_id, change), budget_s=0.1) is None:
                    return  # Redis is away again: the next pass goes on
        except Exception:  # a bug here must not pass unseen; the next pass tries again
            log.exception("rewriting unsynced changes to Redis failed")

    async def _rewritten(self, item_id: str, change: tuple[str | bytes | None, float]) -> bool:
        await self._write(item_id, change)
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
