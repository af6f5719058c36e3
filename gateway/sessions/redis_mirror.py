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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar

import redis.asyncio as aioredis

from gateway.redis_guard import RedisGuard

__all__ = ["MirroredStore", "RedisMirror"]


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
        self._guard = RedisGuard(
            name or f"{kind} store", budget_s=budget_s, retry_after_s=retry_after_s, on_fallback=on_fallback
        )

    def key(self, item_id: str) -> str:
        return f"{self._keys}{{{item_id}}}"

    async def get(self, item_id: str) -> bytes | None:
        return await self._guard.call(self._client.get(self.key(item_id)))

    def set(self, item_id: str, value: str | bytes) -> None:
        """Write (with the TTL) in the background."""
        self._guard.spawn(self._client.set(self.key(item_id), value, px=self._ttl_ms))

    def delete(self, item_id: str) -> None:
        self._guard.spawn(self._client.delete(self.key(item_id)))

    async def flush(self) -> None:
        await self._guard.flush()

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
