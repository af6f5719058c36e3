"""``build_app(config)``: the only place that wires objects together.

Each resource with a lifetime (the upstream client session, the health checker, the
metrics poller) gets one ``cleanup_ctx`` entry, so start-up and shutdown stay paired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.endpoints.health import HealthChecker
from gateway.endpoints.poller import MetricsPoller
from gateway.endpoints.registry import EndpointRegistry, endpoint_from_config
from gateway.handlers import add_routes
from gateway.hooks import HookChain, InFlightHook
from gateway.metrics import GatewayMetrics
from gateway.middleware import error_middleware
from gateway.proxy import Proxy
from gateway.scheduling.build import build_scheduler
from gateway.scheduling.registry import PluginRegistry, default_registry
from gateway.state import STATE, GatewayState

__all__ = ["build_app"]

log = logging.getLogger(__name__)


def build_app(config: GatewayConfig, plugin_registry: PluginRegistry | None = None) -> web.Application:
    """Validate and wire everything; raises ConfigError before any socket is opened."""
    metrics = GatewayMetrics()
    registry = EndpointRegistry(endpoint_from_config(e) for e in config.endpoints)
    scheduler = build_scheduler(config, plugin_registry or default_registry(), metrics)
    state = GatewayState(config=config, registry=registry, metrics=metrics, scheduler=scheduler)

    app = web.Application(client_max_size=config.server.max_body_bytes, middlewares=[error_middleware])
    app[STATE] = state
    add_routes(app)
    app.cleanup_ctx.append(_upstream_session)
    app.cleanup_ctx.append(_endpoint_monitors)
    return app


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    """One ClientSession for the process, with deliberate connector limits."""
    state = app[STATE]
    limits = state.config.limits
    connector = aiohttp.TCPConnector(
        limit=limits.upstream_connections,
        limit_per_host=limits.upstream_connections_per_endpoint,
        keepalive_timeout=30,
        enable_cleanup_closed=True,
    )
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    app[_SESSION] = session
    health = HealthChecker(state.registry, session, state.config.health, state.metrics)
    app[_HEALTH] = health
    state.proxy = Proxy(
        session,
        state.config.timeouts,
        limits,
        state.metrics,
        HookChain([InFlightHook(state.metrics)]),
        on_connect_failure=health.mark_failed,
    )
    yield
    await session.close()


async def _endpoint_monitors(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    health = app[_HEALTH]
    poller = MetricsPoller(state.registry, app[_SESSION], state.config.scrape, state.metrics)
    # One synchronous round first, so a freshly started gateway is ready at once.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(state.config.health.timeout_s + 1):
            await health.check_all()
    tasks = [asyncio.create_task(health.run(), name="health-checks")]
    if state.config.scrape.enabled:
        tasks.append(asyncio.create_task(poller.run(), name="metrics-poller"))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("upstream_session", aiohttp.ClientSession)
_HEALTH: web.AppKey[HealthChecker] = web.AppKey("health_checker", HealthChecker)
