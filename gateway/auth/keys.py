"""API keys: how a request presents one, how it is hashed, and the store that maps it to a tenant.

Keys are only ever held as their sha256 hex digest (:func:`hash_key`); a raw key is
never stored or logged — logs name a key by its configured ``name`` or by
:func:`key_fingerprint` (the first 8 hex digits of its hash).

Two stores behind :class:`KeyStore`: a YAML file (:mod:`gateway.auth.keyfile`) and
Redis (:mod:`gateway.auth.redis_keys`), chosen by ``auth.backend`` in
:mod:`gateway.auth.backends`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Protocol

from gateway.auth.tenant import Tenant

__all__ = [
    "KeyStore",
    "KeyStoreUnavailable",
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
    """The form a key is stored in: lower-case hex sha256 of its UTF-8 bytes (a header's bytes
    that are no UTF-8 arrive as surrogate escapes: hashed as those bytes, so never a match
    and never an encoding error)."""
    return hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()


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
