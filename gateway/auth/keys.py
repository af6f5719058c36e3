"""API keys: how a request presents one, how it is hashed, and the store that maps it to a tenant.

Keys are only ever held as their sha256 hex digest (:func:`hash_key`); a raw key is
never stored or logged — logs name a key by its configured ``name`` or by
:func:`key_fingerprint` (the first 8 hex digits of its hash).

Two stores behind :class:`KeyStore`: a YAML file (:mod:`gateway.auth.keyfile`) and
Redis (:mod:`gateway.auth.redis_keys`), chosen by ``auth.backend``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.auth.tenant import Tenant
from gateway.config import AuthConfig

__all__ = [
    "KeyStore",
    "KeyStoreUnavailable",
    "build_key_store",
    "extract_key",
    "hash_key",
    "key_fingerprint",
    "matches_hash",
]


class KeyStoreUnavailable(RuntimeError):
    """The key is not cached and the store (Redis) cannot be asked now: answer 503, not 401."""


class KeyStore(Protocol):
    async def lookup(self, raw_key: str) -> Tenant | None:
        """The key's tenant; None for an unknown key. May raise :class:`KeyStoreUnavailable`."""
        ...

    def reload(self) -> int:
        """Re-read the source now (SIGHUP); returns how many keys are known (-1: not counted)."""
        ...

    async def close(self) -> None: ...


def hash_key(raw: str) -> str:
    """The form a key is stored in: lower-case hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(raw.encode()).hexdigest()


def key_fingerprint(raw: str) -> str:
    """What a log line may show of a key: the first 8 hex digits of its hash."""
    return hash_key(raw)[:8]


def matches_hash(raw: str, sha256_hex: str) -> bool:
    """Constant-time check of a key against one configured hash (e.g. ``auth.admin_key_sha256``)."""
    return hmac.compare_digest(hash_key(raw), sha256_hex.strip().lower())


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        # aiohttp's headers are case-insensitive; a plain dict is not.
        for key, candidate in headers.items():
            if key.lower() == name:
                return candidate
    return value


def extract_key(headers: Mapping[str, str]) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (first) or ``x-api-key``; None if neither has one."""
    authorization = _header(headers, "authorization")
    if authorization:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    api_key = _header(headers, "x-api-key")
    if api_key and api_key.strip():
        return api_key.strip()
    return None


def build_key_store(config: AuthConfig, on_fallback: Callable[[str], None] | None = None) -> KeyStore:
    """The store ``auth.backend`` names. The file store reads (and validates) its file now."""
    if config.backend == "file":
        from gateway.auth.keyfile import FileKeyStore

        if not config.keys_file:
            raise ValueError("auth.keys_file: required for the file backend")
        return FileKeyStore(config.keys_file)
    import redis.asyncio as aioredis

    from gateway.auth.redis_keys import RedisKeyStore

    client = aioredis.from_url(config.redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
    return RedisKeyStore(
        client,
        key_prefix=config.key_prefix,
        # A miss costs two round trips once per key per cache TTL, not one per request.
        budget_s=max(config.redis_budget_s, 0.1),
        on_fallback=on_fallback,
    )
