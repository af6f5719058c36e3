"""Active health checks with up/down thresholds, and model discovery from ``/v1/models``.

:class:`HealthTracker` owns the thresholds and is fed by both the probes and the
proxy's passive signal (a refused connection). :class:`HealthChecker` runs the probes.
One endpoint answering nonsense makes that endpoint unhealthy, with the reason logged,
and nothing else: a probe never raises out of :meth:`HealthChecker.check`, and the
periodic loop survives any error of a round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.config import HealthConfig
from gateway.fleet.bodies import read_bounded
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.interval import Interval
from gateway.fleet.lora import adapter_parents
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.metrics import GatewayMetrics

__all__ = ["HealthChecker", "HealthTracker", "parse_model_ids"]

log = logging.getLogger(__name__)

_MAX_MODELS = 4096


class HealthTracker:
    """Consecutive-result thresholds per endpoint; flips ``endpoint.healthy`` and says so."""

    def __init__(self, registry: EndpointRegistry, config: HealthConfig, metrics: GatewayMetrics) -> None:
        self._registry = registry
        self._config = config
        self._metrics = metrics
        self.on_change: Callable[[Endpoint, bool], None] | None = None

    def reconfigure(self, config: HealthConfig) -> None:
        """A reloaded ``health`` section: the thresholds apply from the next probe result."""
        self._config = config

    def record(self, endpoint: Endpoint, ok: bool) -> bool:
        """Apply thresholds; return True when the endpoint's health flipped."""
        endpoint = endpoint.owner  # health is per URL: a DP rank target's is its replica's
        if ok:
            endpoint.consecutive_successes += 1
            endpoint.consecutive_failures = 0
        else:
            endpoint.consecutive_failures += 1
            endpoint.consecutive_successes = 0
        was, inherited = endpoint.healthy, endpoint.inherited_health
        endpoint.inherited_health = False
        if not was and ok and endpoint.consecutive_successes >= self._config.healthy_threshold:
            endpoint.healthy = True
        elif (
            was
            and not ok
            and (inherited or endpoint.consecutive_failures >= self._config.unhealthy_threshold)
        ):
            endpoint.healthy = False
        if endpoint in self._registry:  # a removed endpoint's late probe must not recreate its gauge
            self._metrics.endpoint_healthy.labels(endpoint.name).set(1 if endpoint.healthy else 0)
        if endpoint.healthy != was:
            log.warning("endpoint %s is now %s", endpoint.name, "UP" if endpoint.healthy else "DOWN")
            if self.on_change:
                self.on_change(endpoint, endpoint.healthy)
            return True
        return False

    def mark_failed(self, endpoint: Endpoint) -> None:
        """Passive signal from the proxy (connection refused): count it like a failed probe."""
        if self.record(endpoint, False):
            self._registry.rebuild()


def parse_model_ids(payload: object) -> frozenset[str]:
    """The ids of an OpenAI ``/v1/models`` answer; ValueError when it is not one."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: 'data' is not a list")
    models = set()
    for item in data[:_MAX_MODELS]:
        model = item.get("id") if isinstance(item, dict) else None
        if not isinstance(model, str) or not model or len(model) > 512:
            raise ValueError(f"/v1/models: a model id is not a non-empty string: {model!r:.80}")
        models.add(model)
    return frozenset(models)


class HealthChecker:
    def __init__(
        self,
        registry: EndpointRegistry,
        tracker: HealthTracker,
        session: aiohttp.ClientSession,
        config: HealthConfig,
    ) -> None:
        self._registry = registry
        self._tracker = tracker
        self._session = session
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._interval = Interval(config.interval_s)
        self._listed_at: dict[str, float] = {}  # endpoint URL -> when its /v1/models was last read

    def reconfigure(self, config: HealthConfig) -> None:
        """A reloaded ``health`` section: path and timeout from the next probe, the interval now."""
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._interval.set(config.interval_s)

    async def run(self, *, pause_first: bool = False) -> None:
        async for _ in self._interval.rounds(pause_first=pause_first):
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("health checks: round failed; next round in %.1fs", self._config.interval_s)

    async def check_all(self) -> None:
        endpoints = list(self._registry)
        for url in self._listed_at.keys() - {e.url for e in endpoints}:  # left the fleet
            del self._listed_at[url]
        await self.check(endpoints)

    async def check(self, endpoints: list[Endpoint]) -> None:
        """Probe these endpoints now (new ones join without waiting for the next round)."""
        results = await asyncio.gather(*(self._probe(e) for e in endpoints), return_exceptions=True)
        changed = False
        for endpoint, ok in zip(endpoints, results, strict=True):
            if isinstance(ok, BaseException):
                if isinstance(ok, asyncio.CancelledError):
                    raise ok
                log.warning("endpoint %s: health probe failed: %r", endpoint.name, ok)
                ok = False
            changed |= self._tracker.record(endpoint, ok)
        if changed:
            self._registry.rebuild()

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"authorization": endpoint.auth_header} if endpoint.auth_header else {}

    async def _probe(self, endpoint: Endpoint) -> bool:
        try:
            async with self._session.get(
                endpoint.base_url + self._config.path,
                timeout=self._timeout,
                headers=self._headers(endpoint),
                ssl=endpoint.ssl_context or True,
            ) as resp:
                if resp.status != 200:
                    return False
            if not endpoint.configured_models and not endpoint.discovered_models:
                endpoint.discovered_models = await self._discover_models(endpoint)
                return bool(endpoint.discovered_models)
            if not endpoint.configured_models and self._refresh_due(endpoint):
                await self._refresh_models(endpoint)
            return True
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("endpoint %s: probe failed: %s", endpoint.name, exc)
            return False

    def _refresh_due(self, endpoint: Endpoint) -> bool:
        if endpoint.inherited_health:  # its models too were the departed copy's
            return True
        return time.monotonic() - self._listed_at.get(endpoint.url, 0.0) >= self._config.models_refresh_s

    async def _refresh_models(self, endpoint: Endpoint) -> None:
        """Re-read a discovered model list: adapters come and go at run time. An empty or
        unusable answer keeps the old list (the health probe, not this, says it is down)."""
        try:
            models = await self._discover_models(endpoint)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("endpoint %s: model list refresh failed: %s", endpoint.name, exc)
            return
        if models and models != endpoint.discovered_models:
            endpoint.discovered_models = models
            if endpoint in self._registry:
                self._registry.rebuild()

    async def _discover_models(self, endpoint: Endpoint) -> frozenset[str]:
        async with self._session.get(
            endpoint.base_url + "/v1/models",
            timeout=self._timeout,
            headers=self._headers(endpoint),
            ssl=endpoint.ssl_context or True,
        ) as resp:
            if resp.status != 200:
                return frozenset()
            payload = json.loads(await read_bounded(resp))  # JSON is UTF-8 (RFC 8259), whatever it says
        self._listed_at[endpoint.url] = time.monotonic()
        try:
            models = parse_model_ids(payload)
        except ValueError as exc:
            log.warning("endpoint %s: unusable model list, kept unhealthy: %s", endpoint.name, exc)
            return frozenset()
        endpoint.adapters = adapter_parents(payload)
        if models and models != endpoint.discovered_models:
            log.info("endpoint %s serves %s", endpoint.name, sorted(models))
        return models
