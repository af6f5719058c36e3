"""Per-route HTTP metrics, and the Responses API's stored-response lookups.

``llm_gateway_requests_total`` counts what came back from a replica; a request the gateway
refuses itself (400 on a hostile body, 401, 404, 429 from a rate limit or the queue, 503 with
no replica) never reaches one. These count every answer by route pattern, so the dashboard's
error rate includes the gateway's own refusals, and each API (Responses, Messages, rerank …)
has its own rate and latency. Registered next to :class:`~gateway.ops.metrics.GatewayMetrics`
(at its module size bound) in the same registry.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gateway.ops.lockfree import LockFreeCounter as Counter
from gateway.ops.lockfree import LockFreeHistogram as Histogram

__all__ = ["RESPONSE_LOOKUP_RESULTS", "UNMATCHED", "RouteMetrics"]

RESPONSE_LOOKUP_RESULTS = ("hit", "probed", "not_found", "replica_unavailable")
UNMATCHED = "unmatched"  # an unknown path: never the raw path as a label (unbounded series)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "llm_gateway_http_requests",
            "HTTP answers by route pattern and status, the gateway's own refusals included",
            ["route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "llm_gateway_http_request_duration_seconds",
            "From a request's arrival to the end of its answer (streams included), by route pattern",
            ["route"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.lookups = Counter(
            "llm_gateway_response_lookups",
            "Stored-response lookups (previous_response_id, /v1/responses/{id}) by result: hit (the "
            "store), probed (found by asking the replicas), not_found, replica_unavailable",
            ["result"],
            registry=registry,
        )
        self._lookup = {r: self.lookups.labels(r) for r in RESPONSE_LOOKUP_RESULTS}  # exported at 0
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        """One answer (memoised children: this runs on every request)."""
        key = (route, status)
        pair = self._children.get(key)
        if pair is None:
            pair = self._children[key] = (
                self.requests.labels(route, str(status)),
                self.duration.labels(route),
            )
        pair[0].inc()
        pair[1].observe(seconds)

    def lookup(self, result: str) -> None:
        self._lookup[result].inc()
