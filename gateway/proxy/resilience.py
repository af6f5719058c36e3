"""Per-endpoint circuit breakers (outlier ejection) and the fleet-wide retry budget.

Why both: health checks probe ``/health``, which a replica can pass while every
inference request fails, hangs or breaks mid-stream. The breaker judges endpoints by
what real requests see, and the retry budget keeps retries from multiplying an outage.

Breaker states, per endpoint (Envoy's outlier detection with a half-open probe):
- *closed*: in rotation. ``consecutive_failures`` failures in a row, or an error rate
  of ``error_rate`` over ``window_s`` (with at least ``min_requests``), eject it;
- *open*: out of rotation for ``ejection_s × 2^(n-1)`` (capped), n = ejections in a row;
- *half-open*: back in rotation until one request is sent to it; that request is the
  probe (the endpoint leaves rotation again until it answers). Its first byte closes the
  breaker (a stream need not end first); a failure before it re-opens the breaker with a
  doubled ejection time.

A replica that accepts requests and never answers (hung engine, lost requests) shows
no failure at all until a timeout of minutes, so *stalls* are detected too: requests
waiting ``stall_s`` for their first byte (timed from when they left the gateway's own
connection pool) that the engine's own fresh metrics do not count. Without fresh
metrics nothing is judged a stall — a long prefill looks the same — and health checks
decide. Ejecting an endpoint cuts those waits short, so the proxy re-sends them
elsewhere before any byte reached the client.

With several workers the states are shared (:mod:`gateway.proxy.shared_breakers`): an
ejection by one worker is adopted by all at their next review, and one worker sends the
half-open probe for all.

``max_ejected_fraction`` keeps a fleet-wide problem (every replica overloaded) from
ejecting everything: failures are then passed through rather than turned into 503s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.config import ResilienceConfig
from gateway.fleet.endpoint import Endpoint, Role
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.metrics import GatewayMetrics
from gateway.proxy.shared_breakers import SharedBreakerStates

__all__ = ["BreakerState", "CircuitBreakers", "FirstByteWait", "RetryBudget", "SlidingCounter"]

log = logging.getLogger(__name__)


class SlidingCounter:
    """Counts in one-second buckets over a window; cheap to bump, O(window) to sum."""

    __slots__ = ("_buckets", "_seconds", "_window")

    def __init__(self, window_s: float) -> None:
        self._window = max(1, round(window_s))
        self._buckets = [0] * self._window
        self._seconds = [0] * self._window

    def add(self, now: float, amount: int = 1) -> None:
        second = int(now)
        slot = second % self._window
        if self._seconds[slot] != second:
            self._seconds[slot] = second
            self._buckets[slot] = 0
        self._buckets[slot] += amount

    def total(self, now: float) -> int:
        oldest = int(now) - self._window + 1
        return sum(b for b, s in zip(self._buckets, self._seconds, strict=True) if s >= oldest)


class RetryBudget:
    """Retries allowed: ``ratio`` of recent requests plus ``min_per_s`` (Linkerd's retry budget)."""

    def __init__(self, ratio: float, min_per_s: float, window_s: float = 10.0) -> None:
        self._ratio = ratio
        self._floor = min_per_s * window_s
        self._requests = SlidingCounter(window_s)
        self._retries = SlidingCounter(window_s)

    def record_request(self, now: float | None = None) -> None:
        self._requests.add(time.monotonic() if now is None else now)

    def try_spend(self, now: float | None = None) -> bool:
        """Take one retry if the budget allows it."""
        now = time.monotonic() if now is None else now
        allowed = self._ratio * self._requests.total(now) + self._floor
        if self._retries.total(now) >= allowed:
            return False
        self._retries.add(now)
        return True


def backoff_s(base_s: float, retry_number: int, cap_s: float = 1.0) -> float:
    """Full-jitter exponential back-off (AWS architecture blog's recommendation)."""
    return random.uniform(0, min(cap_s, base_s * 2 ** max(0, retry_number - 1)))


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(eq=False, slots=True)
class FirstByteWait:
    """A request waiting for its first upstream byte; ``abort`` ends the wait early."""

    started: float
    timeout: asyncio.Timeout
    aborted: str | None = None

    def restart(self) -> None:
        """The request only now left the gateway's own connection pool: time the endpoint from here."""
        self.started = time.monotonic()

    def abort(self, reason: str) -> None:
        if self.aborted is None and not self.timeout.expired():
            self.aborted = reason
            self.timeout.reschedule(asyncio.get_running_loop().time())


@dataclass(eq=False, slots=True)
class _Breaker:
    window_ok: SlidingCounter
    window_failed: SlidingCounter
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    ejections_in_row: int = 0
    open_until: float = 0.0
    last_ejected: float = 0.0
    probing: bool = False
    # Closed at its probe's first byte, and no request to it has completed since: a failure now
    # (its streams dying mid-way) re-ejects it at once, as a failed probe would.
    probation: bool = False
    last_first_byte: float = 0.0
    waits: set[FirstByteWait] = field(default_factory=set)


class CircuitBreakers:
    """All endpoints' breakers; the proxy reports outcomes, a ticker reviews timers and stalls."""

    def __init__(
        self,
        config: ResilienceConfig,
        registry: EndpointRegistry,
        metrics: GatewayMetrics,
        on_eject: Callable[[Endpoint, str], None] | None = None,
        scrape_timeout_s: float = 0.5,
    ) -> None:
        self._config = config
        self._scrape_timeout_s = scrape_timeout_s
        self._registry = registry
        self._metrics = metrics
        self._on_eject = on_eject
        self._breakers: dict[str, _Breaker] = {}
        self.shared: SharedBreakerStates | None = None  # workers > 1: states shared (http/workers.py)

    def reconfigure(self, config: ResilienceConfig) -> None:
        self._config = config

    def _get(self, endpoint: Endpoint) -> _Breaker:
        breaker = self._breakers.get(endpoint.url)
        if breaker is None:
            breaker = self._breakers[endpoint.url] = _Breaker(
                SlidingCounter(self._config.window_s), SlidingCounter(self._config.window_s)
            )
        return breaker

    def state(self, endpoint: Endpoint) -> BreakerState:
        breaker = self._breakers.get(endpoint.url)
        return breaker.state if breaker is not None else BreakerState.CLOSED

    def _current(self, endpoint: Endpoint) -> bool:
        """Still this object in the fleet? Outcomes of requests to removed endpoints are dropped,
        so a reused address does not inherit a dead replica's breaker."""
        return self._registry.get(endpoint.url) is endpoint

    def forget(self, url: str) -> None:
        """The endpoint left the fleet (discovery, admin): drop its breaker."""
        self._breakers.pop(url, None)
        if self.shared is not None:
            self.shared.forget(url)

    # ---- outcomes reported by the proxy ------------------------------------------
    def on_send(self, endpoint: Endpoint) -> None:
        endpoint = endpoint.owner  # breakers are per URL: a DP rank target's is its replica's
        if not self._current(endpoint):
            return
        breaker = self._get(endpoint)
        if breaker.state is BreakerState.HALF_OPEN and not breaker.probing:
            breaker.probing = True  # this request is the probe; others wait for its verdict
            endpoint.ejected = True
            if self.shared is not None and not self.shared.keep_probe(endpoint, time.monotonic()):
                self._await_siblings_probe(breaker, time.monotonic())  # lapsed: a sibling probes, not this
            self._registry.rebuild()

    def release_probe(self, endpoint: Endpoint) -> None:
        """The probe ended with no verdict (client gone, prefill partner failed): allow another."""
        endpoint = endpoint.owner  # breakers are per URL: a DP rank target's is its replica's
        breaker = self._breakers.get(endpoint.url)
        if breaker is not None and breaker.state is BreakerState.HALF_OPEN and breaker.probing:
            breaker.probing = False
            if self._current(endpoint):
                endpoint.ejected = False
                self._registry.rebuild()

    def on_success(self, endpoint: Endpoint) -> None:
        endpoint = endpoint.owner  # breakers are per URL: a DP rank target's is its replica's
        if not self._current(endpoint):
            return
        breaker = self._get(endpoint)
        breaker.window_ok.add(time.monotonic())
        breaker.consecutive_failures = 0
        breaker.probation = False
        if breaker.state is BreakerState.HALF_OPEN:
            self._close(endpoint, breaker)

    @staticmethod
    def _await_siblings_probe(breaker: _Breaker, now: float) -> None:
        """Out of rotation until the sibling that holds the probe claim publishes its verdict
        (each review asks for the claim again: if that sibling died, the claim is free)."""
        breaker.state = BreakerState.OPEN
        breaker.open_until = now
        breaker.probing = False

    def _close(self, endpoint: Endpoint, breaker: _Breaker) -> None:
        log.warning("endpoint %s: probe succeeded, back in rotation", endpoint.name)
        breaker.state = BreakerState.CLOSED
        breaker.probing = False
        endpoint.ejected = False
        self._registry.rebuild()
        if self.shared is not None:
            self.shared.publish(endpoint, 0.0, breaker.ejections_in_row)

    def on_failure(self, endpoint: Endpoint, reason: str) -> None:
        endpoint = endpoint.owner  # breakers are per URL: a DP rank target's is its replica's
        if not self._current(endpoint):
            return
        now = time.monotonic()
        breaker = self._get(endpoint)
        breaker.window_failed.add(now)
        breaker.consecutive_failures += 1
        if breaker.state is BreakerState.HALF_OPEN:  # out of rotation already: no share to keep
            self._eject(endpoint, breaker, f"probe_{reason}", force=True)
        elif breaker.probation:  # back in rotation: within max_ejected_fraction like any ejection
            self._eject(endpoint, breaker, f"probe_{reason}")
        elif breaker.state is BreakerState.CLOSED and self._tripped(breaker, now):
            self._eject(endpoint, breaker, reason)

    def _tripped(self, breaker: _Breaker, now: float) -> bool:
        if breaker.consecutive_failures >= self._config.consecutive_failures:
            return True
        failed = breaker.window_failed.total(now)
        total = failed + breaker.window_ok.total(now)
        return total >= self._config.min_requests and failed / total >= self._config.error_rate

    # ---- first-byte waits (stall detection, early abort on ejection) --------------
    @contextmanager
    def first_byte_wait(
        self, endpoint: Endpoint, timeout: asyncio.Timeout, *, queued: bool = False
    ) -> Iterator[FirstByteWait]:
        """Track a wait for the endpoint's first byte. ``queued``: the request may still sit in the
        gateway's own connection pool; its clock starts at ``restart()`` (never stuck before)."""
        wait = FirstByteWait(math.inf if queued else time.monotonic(), timeout)
        endpoint = endpoint.owner
        if not self._current(endpoint):
            yield wait  # removed from the fleet: nothing to judge any more
            return
        breaker = self._get(endpoint)
        breaker.waits.add(wait)
        try:
            yield wait
        finally:
            breaker.waits.discard(wait)

    def on_first_byte(self, endpoint: Endpoint) -> None:
        endpoint = endpoint.owner  # breakers are per URL: a DP rank target's is its replica's
        breaker = self._breakers.get(endpoint.url)
        if breaker is None:
            return
        breaker.last_first_byte = time.monotonic()
        if breaker.state is BreakerState.HALF_OPEN and breaker.probing and self._current(endpoint):
            # The probe is answering: the replica is back now, not when its stream ends (minutes,
            # for a long generation) — on probation until a request to it completes.
            self._close(endpoint, breaker)
            breaker.probation = True

    def abort_waits(self, endpoint: Endpoint, reason: str) -> int:
        """Cut short every request waiting for this endpoint's first byte (they get re-sent)."""
        endpoint = endpoint.owner
        breaker = self._breakers.get(endpoint.url)
        if breaker is None:
            return 0
        for wait in list(breaker.waits):
            wait.abort(reason)
        return len(breaker.waits)

    # ---- ejection ------------------------------------------------------------------
    def _eject(self, endpoint: Endpoint, breaker: _Breaker, reason: str, force: bool = False) -> None:
        if not force and not self._may_eject(endpoint):
            self._metrics.ejections_skipped.labels(endpoint.name).inc()
            return
        now = time.monotonic()
        breaker.ejections_in_row += 1
        duration = min(
            self._config.max_ejection_s, self._config.ejection_s * 2 ** (breaker.ejections_in_row - 1)
        )
        breaker.state = BreakerState.OPEN
        breaker.open_until = now + duration
        breaker.last_ejected = now
        breaker.probing = breaker.probation = False
        breaker.consecutive_failures = 0
        endpoint.ejected = True
        self._registry.rebuild()
        self._metrics.ejections.labels(endpoint.name, reason).inc()
        log.warning("endpoint %s ejected for %.1f s (%s)", endpoint.name, duration, reason)
        if self.shared is not None:
            self.shared.publish(endpoint, breaker.open_until, breaker.ejections_in_row)
        aborted = self.abort_waits(endpoint, "ejected")
        if aborted:
            log.info("endpoint %s: %d requests waiting for a first byte re-sent", endpoint.name, aborted)
        if self._on_eject is not None:
            self._on_eject(endpoint, reason)

    def _may_eject(self, endpoint: Endpoint) -> bool:
        """At most ``max_ejected_fraction`` of the endpoints of any model it serves (≥1 if 2+),
        counted in its own pool: prefill replicas against prefill replicas, the others against
        the others (a prefill pool's ejections must not spend the decode pool's allowance, nor
        empty the prefill pool)."""
        prefill = endpoint.role is Role.PREFILL
        for model in endpoint.models or {""}:
            peers = [
                e
                for e in self._registry
                if (model in e.models or not model) and (e.role is Role.PREFILL) == prefill
            ]
            if len(peers) < 2:
                return False
            out = sum(1 for e in peers if e.ejected or not e.healthy or e.draining)
            if out + 1 > max(1, int(self._config.max_ejected_fraction * len(peers))):
                return False
        return True

    def review(self, now: float | None = None) -> None:
        """Periodic: open breakers whose time is up go half-open; stalled endpoints are ejected."""
        now = time.monotonic() if now is None else now
        changed = self._adopt_shared(now) if self.shared is not None else False
        for endpoint in self._registry:
            breaker = self._breakers.get(endpoint.url)
            if breaker is None:
                continue
            if breaker.state is BreakerState.OPEN and now >= breaker.open_until:
                if self.shared is not None and not self.shared.claim_probe(endpoint, now, self._lease_s()):
                    continue  # a sibling worker sends the probe; its verdict is adopted
                breaker.state = BreakerState.HALF_OPEN
                breaker.probing = False
                endpoint.ejected = False
                changed = True
                log.info("endpoint %s: half-open, the next request is a probe", endpoint.name)
            elif breaker.state is BreakerState.HALF_OPEN and self.shared is not None:
                # In flight, the claim is kept; unused, it may lapse. Lapsed and taken by a
                # sibling: its probe, its verdict (an answer to ours no longer decides).
                kept = self.shared.keep_probe(endpoint, now) if breaker.probing else None
                if kept is False or (kept is None and not self.shared.holds_probe(endpoint)):
                    self._await_siblings_probe(breaker, now)
                    endpoint.ejected = changed = True
            elif (
                breaker.state is BreakerState.CLOSED
                and breaker.ejections_in_row
                and now - breaker.last_ejected > self._config.max_ejection_s
            ):
                breaker.ejections_in_row = 0  # behaved for a while: the next ejection is short again
            if breaker.state is not BreakerState.OPEN and self._stalled(endpoint, breaker, now):
                if breaker.state is BreakerState.HALF_OPEN:
                    self._eject(endpoint, breaker, "probe_stalled", force=True)
                else:
                    self._eject(endpoint, breaker, "stalled")
        if changed:
            self._registry.rebuild()

    def _lease_s(self) -> float:
        """How long a claimed probe may go unsent before a sibling worker may take the claim."""
        return max(1.0, 4 * self._config.check_interval_s)

    def _adopt_shared(self, now: float) -> bool:
        """A sibling worker ejected an endpoint, or its probe closed the breaker: do the same here."""
        assert self.shared is not None
        changed = False
        for endpoint in self._registry:
            cell = self.shared.changed(endpoint)
            if cell is None:
                continue
            breaker = self._get(endpoint)
            if cell.open_until > now and breaker.open_until != cell.open_until:
                breaker.state = BreakerState.OPEN
                breaker.open_until = cell.open_until
                breaker.ejections_in_row = cell.ejections_in_row
                breaker.last_ejected = now
                breaker.probing = False
                breaker.consecutive_failures = 0
                endpoint.ejected = changed = True
                log.warning(
                    "endpoint %s ejected by a sibling worker for %.1f s", endpoint.name, cell.open_until - now
                )
                self.abort_waits(endpoint, "ejected")
            elif cell.open_until == 0.0 and breaker.state is not BreakerState.CLOSED:
                breaker.state = BreakerState.CLOSED
                breaker.probing = False
                endpoint.ejected = False
                changed = True
                log.warning(
                    "endpoint %s: a sibling worker's probe succeeded, back in rotation", endpoint.name
                )
        return changed

    def _stalled(self, endpoint: Endpoint, breaker: _Breaker, now: float) -> bool:
        stuck = [w for w in breaker.waits if now - w.started > self._config.stall_s and w.aborted is None]
        if not stuck:
            return False
        engine = endpoint.metrics
        if not engine.fresh():
            # No numbers to trust: a long prefill or a non-streamed generation looks exactly
            # like a hang from here. Health checks (and their timeouts) judge this endpoint.
            return False
        # Only requests sent before the last scrape was even started can be expected in it.
        asked_after = engine.scraped_at - self._scrape_timeout_s
        known = [w for w in stuck if w.started < asked_after]
        if not known:
            return False
        counted = (engine.running or 0) + (engine.waiting or 0)
        return counted < len(known)  # the engine does not know requests we are waiting on

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._config.check_interval_s)
            try:
                self.review()
            except Exception:  # a bug here must not stop future reviews
                log.exception("circuit breaker review failed")
