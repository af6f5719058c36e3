"""Saturation detector: is a replica (or a whole pool) out of headroom right now?

A replica is saturated when its waiting queue ≥ ``queue_depth_threshold`` or its KV
utilisation ≥ ``kv_utilization_threshold`` (llm-d's utilisation detector defaults:
5 and 0.8). Both are estimates *now*, not at the last scrape, so that a burst from an
idle fleet is seen from its first requests:

- queue: the engine's scraped ``waiting`` plus what the gateway sent since that scrape
  if the engine was already queueing then; and, once the replica's batch capacity is
  known, everything the gateway has in flight beyond that capacity. The capacity is the
  configured ``max_num_seqs``, else learned: the most requests the engine ran at a
  scrape where others were waiting (only then is ``running`` its limit — learning from
  any scrape would call a replica that merely has not been busy yet saturated);
- KV: the scraped utilisation plus the prompt tokens sent since that scrape, against the
  engine's KV size from ``cache_config_info``.

Stale metrics are "unknown", never "saturated": a pool whose every replica is
unknown is *not* saturated (fail open). llm-d once failed closed here and turned a
metrics outage into 500s for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint

__all__ = ["SaturationDetector"]


class SaturationDetector:
    def __init__(self, config: AdmissionConfig) -> None:
        # Requests waiting in the gateway for one of the endpoint's pooled connections (the
        # upstream client's count, wired by the app); they are in ``in_flight`` but the engine
        # has not seen them, so they are queued, whatever its metrics say.
        self.pool_waiting: Callable[[Endpoint], int] = lambda endpoint: 0
        self.reconfigure(config)

    def reconfigure(self, config: AdmissionConfig) -> None:
        self._queue_threshold = config.queue_depth_threshold
        self._kv_threshold = config.kv_utilization_threshold
        self._endpoint_cap = config.endpoint_max_concurrency

    def observe(self, endpoint: Endpoint) -> None:
        """Called right after each successful scrape: learn the batch capacity, note the tokens."""
        metrics = endpoint.metrics
        metrics.in_flight_tokens_at_scrape = endpoint.in_flight_tokens
        running, waiting = metrics.running, metrics.waiting
        if running is not None and waiting is not None and waiting > 0 and math.isfinite(running):
            endpoint.learned_capacity = max(endpoint.learned_capacity, int(running))

    def capacity(self, endpoint: Endpoint) -> int | None:
        """Requests the engine runs at once, if known (configured, else learned)."""
        return endpoint.max_num_seqs or endpoint.learned_capacity or None

    def estimated_waiting(self, endpoint: Endpoint) -> float | None:
        """The engine's queue now (see the module doc) plus the gateway's own pool queue to it."""
        metrics = endpoint.metrics
        if not metrics.fresh() or metrics.waiting is None or not math.isfinite(metrics.waiting):
            return None
        pooled = self.pool_waiting(endpoint)
        sent = endpoint.in_flight - pooled  # what reached the engine
        waiting = metrics.waiting
        if waiting > 0:
            waiting += max(0, sent - metrics.in_flight_at_scrape)
        capacity = self.capacity(endpoint)
        if capacity is not None:
            waiting = max(waiting, sent - capacity)
        return waiting + pooled

    def estimated_kv_usage(self, endpoint: Endpoint) -> float | None:
        metrics = endpoint.metrics
        kv = metrics.kv_usage
        if kv is None or not math.isfinite(kv):
            return None
        if metrics.block_size and metrics.num_blocks:
            sent = endpoint.in_flight_tokens - metrics.in_flight_tokens_at_scrape
            if sent > 0:
                kv += sent / (metrics.block_size * metrics.num_blocks)
        return kv

    def saturated(self, endpoint: Endpoint) -> bool | None:
        """True/False, or None when its metrics are stale (unknown)."""
        if self._endpoint_cap and endpoint.in_flight >= self._endpoint_cap:
            return True
        pooled = self.pool_waiting(endpoint)
        if pooled and pooled >= self._queue_threshold:
            return True  # the gateway's own queue: known even while the engine's metrics are stale
        waiting = self.estimated_waiting(endpoint)
        if waiting is None:
            return None
        if waiting >= self._queue_threshold:
            return True
        kv = self.estimated_kv_usage(endpoint)
        return kv is not None and kv >= self._kv_threshold

    def pool_saturated(self, candidates: Sequence[Endpoint]) -> bool:
        """Saturated only if every replica with known state is saturated (and one is known)."""
        known = False
        for endpoint in candidates:
            state = self.saturated(endpoint)
            if state is False:
                return False
            if state is True:
                known = True
        return known

    def pressure(self, candidates: Sequence[Endpoint]) -> float:
        """Fraction of replicas saturated (unknown counts as not): drives graceful degradation."""
        if not candidates:
            return 0.0
        return sum(1 for e in candidates if self.saturated(e)) / len(candidates)
