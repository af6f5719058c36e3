"""``build_app(config)``: the only place that wires objects together.

Each resource with a lifetime (the upstream client session, the prefix index's
Redis connection, the health checker, the metrics poller) gets one ``cleanup_ctx``
entry, so start-up and shutdown stay paired.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from gateway.admission.aliases import ModelAliases
from gateway.admission.latency_model import LatencyModel
from gateway.admission.queue import AdmissionController
from gateway.admission.saturation import SaturationDetector
from gateway.config import EndpointConfig, GatewayConfig, PrefixConfig, SessionConfig
from gateway.fleet.autoscale import AutoscaleCollector
from gateway.fleet.endpoint import Endpoint, Role
from gateway.fleet.health import HealthChecker, HealthTracker
from gateway.fleet.membership import CONFIG_SOURCE, FleetMembership
from gateway.fleet.poller import MetricsPoller
from gateway.fleet.registry import EndpointRegistry, endpoint_from_config
from gateway.http.access_log import AccessLog
from gateway.http.admin import add_admin_routes
from gateway.http.exact_wiring import attach_exact_prefix, kv_event_subscriber
from gateway.http.fleet_events import FleetEvents
from gateway.http.handlers import add_routes
from gateway.http.middleware import error_middleware
from gateway.http.plugins import default_registry
from gateway.http.routing import build_routing
from gateway.http.slo import PrefixTtftPredictor
from gateway.http.state import STATE, GatewayState
from gateway.http.workers import WorkerSlot, attach_worker
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.route_metrics import RouteMetrics
from gateway.ops.tasks import supervise
from gateway.prefix.cache import PrefixCache
from gateway.prefix.index import PrefixIndex
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.proxy.forward import Proxy, ProxySettings
from gateway.proxy.pd import PDCoordinator
from gateway.proxy.resilience import CircuitBreakers, RetryBudget
from gateway.proxy.upstream import UpstreamClient
from gateway.request.parse import ParseOptions
from gateway.request.slo import SloOptions
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.registry import PluginRegistry
from gateway.sessions.affinity import SessionAffinity
from gateway.sessions.placement import SessionPlacement
from gateway.sessions.responses import MemoryResponseStore, RedisResponseStore, ResponseStore
from gateway.sessions.store import (
    MemorySessionStore,
    RedisSessionStore,
    SessionStore,
    SessionTokens,
    rendezvous_pick,
)

__all__ = [
    "build_app",
    "build_plugin_context",
    "build_prefix_index",
    "build_session_store",
    "parse_options",
    "proxy_settings",
    "share_sessions_across_workers",
]

log = logging.getLogger(__name__)


def build_prefix_index(config: PrefixConfig, metrics: GatewayMetrics) -> PrefixIndex:
    local = MemoryPrefixIndex(default_capacity=config.capacity_blocks, ttl_s=config.ttl_s)
    if config.backend == "memory":
        return local
    from gateway.prefix.redis import RedisPrefixIndex
    from gateway.redis_client import redis_client

    client = redis_client(config.redis_url, health_check_interval=5)
    return RedisPrefixIndex(
        client,
        local,
        key_prefix=config.key_prefix,
        budget_s=config.redis_budget_s,
        retry_after_s=config.redis_retry_after_s,
        on_fallback=lambda reason: metrics.redis_fallbacks.labels(reason).inc(),
        on_latency=metrics.redis_latency.observe,
    )


def build_session_store(config: SessionConfig, metrics: GatewayMetrics) -> SessionStore:
    local = MemorySessionStore(ttl_s=config.ttl_s, max_sessions=config.max_sessions)
    if config.backend == "memory":
        return local
    from gateway.redis_client import redis_client

    client = redis_client(config.redis_url)
    return RedisSessionStore(
        client,
        local,
        key_prefix=config.key_prefix,
        budget_s=config.redis_budget_s,
        on_fallback=lambda reason: metrics.session_fallbacks.labels(reason).inc(),
    )


def build_response_store(config: SessionConfig, metrics: GatewayMetrics) -> ResponseStore:
    """Response id → replica: the sessions' backend (memory, or the same Redis)."""
    local = MemoryResponseStore(ttl_s=config.response_ttl_s, max_entries=config.max_responses)
    if config.backend == "memory":
        return local
    from gateway.redis_client import redis_client

    client = redis_client(config.redis_url)
    return RedisResponseStore(
        client,
        local,
        key_prefix=config.key_prefix,
        budget_s=config.redis_budget_s,
        on_fallback=lambda reason: metrics.session_fallbacks.labels(reason).inc(),
    )


def share_sessions_across_workers(
    config: GatewayConfig, store: SessionStore, registry: EndpointRegistry
) -> None:
    """With several workers and the memory store, sessions a worker has no pin for go to
    the replica :func:`rendezvous_pick` chooses among the healthy ones, the same in every
    worker, so a conversation stays on one replica across fresh connections. (The Redis
    store is shared, so it needs none; one worker keeps the load-aware first placement.)"""
    if config.server.workers == 1 or not isinstance(store, MemorySessionStore):
        return

    def hashed_pin(session_id: str) -> str | None:
        names = (e.name for e in registry.targets() if e.healthy and e.role is not Role.PREFILL)
        return rendezvous_pick(session_id, names)

    store.fallback = hashed_pin


def build_plugin_context(
    config: GatewayConfig, metrics: GatewayMetrics, prefix_index: PrefixIndex | None = None
) -> PluginContext:
    """The shared services plugins are built with: prefix cache, sessions, saturation detector."""
    prefix = PrefixCache(
        prefix_index or build_prefix_index(config.prefix, metrics),
        metrics,
        block_bytes=config.prefix.block_bytes,
        default_capacity_blocks=config.prefix.capacity_blocks,
        max_blocks=config.prefix.max_prompt_blocks,
    )
    attach_exact_prefix(config, metrics, prefix)
    detector = SaturationDetector(config.admission)
    sessions = SessionAffinity(
        build_session_store(config.sessions, metrics),
        SessionTokens(config.sessions.token_secret),
        detector,
        metrics,
        config.sessions.token_header,
        build_response_store(config.sessions, metrics),
        SessionPlacement(config.sessions.ttl_s, config.sessions.max_sessions),
    )
    slo = config.admission.slo
    latency = LatencyModel(
        detector, horizon=slo.horizon, min_samples=slo.min_samples, training_per_s=slo.training_per_s
    )
    return PluginContext(
        metrics=metrics, prefix=prefix, sessions=sessions, saturation=detector, latency=latency
    )


def proxy_settings(config: GatewayConfig) -> ProxySettings:
    resilience = config.resilience
    return ProxySettings(
        timeouts=config.timeouts,
        limits=config.limits,
        retry_budget=RetryBudget(resilience.retry_budget_ratio, resilience.retry_budget_min_per_s),
        retry_backoff_s=resilience.retry_backoff_s,
    )


def parse_options(config: GatewayConfig) -> ParseOptions:
    return ParseOptions(
        session_header=config.sessions.header,
        session_body_fields=tuple(config.sessions.body_fields),
        priority_header=config.admission.priority_header,
        tenant_header=config.admission.tenant_header,
        max_json_depth=config.server.max_json_depth,
        max_json_containers=config.server.max_json_containers,
        slo=SloOptions(
            ttft_header=config.admission.slo.ttft_header,
            tpot_header=config.admission.slo.tpot_header,
            defaults={p: (t.ttft_ms, t.tpot_ms) for p, t in config.admission.slo.defaults.items()},
        ),
        session_sources=tuple(config.sessions.sources or ()),
    )


def build_app(
    config: GatewayConfig, plugin_registry: PluginRegistry | None = None, worker: WorkerSlot | None = None
) -> web.Application:
    """Validate and wire everything; raises ConfigError before any socket is opened.

    ``worker``: this process is one of several workers (``serve``), sharing their fleet view.
    """
    metrics = GatewayMetrics()
    registry = EndpointRegistry(endpoint_from_config(e) for e in config.endpoints)
    membership = FleetMembership(registry)
    membership.seed(CONFIG_SOURCE, config.endpoints)
    context = build_plugin_context(config, metrics)
    share_sessions_across_workers(config, context.sessions.store, registry)
    prefix, sessions, detector = context.prefix, context.sessions, context.saturation
    plugin_registry = plugin_registry or default_registry()
    breakers = CircuitBreakers(config.resilience, registry, metrics, scrape_timeout_s=config.scrape.timeout_s)
    health = HealthTracker(registry, config.health, metrics)
    state = GatewayState(
        config=config,
        registry=registry,
        metrics=metrics,
        routing=build_routing(config, plugin_registry, context, breakers, health.mark_failed),
        prefix=prefix,
        sessions=sessions,
        admission=AdmissionController(
            config.admission,
            detector,
            metrics,
            registry.candidates,
            PrefixTtftPredictor(prefix, context.latency) if context.latency is not None else None,
        ),
        access_log=AccessLog(config.server.access_log == "json"),
        breakers=breakers,
        health=health,
        membership=membership,
        plugin_registry=plugin_registry,
        plugin_context=context,
        parse_options=parse_options(config),
        aliases=ModelAliases(config.models, metrics.registry, lambda model: bool(registry.candidates(model))),
        routes=RouteMetrics(metrics.registry),
    )

    if config.discovery.kubernetes is not None or config.discovery.dns:
        from gateway.fleet.discovery import build_sources

        redis = (config.prefix.redis_url, config.sessions.redis_url, config.auth.redis_url)
        app_sources = build_sources(config.discovery, redis)  # ConfigError now, not at the first watch
    else:
        app_sources = []
    if config.auth.enabled:
        from gateway.auth.tenancy import TenantAuth

        state.auth = TenantAuth(config.auth, metrics)
    metrics.watch_endpoints(registry.targets, prefix.size, prefix.capacity)
    metrics.sessions_active.set_function(sessions.store.active)
    metrics.registry.register(AutoscaleCollector(lambda: list(registry), lambda: state.config.autoscale))

    app = web.Application(client_max_size=config.server.max_body_bytes, middlewares=[error_middleware])
    app[STATE] = state
    app[_DISCOVERY] = app_sources
    add_routes(app)
    add_admin_routes(app)
    app.cleanup_ctx.append(_prefix_index)
    app.cleanup_ctx.append(_upstream_session)
    app.cleanup_ctx.append(_endpoint_monitors)
    if worker is not None:
        attach_worker(app, state, worker)
    return app


async def _prefix_index(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[STATE].prefix.index.close()
    await app[STATE].sessions.store.close()
    await app[STATE].sessions.responses.close()
    if app[STATE].auth is not None:
        await app[STATE].auth.close()


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    """The hot-path upstream client, and one aiohttp ClientSession for health checks and scrapes."""
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
    health = HealthChecker(state.registry, state.health, session, state.config.health)
    client = UpstreamClient(
        connect_timeout_s=state.config.timeouts.connect_s,
        limit_per_endpoint=limits.upstream_connections_per_endpoint,
        ssl_context_for=lambda url: e.ssl_context if (e := state.registry.get(url)) is not None else None,
    )
    events = FleetEvents(state, client, health)
    state.health.on_change = events.on_health_change
    app[_HEALTH] = health
    app[_FORGET] = events.forget
    state.probe = health.check
    state.health_checker = health
    state.membership.on_removed = events.on_removed
    state.registry.on_dropped_targets = events.on_dropped_targets
    state.membership.on_added = events.on_added
    state.membership.on_replaced = events.on_replaced
    state.plugin_context.saturation.pool_waiting = pool_waiting = lambda e: client.waiting(e.url)
    state.metrics.watch_pool_waiting(pool_waiting)
    pd = PDCoordinator(client, state.config.pd, state.metrics)
    pd.on_rank_refused = events.on_rank_refused
    state.proxy = Proxy(
        client,
        proxy_settings(state.config),
        state.metrics,
        state.breakers,
        pd,
        after_request=events.after_request,
        on_rank_refused=events.on_rank_refused,
    )
    yield
    await events.close()
    await client.close()
    await session.close()


async def _endpoint_monitors(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    health = app[_HEALTH]
    poller = MetricsPoller(
        state.registry,
        app[_SESSION],
        state.config.scrape,
        state.metrics,
        on_restart=app[_FORGET],
        on_scraped=_on_scraped(state),
        on_stale=_on_stale(state),
    )
    if state.config.scrape.enabled:
        state.poller = poller
        state.plugin_context.saturation.request_scrape = poller.scrape_soon
        state.plugin_context.saturation.scraping_soon = poller.scraping_soon
    # One synchronous round first, so a freshly started gateway is ready at once. Where it
    # learned everything (every replica up, every scrape answered) the loops start with their
    # pause: a second round at once would scrape the first requests' burst in mid-flight and
    # tell the burst detector the engines had already seen it. Otherwise they retry at once.
    probed = scraped = False
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(state.config.health.timeout_s + state.config.scrape.timeout_s + 1):
            await health.check_all()
            probed = all(e.healthy for e in state.registry)
            if state.config.scrape.enabled:
                await poller.scrape_all()
                scraped = all(e.metrics.scraped_at > 0 for e in state.registry)
    runs: dict[str, Callable[[], Awaitable[None]]] = {
        "health-checks": functools.partial(health.run, pause_first=probed),
        "admission-ticker": lambda: _admission_ticker(state),
        "circuit-breakers": state.breakers.run,
    }
    if state.config.scrape.enabled:
        runs["metrics-poller"] = functools.partial(poller.run, pause_first=scraped)
    kv_events = kv_event_subscriber(
        state.config, state.registry, state.prefix, app[_SESSION], state.metrics.task_restarts.labels
    )
    if kv_events is not None:
        runs["kv-events"] = kv_events.run
    apply = _apply_discovered(state)
    for source in app[_DISCOVERY]:
        source.on_failure = state.metrics.discovery_failures.labels(source.name).inc
        runs[f"discovery-{source.name}"] = functools.partial(source.run, apply)
    restarts = state.metrics.task_restarts
    tasks = [
        asyncio.create_task(supervise(name, run, on_crash=lambda n: restarts.labels(n).inc()), name=name)
        for name, run in runs.items()
    ]
    yield
    state.plugin_context.saturation.request_scrape = lambda endpoint: None
    state.plugin_context.saturation.scraping_soon = lambda endpoints: []
    poller.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _apply_discovered(state: GatewayState) -> Callable[[str, list[EndpointConfig]], None]:
    """A discovery source's full list → fleet membership, minus what cannot be routed to."""

    def apply(source: str, endpoints: list[EndpointConfig]) -> None:
        usable = []
        for endpoint in endpoints:
            if (
                endpoint.role == "prefill"
                and state.config.pd.protocol == "sglang"
                and endpoint.bootstrap_port is None
            ):
                log.warning(
                    "discovery %s: SGLang prefill %s has no bootstrap port; skipped", source, endpoint.url
                )
                continue
            usable.append(endpoint)
        state.membership.apply(source, usable)
        state.metrics.discovery_updates.labels(source).inc()

    return apply


def _on_scraped(state: GatewayState) -> Callable[[Endpoint], None]:
    def on_scraped(endpoint: Endpoint) -> None:
        state.plugin_context.saturation.observe(endpoint)
        state.prefix.update_engine_capacity(endpoint)
        state.admission.publish_saturation((endpoint,))
        state.admission.wake()

    return on_scraped


def _on_stale(state: GatewayState) -> Callable[[Endpoint], None]:
    def on_stale(endpoint: Endpoint) -> None:
        """Its load is unknown now: not saturated (admission fails open), and so exported."""
        state.admission.publish_saturation((endpoint,))
        state.admission.wake()

    return on_stale


async def _admission_ticker(state: GatewayState, interval_s: float = 0.05) -> None:
    """Queued requests are re-considered on releases and scrapes, and at least this often."""
    while True:
        await asyncio.sleep(interval_s)
        state.admission.wake()


_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("upstream_session", aiohttp.ClientSession)
_HEALTH: web.AppKey[HealthChecker] = web.AppKey("health_checker", HealthChecker)
_FORGET: web.AppKey[object] = web.AppKey("forget_endpoint", object)
_DISCOVERY: web.AppKey[list] = web.AppKey("discovery_sources", list)
