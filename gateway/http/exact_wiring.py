"""Wiring of the exact prefix index (``prefix.exact: auto``): the index, the engine-token
client and the KV-event subscriber, built here so ``app.py`` only calls two functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.config import GatewayConfig
from gateway.fleet.kv_events import KVEventSubscriber
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.cache import PrefixCache
from gateway.prefix.engine_tokens import EngineTokens
from gateway.prefix.exact import ExactIndex
from gateway.prefix.exact_match import ExactPrefix
from gateway.prefix.local_tokens import LocalTokens

__all__ = ["attach_exact_prefix", "kv_event_subscriber"]


def attach_exact_prefix(config: GatewayConfig, metrics: GatewayMetrics, prefix: PrefixCache) -> None:
    """Give ``prefix`` its exact index (a plugin-visible service: ``context.prefix.exact``)."""
    if config.prefix.exact == "off":
        return
    settings = config.prefix.kv_events
    kv_metrics = KVEventMetrics(metrics.registry)
    tokenizer = settings.tokenizer
    local = LocalTokens(tokenizer, kv_metrics) if tokenizer.source != "engine" else None
    prefix.exact = ExactPrefix(
        ExactIndex(
            kv_metrics,
            settings.max_blocks_per_endpoint,
            pending_grace_s=settings.pending_grace_s if settings.pending_blocks else None,
        ),
        EngineTokens(
            kv_metrics,
            timeout_s=settings.tokenize_timeout_s,
            cache_entries=settings.token_cache_entries,
            reuse_turns=settings.reuse_turn_tokens,
            local=local,
        ),
        kv_metrics,
    )


def kv_event_subscriber(
    config: GatewayConfig,
    registry: EndpointRegistry,
    prefix: PrefixCache,
    session: aiohttp.ClientSession,
    restarts: Callable[[str], Any] | None = None,
) -> KVEventSubscriber | None:
    """The subscriber to run as a supervised task (None with ``prefix.exact: off``)."""
    exact = prefix.exact
    if exact is None:
        return None
    exact.tokens.session = session
    return KVEventSubscriber(
        registry,
        session,
        exact.index,
        exact.metrics,
        config.prefix.kv_events,
        on_crash=(lambda name: restarts(name).inc()) if restarts is not None else None,
    )
