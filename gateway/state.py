"""The objects one gateway app wires together, reachable from handlers through one AppKey."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.access_log import AccessLog
from gateway.admission import AdmissionController
from gateway.config import GatewayConfig
from gateway.endpoints.membership import FleetMembership
from gateway.endpoints.registry import EndpointRegistry
from gateway.metrics import GatewayMetrics
from gateway.parsing import ParseOptions
from gateway.prefix.cache import PrefixCache
from gateway.proxy import Proxy
from gateway.resilience import CircuitBreakers, RetryBudget
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.registry import PluginRegistry
from gateway.scheduling.scheduler import Scheduler
from gateway.sessions_affinity import SessionAffinity
from gateway.types import Endpoint

__all__ = ["STATE", "GatewayState"]


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    registry: EndpointRegistry
    metrics: GatewayMetrics
    scheduler: Scheduler
    prefix: PrefixCache
    sessions: SessionAffinity
    admission: AdmissionController
    parse_options: ParseOptions
    access_log: AccessLog
    breakers: CircuitBreakers
    retry_budget: RetryBudget
    membership: FleetMembership
    plugin_registry: PluginRegistry
    plugin_context: PluginContext
    proxy: Proxy | None = None  # set once the client session exists (app startup)
    probe: Callable[[list[Endpoint]], Awaitable[None]] | None = None  # health-check these now
    auth: Any = None  # gateway.auth wiring (TenantAuth) when auth is enabled
    shutting_down: bool = False  # SIGTERM received: /ready says 503 while in-flight work drains


STATE: web.AppKey[GatewayState] = web.AppKey("gateway_state", GatewayState)
