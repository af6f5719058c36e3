"""Saturation detector: is a replica (or a whole pool) out of headroom right now?

A replica is saturated when its waiting queue ≥ ``queue_depth_threshold`` or its KV
utilisation ≥ ``kv_utilization_threshold`` (llm-d's utilisation detector defaults:
5 and 0.8). The queue is the engine's scraped ``waiting`` plus the requests the
gateway sent since that scrape *if* the engine was already queueing then — new
arrivals join an existing queue, but a replica with free slots admits them.

Stale metrics are "unknown", never "saturated": a pool whose every replica is
unknown is *not* saturated (fail open). llm-d once failed closed here and turned a
metrics outage into 500s for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint

__all__ = ["SaturationDetector"]


class SaturationDetector:
    def __init__(self, config: AdmissionConfig) -> None:
        self.reconfigure(config)

    def reconfigure(self, config: AdmissionConfig) -> None:
        self._queue_threshold = config.queue_depth_threshold
        self._kv_threshold = config.kv_utilization_threshold
        self._endpoint_cap = config.endpoint_max_concurrency

    def estimated_waiting(self, endpoint: Endpoint) -> float | None:
        metrics = endpoint.metrics
        if not metrics.fresh() or metrics.waiting is None or not math.isfinite(metrics.waiting):
            return None
        waiting = metrics.waiting
        if waiting > 0:
            waiting += max(0, endpoint.in_flight - metrics.in_flight_at_scrape)
        return waiting

    def saturated(self, endpoint: Endpoint) -> bool | None:
        """True/False, or None when its metrics are stale (unknown)."""
        if self._endpoint_cap and endpoint.in_flight >= self._endpoint_cap:
            return True
        waiting = self.estimated_waiting(endpoint)
        if waiting is None:
            return None
        if waiting >= self._queue_threshold:
            return True
        kv = endpoint.metrics.kv_usage
        return kv is not None and math.isfinite(kv) and kv >= self._kv_threshold

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
