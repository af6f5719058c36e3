"""Admission control: when the pool is saturated, queue or shed by priority, never starve critical.

- ``critical``: admitted at once, ahead of everything, bounded only by a hard concurrency
  cap (beyond it, it queues first in line);
- ``standard``: admitted while the pool has headroom; otherwise waits in a bounded queue
  (fair across tenants: round-robin; within a tenant earliest deadline first among those
  still meetable, then the overdue — the TTFT objective's deadline, else arrival +
  ``queue_timeout_s``, so without SLOs it is FIFO)
  until headroom returns or its deadline passes → 429;
- ``sheddable``: admitted only with headroom and nobody queued; otherwise served by the
  fallback model if one is configured and has room (degraded), else 429 at once.
  Under partial pressure (half the pool saturated) its ``max_tokens`` may be clamped.
  With a TTFT objective it is also refused when no replica is predicted (by the learned
  latency model, confidently) to produce its first token before the deadline.

Every refusal is a 429 with ``Retry-After`` and an OpenAI-style error saying why. A
queued request whose client disconnects leaves the queue at once (its task is
cancelled by aiohttp). Saturation comes from :class:`SaturationDetector`, which fails
open when metrics are stale.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.errors import GatewayError
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import InferenceRequest, Priority

__all__ = ["AdmissionController", "RateLimited", "Ticket", "TtftEstimate", "rewrite_body"]

_PRIORITIES = tuple(Priority)

# The best predicted TTFT (ms) of a request over the candidates, None when no prediction is trusted.
TtftEstimate = Callable[[InferenceRequest, Sequence[Endpoint]], Awaitable[float | None]]


class RateLimited(GatewayError):
    status = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


@dataclass(slots=True)
class Ticket:
    priority: str
    degraded: str | None = None  # what was degraded, for the response header
    released: bool = False


@dataclass(eq=False, slots=True)
class _Waiter:
    request: InferenceRequest
    future: asyncio.Future[None]
    enqueued_at: float = field(default_factory=time.monotonic)
    due: float = math.inf  # standard queue order: earliest first


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        detector: SaturationDetector,
        metrics: GatewayMetrics,
        candidates_for: Callable[[str], Sequence[Endpoint]],
        ttft_estimate: TtftEstimate | None = None,
    ) -> None:
        self._config = config
        self._ttft_estimate = ttft_estimate
        self._detector = detector
        self._metrics = metrics
        self._candidates_for = candidates_for
        self.in_flight = 0
        self.critical_in_flight = 0
        self._critical: deque[_Waiter] = deque()
        self._standard: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # tenant → FIFO
        self._queued_standard = 0
        self._drain_scheduled = False

    def reconfigure(self, config: AdmissionConfig) -> None:
        """Hot reload: new thresholds and limits apply to the next decision; queued requests stay."""
        self._config = config
        self._detector.reconfigure(config)
        self.wake()

    # -- decisions ------------------------------------------------------------------
    def _saturated(self, model: str) -> bool:
        if self._config.max_concurrency and self.in_flight >= self._config.max_concurrency:
            return True
        return self._detector.pool_saturated(self._candidates_for(model))

    def queued(self) -> int:
        return len(self._critical) + self._queued_standard

    async def admit(self, request: InferenceRequest) -> Ticket:
        """Return a ticket (release it when the request ends) or raise :class:`RateLimited`."""
        ticket = await self._admit(request)
        engine_priority = self._config.engine_priority
        if engine_priority and engine_priority.get(request.priority, 0) and "priority" not in request.body:
            # Inside the engine too, critical work must not wait behind admitted bulk work.
            request.body["priority"] = engine_priority[request.priority]
            rewrite_body(request)
        return ticket

    async def _admit(self, request: InferenceRequest) -> Ticket:
        priority = request.priority
        if not self._config.enabled:
            return self._grant(Ticket(priority))
        if priority == "critical":
            if self.critical_in_flight < self._config.critical_max_concurrency:
                return self._decided(self._grant(Ticket(priority)), "admitted", "headroom")
            return await self._wait(request, self._critical)
        saturated = self._saturated(request.model)
        if priority == "sheddable":
            if not saturated and not self.queued():
                await self._check_slo(request)
            return self._admit_sheddable(request, saturated)
        if not saturated and not self.queued():
            return self._decided(self._grant(Ticket(priority)), "admitted", "headroom")
        if self._queued_standard >= self._config.max_queue:
            raise self._refuse(priority, "queue_full", "the admission queue is full")
        queue = self._standard.setdefault(request.tenant, deque())
        return await self._wait(request, queue)

    async def _check_slo(self, request: InferenceRequest) -> None:
        """Refuse sheddable work that no replica is predicted to start in time (fail open)."""
        slo = request.slo
        if slo is None or slo.deadline is None or self._ttft_estimate is None:
            return
        if not self._config.slo.shed_sheddable:
            return
        best = await self._ttft_estimate(request, self._candidates_for(request.model))
        if best is None:
            return
        left_ms = (slo.deadline - time.monotonic()) * 1000
        if best > left_ms * self._config.slo.shed_margin:
            raise self._refuse(
                "sheddable",
                "slo_unmeetable",
                f"no replica is predicted to answer within its TTFT objective ({slo.ttft_ms:g} ms;"
                f" best predicted {best:.0f} ms)",
                retry_after=max(self._config.retry_after_s, (best - left_ms) / 1000),
            )

    def _admit_sheddable(self, request: InferenceRequest, saturated: bool) -> Ticket:
        degrade = self._config.degrade
        if not saturated and not self.queued():
            ticket = Ticket("sheddable")
            pressure = self._detector.pressure(self._candidates_for(request.model))
            if degrade.sheddable_max_tokens and pressure >= 0.5:
                ticket.degraded = _clamp_max_tokens(request, degrade.sheddable_max_tokens)
            outcome = "degraded" if ticket.degraded else "admitted"
            return self._decided(self._grant(ticket), outcome, "pressure" if ticket.degraded else "headroom")
        fallback = degrade.fallback_model
        if fallback and fallback != request.model and not self._saturated(fallback):
            if self._candidates_for(fallback):
                ticket = Ticket("sheddable", degraded=_switch_model(request, fallback))
                return self._decided(self._grant(ticket), "degraded", "fallback_model")
        raise self._refuse("sheddable", "saturated", "the model's replicas are saturated")

    # -- queue ----------------------------------------------------------------------
    async def _wait(self, request: InferenceRequest, queue: deque[_Waiter]) -> Ticket:
        priority = request.priority
        waiter = _Waiter(request, asyncio.get_running_loop().create_future())
        if priority != "critical":
            deadline = request.slo.deadline if request.slo is not None else None
            if deadline is None:
                deadline = waiter.enqueued_at + self._config.queue_timeout_s
            waiter.due = deadline
            bisect.insort_right(queue, waiter, key=_due)  # after equal deadlines: FIFO among them
            self._queued_standard += 1
        else:
            queue.append(waiter)
        self._publish_queue()
        self._metrics.admission.labels(priority, "queued", "saturated").inc()
        try:
            async with asyncio.timeout(self._config.queue_timeout_s):
                await waiter.future
        except TimeoutError:
            raise self._refuse(
                priority, "queue_timeout", f"still saturated after {self._config.queue_timeout_s:g}s in queue"
            ) from None
        finally:  # granted, timed out, or the client went away: leave the queue now
            self._remove(waiter, queue)
            self._metrics.queue_wait.labels(priority).observe(time.monotonic() - waiter.enqueued_at)
        ticket = self._grant(Ticket(priority))
        self._decided(ticket, "admitted", "dequeued")
        self.wake()  # let the next waiter be considered once this one is on its way
        return ticket

    def _remove(self, waiter: _Waiter, queue: deque[_Waiter]) -> None:
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if waiter.request.priority != "critical":
            self._queued_standard -= 1
            tenant = waiter.request.tenant
            if not queue and self._standard.get(tenant) is queue:
                del self._standard[tenant]
        self._publish_queue()

    def wake(self) -> None:
        """Consider queued requests again (after a release, a scrape, or a timer tick)."""
        if self.queued() and not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Grant at most one waiter per pass: the next pass sees its load counted."""
        self._drain_scheduled = False
        for waiter in self._critical:
            if not waiter.future.done():
                if self.critical_in_flight < self._config.critical_max_concurrency:
                    waiter.future.set_result(None)
                return  # critical waiters block everything behind them
        now = time.monotonic()
        for tenant in list(self._standard):
            queue = self._standard[tenant]
            waiter = _next_waiter(queue, now)
            if waiter is None:
                continue
            if self._saturated(waiter.request.model):
                continue  # another tenant's model may have room
            waiter.future.set_result(None)
            self._standard.move_to_end(tenant)  # round-robin across tenants
            return

    # -- bookkeeping ----------------------------------------------------------------
    def _grant(self, ticket: Ticket) -> Ticket:
        self.in_flight += 1
        if ticket.priority == "critical":
            self.critical_in_flight += 1
        return ticket

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        if ticket.priority == "critical":
            self.critical_in_flight -= 1
        self.wake()

    def _decided(self, ticket: Ticket, outcome: str, reason: str) -> Ticket:
        self._metrics.child(self._metrics.admission, ticket.priority, outcome, reason).inc()
        return ticket

    def _refuse(self, priority: str, reason: str, why: str, retry_after: float | None = None) -> RateLimited:
        self._metrics.admission.labels(priority, "shed", reason).inc()
        return RateLimited(
            f"request not admitted ({priority} priority): {why}; retry later",
            code=f"rate_limit_exceeded.{reason}",
            retry_after=self._config.retry_after_s if retry_after is None else retry_after,
        )

    def _publish_queue(self) -> None:
        self._metrics.queue_length.labels("critical").set(len(self._critical))
        self._metrics.queue_length.labels("standard").set(self._queued_standard)

    def publish_saturation(self, endpoints: Sequence[Endpoint]) -> None:
        for endpoint in endpoints:
            self._metrics.endpoint_saturated.labels(endpoint.name).set(
                1 if self._detector.saturated(endpoint) else 0
            )


def _due(waiter: _Waiter) -> float:
    return waiter.due


def _next_waiter(queue: deque[_Waiter], now: float) -> _Waiter | None:
    """Earliest deadline first among those still meetable, then the overdue ones.

    Plain EDF collapses under overload: it serves the most overdue requests first, all of
    which have missed already, while the meetable ones behind them go stale too. Without
    SLOs nothing is overdue while queued (due = arrival + queue_timeout_s): FIFO."""
    overdue = None
    for waiter in queue:
        if waiter.future.done():
            continue
        if waiter.due > now:
            return waiter
        if overdue is None:
            overdue = waiter
    return overdue


def rewrite_body(request: InferenceRequest) -> None:
    """Re-serialise ``request.body`` after the gateway changed it (the proxy sends ``raw_body``)."""
    if request.form is not None:  # multipart (audio): the same parts, the changed fields
        request.raw_body = request.form.encode(request.body)
        return
    request.raw_body = json.dumps(request.body, separators=(",", ":")).encode()


def _clamp_max_tokens(request: InferenceRequest, ceiling: int) -> str | None:
    key = "max_completion_tokens" if "max_completion_tokens" in request.body else "max_tokens"
    value = request.body.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value <= ceiling:
        return None
    request.body[key] = ceiling
    rewrite_body(request)
    return f"{key}={ceiling}"


def _switch_model(request: InferenceRequest, model: str) -> str:
    request.body["model"] = model
    request.model = model
    rewrite_body(request)
    return f"model={model}"
