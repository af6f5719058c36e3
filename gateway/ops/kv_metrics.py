"""Metrics of the engines' KV-event streams and of the exact prefix index built from them.

Registered in the gateway's own ``CollectorRegistry`` next to :class:`GatewayMetrics`
(which is at its module size bound), with the same per-endpoint ``forget``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["KVEventMetrics"]

# predicted − engine-reported cached tokens: symmetric, in tokens.
_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


_UNKNOWN_TYPES = 16  # unknown event types counted by name per endpoint; more count as "other"


class KVEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._unknown_types: dict[str, set[str]] = {}  # endpoint → the unknown types it names
        self.applied = Counter(
            "llm_gateway_kv_events_applied",
            "KV events from the engines applied to the exact prefix index",
            ["endpoint"],
            registry=registry,
        )
        self.decode_errors = Counter(
            "llm_gateway_kv_events_decode_errors",
            "KV-event frames or events that could not be decoded (skipped)",
            ["endpoint"],
            registry=registry,
        )
        self.unknown = Counter(
            "llm_gateway_kv_events_unknown",
            "KV events of a type the gateway does not know (skipped)",
            ["endpoint", "type"],
            registry=registry,
        )
        self.replays = Counter(
            "llm_gateway_kv_events_replays",
            "Replays asked of an engine's replay endpoint, by outcome",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.resets = Counter(
            "llm_gateway_kv_events_resets",
            "Times an endpoint's exact state was dropped, by reason",
            ["endpoint", "reason"],
            registry=registry,
        )
        self.lag = Gauge(
            "llm_gateway_kv_events_lag_seconds",
            "Wall-clock time from the engine publishing a KV-event batch to the gateway applying it",
            ["endpoint"],
            registry=registry,
        )
        self.live = Gauge(
            "llm_gateway_kv_events_live",
            "1 while the endpoint's KV-event stream is connected, in sequence and fresh",
            ["endpoint"],
            registry=registry,
        )
        self.exact_blocks = Gauge(
            "llm_gateway_prefix_exact_blocks",
            "Blocks the exact prefix index holds for the endpoint",
            ["endpoint"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "llm_gateway_prefix_exact_fallbacks",
            "Matches answered by the approximate index for an endpoint without exact state, by reason",
            ["endpoint", "reason"],
            registry=registry,
        )
        self.tokenize = Counter(
            "llm_gateway_prefix_tokenize",
            "Engine tokenizations for exact matching, by outcome (ok, cached, timeout, error, skipped)",
            ["outcome"],
            registry=registry,
        )
        self.tokenize_seconds = Histogram(
            "llm_gateway_prefix_tokenize_seconds",
            "Time a request waited for the engine's tokens (the /tokenize round trip; cache hits excluded)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=registry,
        )
        self.local_tokenize = Counter(
            "llm_gateway_prefix_local_tokenize",
            "Prompts tokenized in the gateway (tokenizer.json + chat template), by outcome: ok, verified, "
            "mismatch (the model goes back to /tokenize), fallback (reason: what the local path cannot do)",
            ["outcome", "reason"],
            registry=registry,
        )
        self.local_tokenize_seconds = Histogram(
            "llm_gateway_prefix_local_tokenize_seconds",
            "Time a request waited for its tokens computed in the gateway (render + encode, off the loop)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
            registry=registry,
        )
        self.prediction_error = Histogram(
            "llm_gateway_prefix_cached_tokens_prediction_error",
            "Predicted minus engine-reported cached prompt tokens, per index kind",
            ["index"],
            buckets=_ERROR_BUCKETS,
            registry=registry,
        )
        self._fallback_children: dict[tuple[str, str], Any] = {}
        self._error_children: dict[str, Any] = {}

    def fallback(self, endpoint: str, reason: str) -> Any:
        """``fallbacks.labels(endpoint, reason)``, memoised: counted on every routed request."""
        key = (endpoint, reason)
        child = self._fallback_children.get(key)
        if child is None:
            child = self._fallback_children[key] = self.fallbacks.labels(endpoint, reason)
        return child

    def error(self, index: str) -> Any:
        """``prediction_error.labels(index)``, memoised: observed on every answer."""
        child = self._error_children.get(index)
        if child is None:
            child = self._error_children[index] = self.prediction_error.labels(index)
        return child

    def count_unknown(self, endpoint: str, kind: str) -> None:
        """An event of a type the gateway does not know: by name for an endpoint's first 16 types
        (an engine newer than the gateway), as "other" past them: a publisher's made-up types
        would each be a series for ever (per endpoint, not per connection: it reconnects)."""
        seen = self._unknown_types.setdefault(endpoint, set())
        if kind not in seen and len(seen) >= _UNKNOWN_TYPES:
            kind = "other"
        else:
            seen.add(kind)
        self.unknown.labels(endpoint, kind).inc()

    def forget(self, endpoint: str) -> None:
        """An endpoint left the fleet: drop its series."""
        self._unknown_types.pop(endpoint, None)
        for key in [k for k in self._fallback_children if k[0] == endpoint]:
            del self._fallback_children[key]
        for metric in (self.applied, self.decode_errors, self.lag, self.live, self.exact_blocks):
            try:
                metric.remove(endpoint)
            except KeyError:
                pass
        for metric in (self.unknown, self.replays, self.resets, self.fallbacks):
            for labels in list(metric._metrics):  # prometheus_client has no "remove by one label"
                if labels[0] == endpoint:
                    metric.remove(*labels)
