"""A routing policy as one object: the scheduler and the hook chains built with it.

A reload that changes the policy builds a new :class:`Routing` and swaps it in one
assignment, so the hooks always match the scheduler: a policy that reads the prefix
index gets the hook that fills it, whichever policy the gateway started with. A
request reads ``state.routing`` once and keeps that pair to its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.fleet.endpoint import Endpoint
from gateway.http.presets import scheduler_specs
from gateway.proxy.hooks import (
    BreakerHook,
    HookChain,
    HookSet,
    InFlightHook,
    PassiveHealthHook,
    PDHook,
    PrefixHook,
    RequestHooks,
    SessionHook,
)
from gateway.proxy.latency_hook import LatencyHook
from gateway.proxy.resilience import CircuitBreakers
from gateway.proxy.response_hook import ResponseHook
from gateway.scheduling.build import build_scheduler
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.registry import PluginRegistry
from gateway.scheduling.scheduler import Scheduler

__all__ = ["Routing", "build_routing"]


@dataclass(frozen=True, slots=True)
class Routing:
    scheduler: Scheduler
    hooks: HookSet


def build_routing(
    config: GatewayConfig,
    registry: PluginRegistry,
    context: PluginContext,
    breakers: CircuitBreakers,
    mark_failed: Callable[[Endpoint], None],
) -> Routing:
    """Validate and build the policy the config names (raises ConfigError, nothing changed)."""
    plugins, profiles = scheduler_specs(config)
    scheduler = build_scheduler(plugins, profiles, registry, context)
    attempt: list[RequestHooks] = [
        InFlightHook(context.saturation.note_sent),
        BreakerHook(breakers),
        PassiveHealthHook(mark_failed),
        SessionHook(context.sessions),
        PDHook(context.metrics),
        ResponseHook(context.sessions, scoped=config.auth.enabled),
    ]
    # A prefill leg's verdict feeds its replica's breaker and passive health like any attempt's:
    # a broken prefill replica is ejected instead of being tried first by every request.
    prefill: list[RequestHooks] = [
        InFlightHook(context.saturation.note_sent),
        BreakerHook(breakers),
        PassiveHealthHook(mark_failed),
    ]
    if scheduler.preparers:  # only policies that read the prefix index pay for hashing and recording
        attempt.append(PrefixHook(context.prefix, context.metrics))
        prefill.append(PrefixHook(context.prefix, context.metrics, count_overrides=False))
    if context.latency is not None:  # first: it sees the replica as routing did, before this attempt
        attempt.insert(0, LatencyHook(context.latency, context.prefix, context.metrics))
    return Routing(scheduler, HookSet(HookChain(attempt), HookChain(prefill)))
