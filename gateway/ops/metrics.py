"""Every Prometheus metric the gateway exports, defined in one place.

Metrics live in a per-app ``CollectorRegistry`` (not the process-global one) so that
several gateways can run in one process (tests) without clashing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

# Counter and Histogram without a lock per update; the exposition is prometheus_client's own.
from gateway.ops.lockfree import LockFreeCounter as Counter
from gateway.ops.lockfree import LockFreeHistogram as Histogram

if TYPE_CHECKING:
    from gateway.fleet.endpoint import Endpoint

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class _EndpointStateCollector:
    """Per-endpoint gauges read at scrape time from the live ``Endpoint`` objects.

    The in-flight counters change twice per request; publishing them through Gauge
    children on every change cost more than the rest of the accounting. They are the
    gateway's own numbers, so reading them when Prometheus scrapes is exact.
    """

    def __init__(
        self,
        endpoints: Callable[[], Iterable[Endpoint]],
        index_size: Callable[[Endpoint], int],
        index_capacity: Callable[[Endpoint], int] | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._index_size = index_size
        self._index_capacity = index_capacity
        self.pool_waiting: Callable[[Endpoint], int] | None = None  # wired with the upstream client

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "llm_gateway_endpoint_in_flight_requests",
            "Requests the gateway has in flight to each endpoint",
            labels=["endpoint"],
        )
        tokens = GaugeMetricFamily(
            "llm_gateway_endpoint_in_flight_prompt_tokens",
            "Estimated prompt tokens the gateway has in flight to each endpoint",
            labels=["endpoint"],
        )
        pending = GaugeMetricFamily(
            "llm_gateway_endpoint_pending_prefill_tokens",
            "Estimated uncached prompt tokens sent to each endpoint and not yet answered",
            labels=["endpoint"],
        )
        ejected = GaugeMetricFamily(
            "llm_gateway_endpoint_ejected",
            "1 while the circuit breaker keeps the endpoint out of rotation (open or probing)",
            labels=["endpoint"],
        )
        draining = GaugeMetricFamily(
            "llm_gateway_endpoint_draining",
            "1 while the endpoint is drained (admin API): no new requests, in-flight ones finish",
            labels=["endpoint"],
        )
        index = GaugeMetricFamily(
            "llm_gateway_prefix_index_blocks",
            "Blocks the local prefix index holds per endpoint",
            labels=["endpoint"],
        )
        capacity = GaugeMetricFamily(
            "llm_gateway_prefix_index_capacity_blocks",
            "Blocks the prefix index keeps per endpoint (engine KV size, shrunk by mispredictions)",
            labels=["endpoint"],
        )
        pool_waiting = GaugeMetricFamily(
            "llm_gateway_endpoint_pool_waiting_requests",
            "Requests waiting in the gateway for a pooled connection to each endpoint (all busy)",
            labels=["endpoint"],
        )
        waiting_for = self.pool_waiting
        for endpoint in self._endpoints():
            if waiting_for is not None:
                pool_waiting.add_metric([endpoint.name], waiting_for(endpoint))
            in_flight.add_metric([endpoint.name], endpoint.in_flight)
            tokens.add_metric([endpoint.name], endpoint.in_flight_tokens)
            pending.add_metric([endpoint.name], endpoint.pending_prefill_tokens)
            ejected.add_metric([endpoint.name], 1 if endpoint.ejected else 0)
            draining.add_metric([endpoint.name], 1 if endpoint.draining else 0)
            index.add_metric([endpoint.name], self._index_size(endpoint))
            if self._index_capacity is not None:
                capacity.add_metric([endpoint.name], self._index_capacity(endpoint))
        yield from (in_flight, tokens, pending, ejected, draining, index, capacity, pool_waiting)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            # the standard process metrics (CPU seconds, RSS, open descriptors; Linux /proc), named
            # llm_gateway_process_* so that a query never mixes in the engines' own process_*
            ProcessCollector(namespace="llm_gateway", registry=registry)
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._endpoint_state: _EndpointStateCollector | None = None
        self._pool_waiting: Callable[[Endpoint], int] | None = None
        r = self.registry
        self.requests = Counter(
            "llm_gateway_requests",
            "Requests answered, by model, endpoint and HTTP status",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "llm_gateway_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte sent to the client",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llm_gateway_request_duration_seconds",
            "End-to-end request latency measured at the gateway",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.scheduling_latency = Histogram(
            "llm_gateway_scheduling_duration_seconds",
            "Time to run the scheduler for one request",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.plugin_latency = Histogram(
            "llm_gateway_plugin_duration_seconds",
            "Time spent in each scheduling plugin",
            ["kind", "plugin"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.endpoint_healthy = Gauge(
            "llm_gateway_endpoint_healthy", "1 if the endpoint passes health checks", ["endpoint"], registry=r
        )
        self.endpoint_waiting = Gauge(
            "llm_gateway_endpoint_queue_depth",
            "Waiting requests scraped from the engine",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_running = Gauge(
            "llm_gateway_endpoint_running_requests",
            "Running requests scraped from the engine",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_kv_usage = Gauge(
            "llm_gateway_endpoint_kv_cache_utilization",
            "KV-cache utilisation (0..1) scraped from the engine",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_metrics_stale = Gauge(
            "llm_gateway_endpoint_metrics_stale",
            "1 if the endpoint's scraped metrics are stale and not trusted",
            ["endpoint"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "llm_gateway_scrape_errors", "Failed metric scrapes", ["endpoint"], registry=r
        )
        self.burst_scrapes = Counter(
            "llm_gateway_burst_scrapes",
            "Scrapes admission asked for at once: in-flight grew fast on a replica of unknown capacity",
            ["endpoint"],
            registry=r,
        )
        self.retries = Counter(
            "llm_gateway_retries",
            "Requests re-sent to another endpoint before the first byte",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "llm_gateway_upstream_errors",
            "Upstream failures by endpoint and kind",
            ["endpoint", "kind"],
            registry=r,
        )
        self.prefix_predicted_blocks = Counter(
            "llm_gateway_prefix_predicted_hit_blocks",
            "Blocks of prompts the index predicted cached on the best candidate",
            registry=r,
        )
        self.prefix_prompt_blocks = Counter(
            "llm_gateway_prefix_prompt_blocks",
            "Blocks of prompts looked up in the prefix index (denominator of the predicted hit ratio)",
            registry=r,
        )
        self.observed_cached_tokens = Counter(
            "llm_gateway_observed_cached_tokens",
            "Cached prompt tokens reported by replicas in usage.prompt_tokens_details",
            registry=r,
        )
        self.observed_prompt_tokens = Counter(
            "llm_gateway_observed_prompt_tokens",
            "Prompt tokens reported by replicas in usage (denominator of the observed hit ratio)",
            registry=r,
        )
        self.prefix_mispredictions = Counter(
            "llm_gateway_prefix_mispredictions",
            "Responses whose cached tokens were far below the index's prediction",
            ["endpoint"],
            registry=r,
        )
        self.redis_latency = Histogram(
            "llm_gateway_redis_match_duration_seconds",
            "Round trip of a Redis prefix-index match",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.redis_fallbacks = Counter(
            "llm_gateway_redis_fallbacks",
            "Prefix-index operations answered locally because Redis was slow or down",
            ["reason"],
            registry=r,
        )
        self.load_overrides = Counter(
            "llm_gateway_affinity_overridden_by_load",
            "Decisions where the endpoint with the best prefix match was not chosen because of load",
            registry=r,
        )
        self.session_hits = Counter(
            "llm_gateway_session_hits", "Requests routed to their session's pinned replica", registry=r
        )
        self.session_moves = Counter(
            "llm_gateway_session_moves",
            "Sessions moved off their pinned replica, by reason (gone, saturated, scored)",
            ["reason"],
            registry=r,
        )
        self.sessions_active = Gauge(
            "llm_gateway_sessions_active", "Sessions this instance knows to be pinned", registry=r
        )
        self.session_fallbacks = Counter(
            "llm_gateway_session_store_fallbacks",
            "Session lookups answered locally because Redis was slow or down",
            ["reason"],
            registry=r,
        )
        self.admission = Counter(
            "llm_gateway_admission_decisions",
            "Admission outcomes by priority class and reason",
            ["priority", "outcome", "reason"],
            registry=r,
        )
        self.queue_length = Gauge(
            "llm_gateway_admission_queue_length", "Requests waiting for admission", ["priority"], registry=r
        )
        self.queue_wait = Histogram(
            "llm_gateway_admission_queue_wait_seconds",
            "Time requests spent waiting for admission",
            ["priority"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        # The latency model (admission/latency_model.py): what it predicted at send against what
        # each streamed answer's TTFT was, per replica; and the share of SLO'd requests served in time.
        self.ttft_predicted, self.ttft_observed = (
            Histogram(f"llm_gateway_latency_model_{kind}_ttft_seconds", f"TTFT {kind} per replica ({text})",
                      ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
            for kind, text in (("predicted", "at send"), ("observed", "streamed answers"))
        )  # fmt: skip
        self.slo_results = Counter(
            "llm_gateway_slo_requests", "Requests with a TTFT objective, by priority and met/missed",
            ["priority", "result"], registry=r,
        )  # fmt: skip
        self.endpoint_saturated = Gauge(
            "llm_gateway_endpoint_saturated",
            "1 if the saturation detector considers the endpoint saturated (unknown counts as 0)",
            ["endpoint"],
            registry=r,
        )
        self.pd_decisions = Counter(
            "llm_gateway_pd_decisions",
            "Prefill/decode decisions: disaggregated or decode-only, by reason",
            ["mode", "reason"],
            registry=r,
        )
        self.pd_degraded = Counter(
            "llm_gateway_pd_degraded",
            "Disaggregated requests that silently lost the KV transfer, by reason",
            ["reason"],
            registry=r,
        )
        self.pd_prefill_failures = Counter(
            "llm_gateway_pd_prefill_failures", "Prefill legs that failed, by kind", ["kind"], registry=r
        )
        self.pd_leg_duration = Histogram(
            "llm_gateway_pd_leg_duration_seconds",
            "Duration of each P/D leg at the gateway",
            ["leg"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pd_kv_transfer = Histogram(
            "llm_gateway_pd_kv_transfer_seconds",
            "From the prefill leg's end to the decode leg's first byte (KV transfer as seen by the gateway)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ejections = Counter(
            "llm_gateway_endpoint_ejections",
            "Times the circuit breaker took an endpoint out of rotation, by reason",
            ["endpoint", "reason"],
            registry=r,
        )
        self.ejections_skipped = Counter(
            "llm_gateway_endpoint_ejections_skipped",
            "Ejections not made because too many of the model's endpoints were already out",
            ["endpoint"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "llm_gateway_retry_budget_exhausted",
            "Failures not retried because the retry budget was spent",
            registry=r,
        )
        self.auth_failures = Counter(
            "llm_gateway_auth_failures",
            "Requests refused by authentication or authorisation, by reason",
            ["reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "llm_gateway_rate_limited",
            "Requests refused with 429 by a tenant's rate limit",
            ["tenant"],
            registry=r,
        )
        self.rate_limit_fallbacks = Counter(
            "llm_gateway_rate_limit_fallbacks",
            "Rate-limit checks answered by local buckets because Redis was slow or down",
            ["reason"],
            registry=r,
        )
        self.auth_store_fallbacks = Counter(
            "llm_gateway_auth_key_store_fallbacks",
            "API key lookups answered from the local cache because Redis was slow or down",
            ["reason"],
            registry=r,
        )
        self.config_reloads = Counter(
            "llm_gateway_config_reloads",
            "Configuration reloads by result (applied, rejected, unchanged)",
            ["result"],
            registry=r,
        )
        self.discovery_updates, self.discovery_failures = (
            Counter(f"llm_gateway_discovery_{kind}", text, ["source"], registry=r)
            for kind, text in (
                ("updates", "Endpoint sets applied from discovery sources, by source"),
                ("failures", "Discovery rounds that failed (the last set is kept), by source"),
            )
        )
        self.client_disconnects = Counter(
            "llm_gateway_client_disconnects",
            "Requests whose client went away before the response ended",
            registry=r,
        )
        self.task_restarts = Counter(
            "llm_gateway_background_task_restarts",
            "Background tasks (health checks, scrapes, discovery …) restarted after a crash, by task",
            ["task"],
            registry=r,
        )

    def per_endpoint(self) -> list[tuple[Any, tuple[str, ...]]]:
        """Every labelled metric with an ``endpoint`` label, with its label names in order."""
        return [
            (self.requests, ("model", "endpoint", "status")),
            (self.endpoint_healthy, ("endpoint",)),
            (self.endpoint_waiting, ("endpoint",)),
            (self.endpoint_running, ("endpoint",)),
            (self.endpoint_kv_usage, ("endpoint",)),
            (self.endpoint_metrics_stale, ("endpoint",)),
            (self.endpoint_saturated, ("endpoint",)),
            (self.scrape_errors, ("endpoint",)),
            (self.burst_scrapes, ("endpoint",)),
            (self.upstream_errors, ("endpoint", "kind")),
            (self.prefix_mispredictions, ("endpoint",)),
            (self.ejections, ("endpoint", "reason")),
            (self.ejections_skipped, ("endpoint",)),
            (self.ttft_predicted, ("endpoint",)),
            (self.ttft_observed, ("endpoint",)),
        ]

    def forget_endpoint(self, name: str) -> None:
        """Drop every series labelled ``endpoint=name``: the endpoint left the fleet.

        Without this a removed replica's gauges (``endpoint_healthy 1`` above all) are
        exported for the life of the process, and discovery churn (pod IPs are never
        reused soon) grows the exposition without bound. The gauges the collector reads
        from live ``Endpoint`` objects need nothing: they vanish with the endpoint.
        The memoised children go too, or a later ``child()`` would hand back a series
        the metric no longer exports.
        """
        for metric, names in self.per_endpoint():
            position = names.index("endpoint")
            stale: set[tuple[str, ...]] = set()
            for family in metric.collect():
                for sample in family.samples:
                    if sample.labels.get("endpoint") == name:
                        stale.add(tuple(sample.labels[n] for n in names))
            for labels in stale:
                metric.remove(*labels)
            for key in [
                k for k in self._children if k[0] == id(metric) and k[1][position : position + 1] == (name,)
            ]:
                del self._children[key]

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: label lookups were a hot-path cost."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_endpoints(
        self,
        endpoints: Callable[[], Iterable[Endpoint]],
        index_size: Callable[[Endpoint], int],
        index_capacity: Callable[[Endpoint], int] | None = None,
    ) -> None:
        self._endpoint_state = _EndpointStateCollector(endpoints, index_size, index_capacity)
        self._endpoint_state.pool_waiting = self._pool_waiting
        self.registry.register(self._endpoint_state)

    def watch_pool_waiting(self, waiting: Callable[[Endpoint], int]) -> None:
        """Export the upstream client's per-endpoint pool queue, read at scrape time."""
        self._pool_waiting = waiting
        if self._endpoint_state is not None:
            self._endpoint_state.pool_waiting = waiting
