"""Per-tenant rate limits: requests per minute and tokens per minute, as two token buckets.

Each bucket holds up to its per-minute figure and refills continuously at figure/60 per
second, so a tenant can burst a full minute's allowance and then runs at the steady rate.
A check takes from both buckets or from neither: a request refused for tokens does not
spend a request, and the other way round. A limit of 0 is unlimited and has no bucket.

Tokens are charged up front (the caller's estimate: prompt + ``max_tokens``) and
corrected by :meth:`RateLimiter.settle` once the response's usage is known. A charge
larger than the whole bucket is cut to the bucket's size — it waits for a full bucket
and empties it, instead of being refused forever for an estimate (``max_tokens`` is an
upper bound); ``settle`` cuts the same way, so callers pass the figures they computed.

Two implementations: :class:`MemoryRateLimiter` (one instance) and
:class:`~gateway.auth.redis_limits.RedisRateLimiter` (one limit for the whole fleet,
with this memory one as its fallback).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.auth.tenant import Tenant

__all__ = [
    "LimitDecision",
    "MemoryRateLimiter",
    "RateLimiter",
    "format_duration",
]

Source = Literal["memory", "redis", "fallback", "unlimited"]


def format_duration(seconds: float) -> str:
    """Go's duration style, as OpenAI's ``x-ratelimit-reset-*``: ``0s``, ``250ms``, ``1.5s``, ``6m0s``."""
    ms = math.ceil(seconds * 1000) if seconds > 0 else 0
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True, slots=True)
class LimitDecision:
    """One check's answer, with what the ``x-ratelimit-*`` headers need. A limit of 0 is unlimited."""

    allowed: bool
    retry_after_s: float = 0.0  # 0 when allowed
    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests_s: float = 0.0  # until the requests bucket is full again
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens_s: float = 0.0
    limited_by: str | None = None  # "requests", "tokens" or "requests+tokens" when refused
    source: Source = "memory"  # "fallback": Redis was slow or down, this instance's bucket answered

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, for the limits the tenant has (none for unlimited ones)."""
        out: dict[str, str] = {}
        if self.limit_requests:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.limit_tokens:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        return out


UNLIMITED = LimitDecision(allowed=True, source="unlimited")


class RateLimiter(Protocol):
    async def acquire(self, tenant: Tenant, tokens: int) -> LimitDecision:
        """Take one request and ``tokens`` tokens from the tenant's buckets — both, or neither."""
        ...

    async def settle(self, tenant: Tenant, charged_tokens: int, actual_tokens: int) -> None:
        """Book the difference once usage is known: refund (actual < charged) or charge more."""
        ...

    async def close(self) -> None: ...


# -- the bucket arithmetic, shared with the Redis script's Python twin -----------------------


def costs(tenant: Tenant, tokens: int) -> tuple[float, float]:
    """What one request takes from each bucket: nothing from an unlimited one, never more than capacity."""
    request_cost = 1.0 if tenant.requests_per_minute > 0 else 0.0
    token_cost = float(min(max(tokens, 0), tenant.tokens_per_minute))
    return request_cost, token_cost


def settle_delta(tenant: Tenant, charged_tokens: int, actual_tokens: int) -> float:
    """Tokens to take (positive) or give back (negative), with the charge cut as :func:`costs` cut it."""
    if tenant.tokens_per_minute <= 0:
        return 0.0
    charged = min(max(charged_tokens, 0), tenant.tokens_per_minute)
    return float(max(actual_tokens, 0) - charged)


def settled_level(level: float, delta: float, capacity: int) -> float:
    """The token level after settling: usage past the charge is a debt the next requests wait
    out, down to one minute's worth (clamped at 0, a request that used more than it was
    charged, e.g. without ``max_tokens``, was forgiven: 3x the limit went through)."""
    return min(float(capacity), max(-float(capacity), level - delta))


def refill(level: float, capacity: int, elapsed_s: float) -> float:
    return min(float(capacity), level + max(elapsed_s, 0.0) * capacity / 60.0)


def decide(
    tenant: Tenant,
    allowed: bool,
    requests_left: float,
    tokens_left: float,
    request_cost: float,
    token_cost: float,
    source: Source,
) -> LimitDecision:
    """The decision from the bucket levels after the check (whether or not it took anything)."""
    rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
    retry_after = 0.0
    limited_by: list[str] = []
    if not allowed:
        if rpm > 0 and requests_left < request_cost:
            retry_after = max(retry_after, (request_cost - requests_left) * 60.0 / rpm)
            limited_by.append("requests")
        if tpm > 0 and tokens_left < token_cost:
            retry_after = max(retry_after, (token_cost - tokens_left) * 60.0 / tpm)
            limited_by.append("tokens")
    return LimitDecision(
        allowed=allowed,
        retry_after_s=retry_after,
        limit_requests=rpm,
        remaining_requests=max(0, math.floor(requests_left)) if rpm > 0 else 0,
        reset_requests_s=(rpm - requests_left) * 60.0 / rpm if rpm > 0 else 0.0,
        limit_tokens=tpm,
        remaining_tokens=max(0, math.floor(tokens_left)) if tpm > 0 else 0,
        reset_tokens_s=(tpm - tokens_left) * 60.0 / tpm if tpm > 0 else 0.0,
        limited_by="+".join(limited_by) or None,
        source=source,
    )


class MemoryRateLimiter:
    """Buckets in this process; also the Redis limiter's fallback, kept in step by :meth:`mirror`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_tenants: int = 100_000) -> None:
        self._clock = clock
        self._max_tenants = max_tenants
        self._buckets: dict[str, tuple[float, float, float]] = {}  # tenant → (requests, tokens, at)

    def _levels(self, tenant: Tenant, now: float) -> tuple[float, float]:
        state = self._buckets.get(tenant.name)
        if state is None:
            return float(tenant.requests_per_minute), float(tenant.tokens_per_minute)
        requests, tokens, at = state
        elapsed = now - at
        # Capacities are read from the tenant on every call, so a lowered limit applies at once.
        return refill(requests, tenant.requests_per_minute, elapsed), refill(
            tokens, tenant.tokens_per_minute, elapsed
        )

    def _store(self, tenant: Tenant, requests: float, tokens: float, now: float) -> None:
        if tenant.name not in self._buckets and len(self._buckets) >= self._max_tenants:
            self._evict_full(now)
        self._buckets[tenant.name] = (requests, tokens, now)

    def _evict_full(self, now: float) -> None:
        # A bucket idle for two minutes is full (from a minute's debt too: settled_level), which
        # is the same as having no bucket at all.
        stale = [name for name, (_, _, at) in self._buckets.items() if now - at >= 120.0]
        for name in stale:
            del self._buckets[name]
        if len(self._buckets) >= self._max_tenants:  # still full: drop the oldest (forgiving, bounded)
            del self._buckets[min(self._buckets, key=lambda n: self._buckets[n][2])]

    def acquire_now(self, tenant: Tenant, tokens: int, source: Source = "memory") -> LimitDecision:
        if not tenant.limited:
            return UNLIMITED
        now = self._clock()
        requests, available = self._levels(tenant, now)
        request_cost, token_cost = costs(tenant, tokens)
        allowed = requests >= request_cost and available >= token_cost
        if allowed:
            requests -= request_cost
            available -= token_cost
        self._store(tenant, requests, available, now)
        return decide(tenant, allowed, requests, available, request_cost, token_cost, source)

    def settle_now(self, tenant: Tenant, charged_tokens: int, actual_tokens: int) -> None:
        delta = settle_delta(tenant, charged_tokens, actual_tokens)
        if delta == 0:
            return
        now = self._clock()
        requests, available = self._levels(tenant, now)
        available = settled_level(available, delta, tenant.tokens_per_minute)
        self._store(tenant, requests, available, now)

    def mirror(self, tenant: Tenant, requests: float, tokens: float) -> None:
        """Adopt the shared levels Redis just reported, so a failover continues from them, not from full."""
        self._store(tenant, requests, tokens, self._clock())

    async def acquire(self, tenant: Tenant, tokens: int) -> LimitDecision:
        return self.acquire_now(tenant, tokens)

    async def settle(self, tenant: Tenant, charged_tokens: int, actual_tokens: int) -> None:
        self.settle_now(tenant, charged_tokens, actual_tokens)

    async def close(self) -> None:
        self._buckets.clear()
