"""Token-bucket semantics, asserted identically against the memory and the Redis limiter.

Numbers are chosen so refill during a test is small and known: 60/min refills one request
a second, 6000 tokens/min refills 100 tokens a second.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from gateway.auth import LimitDecision, Tenant
from gateway.auth.ratelimit import format_duration
from tests.auth.conftest import Limiters


def tenant(name: str = "acme", rpm: int = 0, tpm: int = 0) -> Tenant:
    return Tenant(name=name, requests_per_minute=rpm, tokens_per_minute=tpm)


def expected_source(limiters: Limiters) -> str:
    return "redis" if limiters.backend == "redis" else "memory"


async def test_requests_burst_to_capacity_then_refill(limiters: Limiters) -> None:
    limiter, acme = limiters.new(), tenant(rpm=60)
    decisions = [await limiter.acquire(acme, 0) for _ in range(60)]
    assert all(d.allowed for d in decisions)
    assert decisions[0].source == expected_source(limiters)
    assert [d.remaining_requests for d in decisions[:3]] == [59, 58, 57]

    denied = await limiter.acquire(acme, 0)
    assert not denied.allowed
    assert denied.limited_by == "requests"
    assert 0 < denied.retry_after_s <= 1.0  # one request a second
    assert denied.remaining_requests == 0

    await asyncio.sleep(denied.retry_after_s + 0.05)
    assert (await limiter.acquire(acme, 0)).allowed
    assert not (await limiter.acquire(acme, 0)).allowed
    assert limiters.fallbacks == []


async def test_tokens_refill_continuously(limiters: Limiters) -> None:
    limiter, acme = limiters.new(), tenant(tpm=6000)
    first = await limiter.acquire(acme, 6000)
    assert first.allowed and first.remaining_tokens == 0
    denied = await limiter.acquire(acme, 100)
    assert not denied.allowed and denied.limited_by == "tokens"
    assert 0.5 < denied.retry_after_s <= 1.0  # 100 tokens at 100/s, less what refilled meanwhile

    await asyncio.sleep(0.3)  # ≈ 30 tokens back
    assert (await limiter.acquire(acme, 20)).allowed
    assert not (await limiter.acquire(acme, 60)).allowed
    assert limiters.fallbacks == []


async def test_tokens_and_requests_are_taken_together_or_not_at_all(limiters: Limiters) -> None:
    limiter = limiters.new()
    acme = tenant(rpm=60, tpm=600)
    assert (await limiter.acquire(acme, 600)).remaining_requests == 59
    refused = await limiter.acquire(acme, 100)
    assert not refused.allowed and refused.limited_by == "tokens"
    assert refused.remaining_requests == 59  # the refused request did not spend a request
    assert (await limiter.acquire(acme, 0)).remaining_requests == 58

    beta = tenant("beta", rpm=2, tpm=6000)
    assert (await limiter.acquire(beta, 10)).allowed
    assert (await limiter.acquire(beta, 10)).allowed
    refused = await limiter.acquire(beta, 1000)
    assert not refused.allowed and refused.limited_by == "requests"
    assert refused.remaining_tokens >= 5980  # … and a request refused for requests spent no tokens
    assert refused.retry_after_s > 20  # 2/min: the next request is ~30 s away
    assert limiters.fallbacks == []


async def test_tenants_have_separate_buckets(limiters: Limiters) -> None:
    limiter = limiters.new()
    assert (await limiter.acquire(tenant("a", rpm=1), 0)).allowed
    assert not (await limiter.acquire(tenant("a", rpm=1), 0)).allowed
    assert (await limiter.acquire(tenant("b", rpm=1), 0)).allowed


async def test_settle_refunds_and_charges_within_zero_and_capacity(limiters: Limiters) -> None:
    limiter, acme = limiters.new(), tenant(tpm=6000)
    assert (await limiter.acquire(acme, 3000)).allowed
    await limiter.settle(acme, charged_tokens=3000, actual_tokens=1000)  # refund 2000
    assert 5000 <= (await limiter.acquire(acme, 0)).remaining_tokens <= 5100

    await limiter.settle(acme, charged_tokens=10, actual_tokens=1_000_000)  # far more than was left
    after_debt = await limiter.acquire(acme, 0)
    assert after_debt.remaining_tokens <= 50  # empty, not negative: refill starts from zero
    assert not (await limiter.acquire(acme, 500)).allowed

    await limiter.settle(acme, charged_tokens=6000, actual_tokens=0)  # full refund: capped at capacity
    await limiter.settle(acme, charged_tokens=6000, actual_tokens=0)
    full = await limiter.acquire(acme, 0)
    assert full.remaining_tokens == 6000
    assert (await limiter.acquire(acme, 6000)).allowed
    assert not (await limiter.acquire(acme, 200)).allowed  # capacity, not 2×capacity, was there
    assert limiters.fallbacks == []


async def test_charge_larger_than_the_bucket_waits_for_a_full_bucket(limiters: Limiters) -> None:
    limiter, acme = limiters.new(), tenant(tpm=600)
    big = await limiter.acquire(acme, 5000)  # estimate above capacity: takes the whole bucket
    assert big.allowed and big.remaining_tokens == 0
    again = await limiter.acquire(acme, 5000)
    assert not again.allowed and 55 < again.retry_after_s <= 60  # a full refill away
    await limiter.settle(acme, charged_tokens=5000, actual_tokens=100)  # charge was 600: refund 500
    assert 500 <= (await limiter.acquire(acme, 0)).remaining_tokens <= 510


async def test_unlimited_tenant_is_never_limited_and_sends_no_headers(limiters: Limiters) -> None:
    limiter, free = limiters.new(), tenant()
    decisions = [await limiter.acquire(free, 10**9) for _ in range(5)]
    assert all(d.allowed for d in decisions)
    assert decisions[0].headers() == {}
    await limiter.settle(free, 10**9, 0)


async def test_headers_use_openai_names_and_durations(limiters: Limiters) -> None:
    limiter = limiters.new()
    decision = await limiter.acquire(tenant(rpm=60, tpm=1000), 100)
    headers = decision.headers()
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "59"
    assert re.fullmatch(r"1s|99\dms", headers["x-ratelimit-reset-requests"])  # one request, 1/s
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "900"
    assert re.fullmatch(r"6s|5\.9\d*s", headers["x-ratelimit-reset-tokens"])  # 100 tokens at 1000/min

    tokens_only = (await limiter.acquire(tenant("t", tpm=50), 5)).headers()
    assert set(tokens_only) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.25, "250ms"),
        (0.0001, "1ms"),
        (1.5, "1.5s"),
        (6, "6s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (59.9999, "1m0s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_refused_decision_headers_show_zero_remaining() -> None:
    decision = LimitDecision(
        allowed=False, retry_after_s=2, limit_requests=5, remaining_requests=0, reset_requests_s=60
    )
    assert decision.headers() == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
    }
