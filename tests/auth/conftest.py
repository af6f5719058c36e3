"""Fixtures for the auth suite: the Redis rules of the prefix suite, plus Redis clients and limiters.

Redis rule (shared with tests/prefix): the shared server at 127.0.0.1:6379, or a private
``redis-server``; neither → fail under ``CI=true``, skip otherwise. Each test has its own
``key_prefix``, deleted afterwards; private servers are killed by PID.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis

from gateway.auth.ratelimit import MemoryRateLimiter, RateLimiter
from gateway.auth.redis_limits import RedisRateLimiter
from tests.prefix.conftest import key_prefix, redis_servers, redis_url

__all__ = ["key_prefix", "redis_servers", "redis_url"]  # re-exported fixtures


@pytest.fixture
def redis_client(stack: contextlib.AsyncExitStack) -> Callable[[str], aioredis.Redis]:
    """``redis_client(url)``: a new async client (its own connection pool), closed after the test."""

    def make(url: str) -> aioredis.Redis:
        client = aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2.0)
        stack.push_async_callback(client.aclose)
        return client

    return make


@dataclass
class Limiters:
    """Makes limiters of one backend; ``fallbacks`` collects every local fallback of the Redis ones."""

    backend: str
    make_client: Callable[[str], aioredis.Redis] | None = None
    url: str = ""
    prefix: str = ""
    fallbacks: list[str] = field(default_factory=list)

    def new(self, **kw: object) -> RateLimiter:
        if self.backend == "memory":
            return MemoryRateLimiter()
        assert self.make_client is not None
        kw.setdefault("budget_s", 0.5)  # a busy CI box must not turn a Redis answer into a fallback
        return RedisRateLimiter(
            self.make_client(self.url), key_prefix=self.prefix, on_fallback=self.fallbacks.append, **kw
        )


@pytest.fixture(params=["memory", "redis"])
def limiters(request: pytest.FixtureRequest, redis_client: Callable[[str], aioredis.Redis]) -> Limiters:
    """The same bucket semantics are asserted against both backends."""
    if request.param == "memory":
        return Limiters("memory")
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("key_prefix")
    return Limiters("redis", redis_client, url, prefix)
