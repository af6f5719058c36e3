"""The objects one gateway app wires together, reachable from handlers through one AppKey."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.admission.aliases import ModelAliases
from gateway.admission.queue import AdmissionController
from gateway.config import GatewayConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.health import HealthChecker, HealthTracker
from gateway.fleet.membership import FleetMembership
from gateway.fleet.poller import MetricsPoller
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.shared_load import SharedLoad
from gateway.http.access_log import AccessLog
from gateway.http.routing import Routing
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.route_metrics import RouteMetrics
from gateway.prefix.cache import PrefixCache
from gateway.proxy.forward import Proxy
from gateway.proxy.resilience import CircuitBreakers
from gateway.request.parse import ParseOptions
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.registry import PluginRegistry
from gateway.sessions.affinity import SessionAffinity

if TYPE_CHECKING:
    from gateway.http.admin_share import AdminShare
    from gateway.http.metrics_share import MetricsShare

__all__ = ["STATE", "GatewayState"]


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    registry: EndpointRegistry
    metrics: GatewayMetrics
    routing: Routing  # the policy and its hook chains; a reload swaps both in one assignment
    prefix: PrefixCache
    sessions: SessionAffinity
    admission: AdmissionController
    parse_options: ParseOptions
    access_log: AccessLog
    breakers: CircuitBreakers
    health: HealthTracker
    membership: FleetMembership
    plugin_registry: PluginRegistry
    plugin_context: PluginContext
    proxy: Proxy | None = None  # set once the client session exists (app startup)
    probe: Callable[[list[Endpoint]], Awaitable[None]] | None = None  # health-check these now
    health_checker: HealthChecker | None = None  # set at app startup; a reload reconfigures it
    poller: MetricsPoller | None = None  # set at app startup when scraping is on; likewise
    auth: Any = None  # gateway.auth wiring (TenantAuth) when auth is enabled
    side_client: Any = None  # aiohttp ClientSession for the Responses API's stateful calls
    aliases: ModelAliases | None = None  # config models: (aliases, weighted splits); reload reconfigures
    routes: RouteMetrics | None = None  # per-route answers and stored-response lookups (ops/route_metrics)
    shared_load: SharedLoad | None = None  # workers > 1: the whole gateway's load (http/workers.py)
    admin_share: AdminShare | None = None  # workers > 1: admin changes replayed by the siblings
    metrics_share: MetricsShare | None = None  # workers > 1: /metrics gathers every worker's series
    shutting_down: bool = False  # SIGTERM received: /ready says 503 while in-flight work drains


STATE: web.AppKey[GatewayState] = web.AppKey("gateway_state", GatewayState)
