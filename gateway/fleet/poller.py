"""Scrapes each endpoint's ``/metrics`` on an interval and keeps ``Endpoint.metrics`` current.

Metrics older than ``stale_after_s`` are marked stale; scorers then fall back to the
gateway's own in-flight counts instead of trusting old numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.config import ScrapeConfig
from gateway.fleet.dp import update_rank_loads
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.scraper import parse_engine_metrics
from gateway.ops.metrics import GatewayMetrics

__all__ = ["MetricsPoller"]

log = logging.getLogger(__name__)


class MetricsPoller:
    def __init__(
        self,
        registry: EndpointRegistry,
        session: aiohttp.ClientSession,
        config: ScrapeConfig,
        metrics: GatewayMetrics,
        on_restart: Callable[[Endpoint], None] | None = None,
        on_scraped: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self._registry = registry
        self._session = session
        self._config = config
        self._metrics = metrics
        self._on_restart = on_restart
        self._on_scraped = on_scraped
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._last_marker: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._config.interval_s)

    async def scrape_all(self) -> None:
        endpoints = list(self._registry)
        await asyncio.gather(*(self._scrape(e) for e in endpoints))
        for url in self._last_marker.keys() - {e.url for e in endpoints}:  # removed endpoints
            del self._last_marker[url]
        now = time.monotonic()
        for endpoint in endpoints:
            m = endpoint.metrics
            m.stale = m.scraped_at == 0 or now - m.scraped_at > self._config.stale_after_s
            for target in endpoint.rank_targets:
                target.metrics.stale = m.stale
            if endpoint in self._registry:  # removed while scraped: its series are gone, keep them so
                self._metrics.endpoint_metrics_stale.labels(endpoint.name).set(1 if m.stale else 0)

    async def _scrape(self, endpoint: Endpoint) -> None:
        try:
            async with self._session.get(
                endpoint.base_url + "/metrics",
                timeout=self._timeout,
                headers={"authorization": endpoint.auth_header} if endpoint.auth_header else None,
                ssl=endpoint.ssl_context or True,
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                text = await resp.text()
            load = parse_engine_metrics(text, endpoint.engine)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            if endpoint in self._registry:
                self._metrics.scrape_errors.labels(endpoint.name).inc()
            log.debug("scrape of %s failed: %s", endpoint.name, exc)
            return
        m = endpoint.metrics
        m.waiting, m.running, m.kv_usage = load.waiting, load.running, load.kv_usage
        m.lora = load.lora
        if load.block_size is not None:
            m.block_size, m.num_blocks = load.block_size, load.num_blocks
        m.scraped_at = time.monotonic()
        m.in_flight_at_scrape = endpoint.in_flight
        m.stale = False
        if endpoint not in self._registry:
            return
        self._metrics.endpoint_waiting.labels(endpoint.name).set(load.waiting or 0)
        self._metrics.endpoint_running.labels(endpoint.name).set(load.running or 0)
        self._metrics.endpoint_kv_usage.labels(endpoint.name).set(load.kv_usage or 0)
        self._detect_restart(endpoint, load.restart_marker)
        if self._on_scraped:
            self._on_scraped(endpoint)
        self._scraped_ranks(endpoint, text)

    def _scraped_ranks(self, endpoint: Endpoint, text: str) -> None:
        """Data parallel (fleet/dp.py): each rank's load and gauges; dropped ranks forgotten."""
        changed, dropped = update_rank_loads(endpoint, text)
        if changed:
            log.warning("endpoint %s: now %d data-parallel ranks", endpoint.name, len(endpoint.rank_targets))
            self._registry.rebuild()
        for target in dropped:
            self._metrics.forget_endpoint(target.name)
            if self._on_restart:
                self._on_restart(target)  # what the index held for it is gone
        for target in endpoint.rank_targets:
            self._metrics.endpoint_waiting.labels(target.name).set(target.metrics.waiting or 0)
            self._metrics.endpoint_running.labels(target.name).set(target.metrics.running or 0)
            self._metrics.endpoint_kv_usage.labels(target.name).set(target.metrics.kv_usage or 0)
            if self._on_scraped:
                self._on_scraped(target)

    def _detect_restart(self, endpoint: Endpoint, marker: float | None) -> None:
        if marker is None:
            return
        previous = self._last_marker.get(endpoint.url)
        self._last_marker[endpoint.url] = marker
        if previous is not None and marker < previous:
            log.warning("endpoint %s restarted (its counters went backwards)", endpoint.name)
            if self._on_restart:
                self._on_restart(endpoint)
