"""Sampling what the gateway and a replica report while load runs.

:class:`GatewayWatcher` polls the gateway's ``/metrics`` and notes, per endpoint, when its
attempt count rose; :class:`ReplicaWatcher` polls one simulated replica's ``/admin/state``
(requests that reached its engine). Times are seconds relative to the load's ``t0``.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["GatewayCounters", "GatewayWatcher", "ReplicaWatcher", "parse_gateway_metrics"]


@dataclass
class GatewayCounters:
    """The gateway's /metrics, reduced to what fault runs need (per endpoint name)."""

    attempts: dict[str, float] = field(default_factory=dict)  # answered + failed + in flight
    requests: dict[str, float] = field(default_factory=dict)
    upstream_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    retries: dict[str, float] = field(default_factory=dict)
    redis_fallbacks: dict[str, float] = field(default_factory=dict)
    session_fallbacks: dict[str, float] = field(default_factory=dict)
    healthy: dict[str, float] = field(default_factory=dict)
    ejected: dict[str, float] = field(default_factory=dict)  # breaker gauge, where the gateway has one
    retry_budget_exhausted: float = 0.0


def parse_gateway_metrics(text: str) -> GatewayCounters:
    """Per-endpoint attempt count: every attempt is in flight or ended as exactly one of an
    answered request or an upstream error (a mid-stream error is also an answered request,
    so it is left out), so the sum rises by one per attempt sent."""
    c = GatewayCounters()
    attempts: dict[str, float] = defaultdict(float)
    simple = {
        "llm_gateway_retries_total": ("reason", c.retries),
        "llm_gateway_redis_fallbacks_total": ("reason", c.redis_fallbacks),
        "llm_gateway_session_store_fallbacks_total": ("reason", c.session_fallbacks),
        "llm_gateway_endpoint_healthy": ("endpoint", c.healthy),
        "llm_gateway_endpoint_ejected": ("endpoint", c.ejected),
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            ep = s.labels.get("endpoint", "")
            if s.name == "llm_gateway_requests_total":
                c.requests[ep] = c.requests.get(ep, 0.0) + s.value
                attempts[ep] += s.value
            elif s.name == "llm_gateway_upstream_errors_total":
                c.upstream_errors.setdefault(ep, {})[s.labels["kind"]] = s.value
                if s.labels["kind"] != "mid_stream":
                    attempts[ep] += s.value
            elif s.name == "llm_gateway_endpoint_in_flight_requests":
                attempts[ep] += s.value
            elif s.name == "llm_gateway_retry_budget_exhausted_total":
                c.retry_budget_exhausted += s.value
            elif s.name in simple:
                label, target = simple[s.name]
                target[s.labels[label]] = s.value
    c.attempts = dict(attempts)
    return c


class GatewayWatcher:
    """Polls the gateway's /metrics; notes, per endpoint, when its attempt count rose."""

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, interval_s: float) -> None:
        self._session = session
        self._url = url + "/metrics"
        self._t0 = t0
        self.interval_s = interval_s
        self.events: dict[str, list[float]] = defaultdict(list)
        self.series: list[tuple[float, GatewayCounters]] = []
        self.latest: GatewayCounters | None = None
        self.first: GatewayCounters | None = None
        self.failed_polls = 0

    async def poll(self) -> GatewayCounters | None:
        try:
            async with self._session.get(self._url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            self.failed_polls += 1
            return None
        now = time.perf_counter() - self._t0  # upper bound of when the counted attempts were sent
        counters = parse_gateway_metrics(text)
        before = self.latest.attempts if self.latest is not None else {}
        for ep, value in counters.attempts.items():
            if self.latest is not None and value > before.get(ep, 0.0):
                self.events[ep].append(now)
        self.series.append((now, counters))
        self.first = self.first or counters
        self.latest = counters
        return counters

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)


class ReplicaWatcher:
    """Polls one replica's /admin/state: its engine's prefix-query counter moves per admitted request.

    Blind to requests the fault answers before the engine (error, hang) and to a dead process.
    """

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, interval_s: float) -> None:
        self._session = session
        self._url = url + "/admin/state"
        self._t0 = t0
        self.interval_s = interval_s
        self.events: list[float] = []
        self._last: float | None = None

    async def poll(self) -> None:
        try:
            async with self._session.get(self._url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                state = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        value = float(state.get("prefix_cache_queries_tokens", 0))
        if self._last is not None and value > self._last:
            self.events.append(time.perf_counter() - self._t0)
        self._last = value

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)
