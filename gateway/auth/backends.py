"""Builds the key store and the rate limiter that ``auth`` names (file or Redis; memory or Redis).

Apart from the stores themselves so that each store module depends only on the
interfaces (:mod:`~gateway.auth.keys`, :mod:`~gateway.auth.ratelimit`), never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.auth.keyfile import FileKeyStore
from gateway.auth.keys import KeyStore
from gateway.auth.ratelimit import MemoryRateLimiter, RateLimiter
from gateway.auth.redis_keys import RedisKeyStore
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.config import AuthConfig
from gateway.redis_client import redis_client

__all__ = ["build_key_store", "build_rate_limiter"]


def build_key_store(config: AuthConfig, on_fallback: Callable[[str], None] | None = None) -> KeyStore:
    """The store ``auth.backend`` names. The file store reads (and validates) its file now."""
    if config.backend == "file":
        if not config.keys_file:
            raise ValueError("auth.keys_file: required for the file backend")
        return FileKeyStore(config.keys_file)
    client = redis_client(config.redis_url)
    return RedisKeyStore(
        client,
        key_prefix=config.key_prefix,
        # A miss costs two round trips once per key per cache TTL, not one per request.
        budget_s=max(config.redis_budget_s, 0.1),
        on_fallback=on_fallback,
    )


def build_rate_limiter(config: AuthConfig, on_fallback: Callable[[str], None] | None = None) -> RateLimiter:
    """``auth.limits_backend``: memory (this instance) or redis (fleet-wide, memory fallback).

    ``on_fallback(reason)`` counts checks answered locally because Redis was slow
    (``timeout``), failing (``error``) or skipped during an outage's back-off (``skipped``).
    """
    if config.limits_backend == "memory":
        return MemoryRateLimiter()
    client = redis_client(config.redis_url)
    return RedisRateLimiter(
        client, key_prefix=config.key_prefix, budget_s=config.redis_budget_s, on_fallback=on_fallback
    )
