"""Active health checks with up/down thresholds, and model discovery from ``/v1/models``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from gateway.config import HealthConfig
from gateway.endpoints.registry import EndpointRegistry
from gateway.metrics import GatewayMetrics
from gateway.types import Endpoint

__all__ = ["HealthChecker"]

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        registry: EndpointRegistry,
        session: aiohttp.ClientSession,
        config: HealthConfig,
        metrics: GatewayMetrics,
        on_change: Callable[[Endpoint, bool], None] | None = None,
    ) -> None:
        self._registry = registry
        self._session = session
        self._config = config
        self._metrics = metrics
        self._on_change = on_change
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._config.interval_s)

    async def check_all(self) -> None:
        await self.check(list(self._registry))

    async def check(self, endpoints: list[Endpoint]) -> None:
        """Probe these endpoints now (new ones join without waiting for the next round)."""
        results = await asyncio.gather(*(self._probe(e) for e in endpoints))
        changed = False
        for endpoint, ok in zip(endpoints, results, strict=True):
            changed |= self._record(endpoint, ok)
        if changed:
            self._registry.rebuild()

    async def _probe(self, endpoint: Endpoint) -> bool:
        try:
            async with self._session.get(endpoint.url + self._config.path, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return False
            if not endpoint.configured_models and not endpoint.discovered_models:
                endpoint.discovered_models = await self._discover_models(endpoint)
                return bool(endpoint.discovered_models)
            return True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    async def _discover_models(self, endpoint: Endpoint) -> frozenset[str]:
        async with self._session.get(endpoint.url + "/v1/models", timeout=self._timeout) as resp:
            if resp.status != 200:
                return frozenset()
            payload = await resp.json(content_type=None)
        data = payload.get("data") if isinstance(payload, dict) else None
        models = {item["id"] for item in data or [] if isinstance(item, dict) and "id" in item}
        if models:
            log.info("endpoint %s serves %s", endpoint.name, sorted(models))
        return frozenset(models)

    def _record(self, endpoint: Endpoint, ok: bool) -> bool:
        """Apply thresholds; return True when the endpoint's health flipped."""
        if ok:
            endpoint.consecutive_successes += 1
            endpoint.consecutive_failures = 0
        else:
            endpoint.consecutive_failures += 1
            endpoint.consecutive_successes = 0
        was = endpoint.healthy
        if not was and ok and endpoint.consecutive_successes >= self._config.healthy_threshold:
            endpoint.healthy = True
        elif was and not ok and endpoint.consecutive_failures >= self._config.unhealthy_threshold:
            endpoint.healthy = False
        self._metrics.endpoint_healthy.labels(endpoint.name).set(1 if endpoint.healthy else 0)
        if endpoint.healthy != was:
            log.warning("endpoint %s is now %s", endpoint.name, "UP" if endpoint.healthy else "DOWN")
            if self._on_change:
                self._on_change(endpoint, endpoint.healthy)
            return True
        return False

    def mark_failed(self, endpoint: Endpoint) -> None:
        """Passive signal from the proxy (connection refused): count it like a failed probe."""
        if self._record(endpoint, False):
            self._registry.rebuild()
