"""The Redis key store: keys and tenants shared by every gateway instance, editable at run time.

Layout (``<prefix>`` is ``auth.key_prefix``):

    <prefix>:apikey:<sha256 hex>   HASH   tenant = <tenant name>, name = <key name, for logs>
    <prefix>:tenant:<tenant name>  STRING JSON of :class:`~gateway.auth.tenant.TenantSpec`:
                                          {"priority": "standard", "models": ["llama-3-8b"],
                                           "requests_per_minute": 600, "tokens_per_minute": 200000,
                                           "debug": false}

Every command touches one key, so the layout works on Redis Cluster unchanged. Revoking a
key is ``DEL <prefix>:apikey:<sha256>``; editing a tenant is a ``SET`` of its JSON. Both
take effect within the cache TTL.

Lookups are cached locally (``cache_ttl_s``, 5 s; unknown keys ``negative_ttl_s``, 1 s) so
a request does not pay a round trip, and concurrent misses of one key share one fetch.
While Redis is slow or down (:class:`~gateway.redis_guard.RedisGuard`), expired cache
entries keep serving; a key never seen before raises
:class:`~gateway.auth.keys.KeyStoreUnavailable` rather than being called invalid.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from gateway.auth.keys import KeyStoreUnavailable, hash_key
from gateway.auth.tenant import Tenant, TenantSpec
from gateway.config import format_validation_error
from gateway.redis_guard import RedisGuard

__all__ = ["RedisKeyStore", "add_key", "apikey_key", "remove_key", "tenant_key"]

log = logging.getLogger(__name__)


def apikey_key(prefix: str, sha256_hex: str) -> str:
    return f"{prefix}:apikey:{sha256_hex}"


def tenant_key(prefix: str, tenant: str) -> str:
    return f"{prefix}:tenant:{tenant}"


async def add_key(redis: aioredis.Redis, prefix: str, raw_key: str, tenant_spec: Tenant) -> str:
    """Store the tenant's spec (replacing it) and the key's hash; returns the hash. For tests and a CLI."""
    digest = hash_key(raw_key)
    record = TenantSpec.from_tenant(tenant_spec).model_dump_json(exclude_none=True)  # unset: absent
    await redis.set(tenant_key(prefix, tenant_spec.name), record)
    await redis.hset(
        apikey_key(prefix, digest), mapping={"tenant": tenant_spec.name, "name": tenant_spec.key_name}
    )
    return digest


async def remove_key(redis: aioredis.Redis, prefix: str, raw_key: str) -> bool:
    """Revoke a key (its tenant stays); True if it existed."""
    return bool(await redis.delete(apikey_key(prefix, hash_key(raw_key))))


def _text(value: bytes | str | None) -> str | None:
    """A record's field as text; bytes that are no UTF-8 make the record invalid (ValueError)."""
    return value.decode() if isinstance(value, bytes) else value  # UnicodeDecodeError is a ValueError


@dataclass(frozen=True, slots=True)
class _Fetched:
    """What Redis said (tenant or None), as opposed to None for "Redis did not answer"."""

    tenant: Tenant | None


@dataclass(slots=True)
class _Cached:
    tenant: Tenant
    expires: float


# Keys Redis said are unknown, remembered apart: anyone can send random keys, and they must
# not push out the valid keys that carry the gateway through a Redis outage.
_MAX_REFUSED = 10_000


class RedisKeyStore:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = "llmgw",
        cache_ttl_s: float = 5.0,
        negative_ttl_s: float = 1.0,
        max_cached: int = 100_000,
        budget_s: float = 0.1,
        retry_after_s: float = 1.0,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._prefix = key_prefix
        self.cache_ttl_s = cache_ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._max_cached = max_cached
        self._guard = RedisGuard(
            "API key store", budget_s=budget_s, retry_after_s=retry_after_s, on_fallback=on_fallback
        )
        self._cache: OrderedDict[str, _Cached] = OrderedDict()  # sha256 → tenant, LRU order
        self._refused: OrderedDict[str, float] = OrderedDict()  # sha256 → refused until, oldest first
        self._inflight: dict[str, asyncio.Future[_Fetched | None]] = {}

    async def lookup(self, raw_key: str) -> Tenant | None:
        digest = hash_key(raw_key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached.expires > now:
            self._cache.move_to_end(digest)
            return cached.tenant
        if self._refused.get(digest, 0.0) > now:
            return None
        fetch = self._inflight.get(digest)
        if fetch is None:
            fetch = asyncio.ensure_future(self._refresh(digest))
            self._inflight[digest] = fetch
            fetch.add_done_callback(lambda _: self._inflight.pop(digest, None))
        fetched = await asyncio.shield(fetch)  # one caller cancelled must not cancel the others' fetch
        if fetched is not None:
            return fetched.tenant
        cached = self._cache.get(digest)
        if cached is not None:
            return cached.tenant  # Redis slow or down: stale beats failing every request
        if digest in self._refused:
            return None
        raise KeyStoreUnavailable(f"API key {digest[:8]}… is not cached and Redis did not answer")

    async def _refresh(self, digest: str) -> _Fetched | None:
        fetched = await self._guard.call(self._fetch(digest))
        if fetched is None:
            return None
        if fetched.tenant is None:  # unknown or revoked
            self._cache.pop(digest, None)
            self._refused[digest] = time.monotonic() + self.negative_ttl_s
            self._refused.move_to_end(digest)
            while len(self._refused) > _MAX_REFUSED:
                self._refused.popitem(last=False)
            return fetched
        self._refused.pop(digest, None)
        self._cache[digest] = _Cached(fetched.tenant, time.monotonic() + self.cache_ttl_s)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return fetched

    async def _fetch(self, digest: str) -> _Fetched:
        try:
            raw = await self._client.hgetall(apikey_key(self._prefix, digest))
            fields = {_text(k): _text(v) for k, v in raw.items()}
        except (ResponseError, ValueError) as exc:  # WRONGTYPE, bytes that are no UTF-8: not a record
            log.error("API key %s…: its record in Redis is invalid (%s); key refused", digest[:8], exc)
            return _Fetched(None)
        tenant_name = fields.get("tenant")
        if not tenant_name:
            return _Fetched(None)
        key_name = fields.get("name") or ""
        raw_spec = await self._client.get(tenant_key(self._prefix, tenant_name))
        if raw_spec is None:
            log.warning(
                "API key %s… (%s): tenant %r has no spec in Redis; key refused",
                digest[:8],
                key_name,
                tenant_name,
            )
            return _Fetched(None)
        try:
            spec = TenantSpec.model_validate_json(raw_spec)
        except ValidationError as exc:
            log.error(
                "tenant %r in Redis is invalid (%s); its keys are refused",
                tenant_name,
                format_validation_error(exc),
            )
            return _Fetched(None)
        return _Fetched(spec.to_tenant(tenant_name, key_name))

    def reload(self) -> int:
        """Forget the cache: the next lookup of every key asks Redis."""
        self._cache.clear()
        self._refused.clear()
        return -1

    async def close(self) -> None:
        for fetch in list(self._inflight.values()):
            fetch.cancel()
        await self._client.aclose()
