"""Saturation detector: is a replica (or a whole pool) out of headroom right now?

A replica is saturated when its waiting queue ≥ ``queue_depth_threshold`` or its KV
utilisation ≥ ``kv_utilization_threshold`` (llm-d's utilisation detector defaults:
5 and 0.8). Both are estimates *now*, not at the last scrape, so that a burst from an
idle fleet is seen from its first requests:

- queue: the engine's scraped ``waiting`` plus what the gateway sent since that scrape,
  minus what finished since (each finished request let a waiting one in), if the engine
  was already queueing then; and, once the replica's batch capacity is
  known, everything the gateway has in flight beyond that capacity. The capacity is the
  configured ``max_num_seqs``, else learned: the most requests the engine ran at a
  scrape where others were waiting (only then is ``running`` its limit — learning from
  any scrape would call a replica that merely has not been busy yet saturated);
- KV: the scraped utilisation plus the prompt tokens sent since that scrape, against the
  engine's KV size from ``cache_config_info``.

Engines do not export ``max_num_seqs``, so on a fleet that has never queued the capacity is
unknown and a burst from idle would stay invisible until the next scrape. Hence
:meth:`SaturationDetector.note_sent`: once the gateway's in-flight requests to such a
replica grew by ``burst_scrape_requests`` since its last scrape, it asks for a scrape at
once (``request_scrape``, the poller's, rate-limited there); that scrape shows the engine
queueing and teaches the capacity. Until it answers, sheddable admission to those
replicas waits for it (:meth:`SaturationDetector.settle`, a few milliseconds, at most
``burst_settle_s``), so the rest of the burst is admitted or refused on what the engines
really hold. Standard work is queued, never refused, so it does not wait: holding it
released the burst into the scheduler all at once, which piled it on one replica.

Stale metrics are "unknown", never "saturated": a pool whose every replica is
unknown is *not* saturated (fail open). llm-d once failed closed here and turned a
metrics outage into 500s for everyone.
"""

from __future__ import annotations

import asyncio
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
        # Scrape this endpoint now (the metrics poller's, wired by the app; rate-limited there).
        self.request_scrape: Callable[[Endpoint], None] = lambda endpoint: None
        self.scraping_soon: Callable[[Sequence[Endpoint]], list[asyncio.Task[None]]] = lambda endpoints: []
        self.reconfigure(config)

    def reconfigure(self, config: AdmissionConfig) -> None:
        self._queue_threshold = config.queue_depth_threshold
        self._kv_threshold = config.kv_utilization_threshold
        self._endpoint_cap = config.endpoint_max_concurrency
        self._burst_requests = config.burst_scrape_requests

    def note_sent(self, endpoint: Endpoint) -> None:
        """A request was just sent to ``endpoint``: scrape it at once if that is a burst we are blind to."""
        burst = self._burst_requests
        if not burst or endpoint.max_num_seqs or endpoint.learned_capacity:
            return  # capacity known: in-flight beyond it already counts as queued, no scrape needed
        at_scrape = endpoint.metrics.in_flight_at_scrape
        # Growth relative to what the engine last saw: a ramp on a large engine scrapes ~log(n) times.
        if endpoint.in_flight - at_scrape >= max(burst, at_scrape // 4):
            self.request_scrape(endpoint)

    def observe(self, endpoint: Endpoint) -> None:
        """Called right after each successful scrape: learn the batch capacity, note the tokens."""
        metrics = endpoint.metrics
        metrics.in_flight_tokens_at_scrape = endpoint.in_flight_tokens
        metrics.pooled_at_scrape = self.pool_waiting(endpoint)
        running, waiting = metrics.running, metrics.waiting
        if running is not None and waiting is not None and waiting > 0 and math.isfinite(running):
            endpoint.learned_capacity = max(endpoint.learned_capacity, int(running))

    async def settle(self, candidates: Sequence[Endpoint], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the burst-triggered scrapes of ``candidates`` in progress."""
        tasks = self.scraping_soon(candidates)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)  # never cancels them: other requests wait too

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
        if waiting > 0:  # sent since the scrape joined the queue; each one finished since left it
            waiting = max(0.0, waiting + sent - (metrics.in_flight_at_scrape - metrics.pooled_at_scrape))
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

    def below_cap(self, candidates: list[Endpoint]) -> list[Endpoint]:
        """Those under ``endpoint_max_concurrency``, or all when none is (or no cap is set)."""
        cap = self._endpoint_cap
        if not cap:
            return candidates
        return [e for e in candidates if e.in_flight < cap] or candidates

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
