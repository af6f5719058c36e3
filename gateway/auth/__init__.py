"""Authentication and per-tenant rate limits: API key → :class:`Tenant`, and token buckets per tenant.

The request path uses four things: :func:`extract_key` (from the headers),
:meth:`KeyStore.lookup` (key → tenant), :meth:`RateLimiter.acquire` before the request
and :meth:`RateLimiter.settle` after it, once the usage is known.
"""

from __future__ import annotations

from gateway.auth.backends import build_key_store, build_rate_limiter
from gateway.auth.keyfile import FileKeyStore, KeyFileError
from gateway.auth.keys import (
    KeyStore,
    KeyStoreUnavailable,
    extract_key,
    hash_key,
    key_fingerprint,
    matches_hash,
)
from gateway.auth.ratelimit import LimitDecision, MemoryRateLimiter, RateLimiter
from gateway.auth.tenant import Priority, Tenant, TenantSpec

__all__ = [
    "FileKeyStore",
    "KeyFileError",
    "KeyStore",
    "KeyStoreUnavailable",
    "LimitDecision",
    "MemoryRateLimiter",
    "Priority",
    "RateLimiter",
    "Tenant",
    "TenantSpec",
    "build_key_store",
    "build_rate_limiter",
    "extract_key",
    "hash_key",
    "key_fingerprint",
    "matches_hash",
]
