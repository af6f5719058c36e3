"""Admission control: when the pool is saturated, queue or shed by priority, never starve critical.

- ``critical``: admitted at once, ahead of everything, bounded only by a hard concurrency
  cap (beyond it, it queues first in line);
- ``standard``: admitted while the pool has headroom; otherwise waits in a bounded queue
  (fair across tenants: round-robin; within a tenant earliest deadline first among those
  still meetable, then the overdue — the TTFT objective's deadline, else arrival +
  ``queue_timeout_s``, so without SLOs it is FIFO)
  until headroom returns or its deadline passes → 429. With a TTFT objective (and a
  confident latency model) it also waits while no replica is predicted to meet it, and with
  ``slo.drop_overdue`` leaves the queue with a 429 once its deadline has passed;
- ``sheddable``: admitted only with headroom and nobody queued; otherwise served by the
  fallback model if one is configured and has room (degraded), else 429 at once.
  Under partial pressure (half the pool saturated) its output cap may be clamped (the
  API's own field: ``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``).
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
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.admission.rewrite import clamp_max_tokens, rewrite_body, switch_model
from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.errors import GatewayError
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import InferenceRequest, Priority

__all__ = ["AdmissionController", "RateLimited", "Ticket", "TtftPredictor"]

_PRIORITIES = tuple(Priority)
_TIMER_SLACK_S = 0.002  # a deadline timer fires this late, so that it never fires before the deadline
_SLO_SCAN = 32  # queued requests per tenant a drain pass re-predicts before giving up on the tenant


class TtftPredictor(Protocol):
    """The best predicted TTFT (ms) of a request over its candidates. ``prepare`` does the async
    part once (the prefix match); ``best_ms`` is then cheap and re-run as the fleet's state moves."""

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None: ...

    def best_ms(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> float | None:
        """None when no prediction is trusted (fail open)."""
        ...


class RateLimited(GatewayError):
    status = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


@dataclass(slots=True)
class Ticket:
    priority: str
    degraded: str | None = None  # what was degraded, for the response header
    released: bool = False
    # Taken from the queue and not yet sent (its model): its load is not counted on any replica
    # until it is, so its model's queue grants no other meanwhile (see AdmissionController.sent).
    unsent_model: str | None = None


@dataclass(eq=False, slots=True)
class _Waiter:
    request: InferenceRequest
    future: asyncio.Future[None]
    enqueued_at: float = field(default_factory=time.monotonic)
    due: float = math.inf  # standard queue order: earliest first
    slo_gated: bool = False  # has a TTFT deadline: granted only when predicted to meet it
    timer: asyncio.TimerHandle | None = None  # wakes the queue at the deadline


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        detector: SaturationDetector,
        metrics: GatewayMetrics,
        candidates_for: Callable[[str], Sequence[Endpoint]],
        ttft: TtftPredictor | None = None,
    ) -> None:
        self._config = config
        self._ttft = ttft
        self._detector = detector
        self._metrics = metrics
        self._candidates_for = candidates_for
        self.in_flight = 0
        self.critical_in_flight = 0
        self._critical: deque[_Waiter] = deque()
        # tenant → model → its waiters, earliest deadline first: a saturated model's waiters are
        # passed over in one step, not one by one, and hold up none of the tenant's others
        self._standard: OrderedDict[str, dict[str, deque[_Waiter]]] = OrderedDict()
        self._queued_standard = 0
        # Standard waiters by model: a new request queues behind those of its own model only.
        self._queued_models: Counter[str] = Counter()
        self._unsent: Counter[str] = Counter()  # model → its tickets taken from the queue, not yet sent
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

    def with_room(self, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates under ``endpoint_max_concurrency``; all of them when none is (critical
        work, admitted past saturation, and requests routed concurrently may still exceed it)."""
        return self._detector.below_cap(candidates)

    async def admit(self, request: InferenceRequest, *, pinned: bool = False) -> Ticket:
        """Return a ticket (release it when the request ends) or raise :class:`RateLimited`.

        ``pinned``: the request can only go to one replica (a Responses chain's), so it may not
        be served by the fallback model."""
        ticket = await self._admit(request, pinned)
        engine_priority = self._config.engine_priority
        if engine_priority and engine_priority.get(request.priority, 0) and "priority" not in request.body:
            # Inside the engine too, critical work must not wait behind admitted bulk work.
            request.body["priority"] = engine_priority[request.priority]
            rewrite_body(request)
        return ticket

    async def _admit(self, request: InferenceRequest, pinned: bool) -> Ticket:
        priority = request.priority
        if not self._config.enabled:
            return self._grant(Ticket(priority))
        if priority == "critical":
            if self.critical_in_flight < self._config.critical_max_concurrency:
                return self._decided(self._grant(Ticket(priority)), "admitted", "headroom")
            return await self._wait(request, self._critical)
        if priority == "sheddable":  # admitted or refused once: on what the engines really hold
            await self._detector.settle(self._candidates_for(request.model), self._config.burst_settle_s)
            saturated = self._saturated(request.model)
            if not saturated and not self._queued_models[request.model]:
                await self._check_slo(request)
            return self._admit_sheddable(request, saturated, pinned)
        saturated = self._saturated(request.model)
        slo_gated = await self._slo_gated(request)
        queued = self._queued_models[request.model]
        if not saturated and not queued and not (slo_gated and self._slo_verdict(request) is False):
            return self._decided(self._grant(Ticket(priority)), "admitted", "headroom")
        if self._queued_standard >= self._config.max_queue:
            raise self._refuse(priority, "queue_full", "the admission queue is full")
        queue = self._standard.setdefault(request.tenant, {}).setdefault(request.model, deque())
        return await self._wait(request, queue, slo_gated=slo_gated)

    async def _slo_gated(self, request: InferenceRequest) -> bool:
        """Whether this standard request waits for a replica predicted to meet its TTFT deadline."""
        slo = request.slo
        if slo is None or slo.deadline is None or self._ttft is None or not self._config.slo.hold_standard:
            return False
        await self._ttft.prepare(request, self._candidates_for(request.model))
        return True

    def _slo_verdict(self, request: InferenceRequest, now: float | None = None) -> bool | None:
        """Predicted to get its first token before its deadline (True/False); None: no trusted
        prediction, or the deadline has passed (then being fast no longer helps it).

        A drain pass passes its own ``now``: were the clock read again here, a waiter the pass
        saw before its deadline could be past it by now, read as "no verdict" and sent."""
        slo = request.slo
        if self._ttft is None or slo is None or slo.deadline is None:
            return None
        left_ms = (slo.deadline - (time.monotonic() if now is None else now)) * 1000
        if left_ms <= 0:
            return None
        best = self._ttft.best_ms(request, self._candidates_for(request.model))
        if best is None:
            return None
        return best <= left_ms * self._config.slo.shed_margin

    async def _check_slo(self, request: InferenceRequest) -> None:
        """Refuse sheddable work that no replica is predicted to start in time (fail open)."""
        slo = request.slo
        if slo is None or slo.deadline is None or self._ttft is None:
            return
        if not self._config.slo.shed_sheddable:
            return
        candidates = self._candidates_for(request.model)
        await self._ttft.prepare(request, candidates)
        best = self._ttft.best_ms(request, candidates)
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

    def _admit_sheddable(self, request: InferenceRequest, saturated: bool, pinned: bool) -> Ticket:
        degrade = self._config.degrade
        if not saturated and not self._queued_models[request.model]:
            ticket = Ticket("sheddable")
            pressure = self._detector.pressure(self._candidates_for(request.model))
            if degrade.sheddable_max_tokens and pressure >= 0.5:
                ticket.degraded = clamp_max_tokens(request, degrade.sheddable_max_tokens)
            outcome = "degraded" if ticket.degraded else "admitted"
            return self._decided(self._grant(ticket), outcome, "pressure" if ticket.degraded else "headroom")
        fallback = degrade.fallback_model
        if fallback and not pinned and fallback != request.model and not self._saturated(fallback):
            if self._candidates_for(fallback):
                ticket = Ticket("sheddable", degraded=switch_model(request, fallback))
                return self._decided(self._grant(ticket), "degraded", "fallback_model")
        raise self._refuse("sheddable", "saturated", "the model's replicas are saturated")

    # -- queue ----------------------------------------------------------------------
    async def _wait(
        self, request: InferenceRequest, queue: deque[_Waiter], slo_gated: bool = False
    ) -> Ticket:
        priority = request.priority
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, loop.create_future(), slo_gated=slo_gated)
        if priority != "critical":
            deadline = request.slo.deadline if request.slo is not None else None
            if deadline is None:
                deadline = waiter.enqueued_at + self._config.queue_timeout_s
            elif slo_gated:  # at its deadline it is dropped or stops waiting for a prediction
                # uvloop's timers run on a millisecond clock and may fire up to 1 ms early.
                delay = max(0.0, deadline - time.monotonic()) + _TIMER_SLACK_S
                waiter.timer = loop.call_later(delay, self.wake)
            waiter.due = deadline
            bisect.insort_right(queue, waiter, key=_due)  # after equal deadlines: FIFO among them
            self._queued_standard += 1
            self._queued_models[request.model] += 1
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
        finally:  # granted, timed out, refused, or the client went away: leave the queue now
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._remove(waiter, queue)
            self._metrics.queue_wait.labels(priority).observe(time.monotonic() - waiter.enqueued_at)
        ticket = self._grant(Ticket(priority))
        if priority != "critical":  # critical waits for its own cap, counted at the grant
            ticket.unsent_model = request.model
            self._unsent[request.model] += 1
        self._decided(ticket, "admitted", "dequeued")
        self.wake()  # let the next waiter be considered once this one is on its way
        return ticket

    def sent(self, ticket: Ticket) -> None:
        """The request is routed and about to be sent, its load counted on its replica from now
        (the proxy counts it before it next yields; with vLLM P/D only after its prefill leg,
        a gap left open: docs/operations.md): its model's queue may grant the next.

        The drain grants one waiter per pass so that the next pass sees its load, but that load
        is counted only at the send, after routing, which may wait on I/O (a Redis prefix index
        or session store): every pass in that wait saw the same load and granted again, and the
        queue was emptied past the saturation threshold."""
        model = ticket.unsent_model
        if model is None:
            return
        ticket.unsent_model = None
        self._unsent[model] -= 1
        if not self._unsent[model]:
            del self._unsent[model]
        self.wake()

    def _remove(self, waiter: _Waiter, queue: deque[_Waiter]) -> None:
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if waiter.request.priority != "critical":
            self._queued_standard -= 1
            model = waiter.request.model
            self._queued_models[model] -= 1
            if not self._queued_models[model]:
                del self._queued_models[model]
            models = self._standard.get(waiter.request.tenant)
            if not queue and models is not None and models.get(model) is queue:
                del models[model]
                if not models:
                    del self._standard[waiter.request.tenant]
        self._publish_queue()

    def wake(self) -> None:
        """Consider queued requests again (after a release, a scrape, or a timer tick)."""
        if self.queued() and not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Grant at most one waiter per pass: the next pass sees its load counted."""
        self._drain_scheduled = False
        if not self._config.enabled:  # turned off by a reload: nobody waits for a limit any more
            standard = (q for models in self._standard.values() for q in models.values())
            for waiting in (self._critical, *standard):
                for waiter in waiting:
                    if not waiter.future.done():
                        waiter.future.set_result(None)
            return
        for waiter in self._critical:
            if not waiter.future.done():
                if self.critical_in_flight < self._config.critical_max_concurrency:
                    waiter.future.set_result(None)
                    return
                # Critical waits for its own cap, which standard work does not take from: the
                # standard queues below go on being served meanwhile.
                break
        now = time.monotonic()
        saturated: dict[str, bool] = {}  # by model, for this pass

        def is_saturated(model: str) -> bool:  # or one it granted is not counted yet
            state = saturated.get(model)
            if state is None:
                state = saturated[model] = model in self._unsent or self._saturated(model)
            return state

        for tenant in list(self._standard):
            candidate = None  # of the tenant's models: the earliest meetable, else the earliest overdue
            for model, queue in list(self._standard[tenant].items()):
                waiter = self._next_waiter(queue, now, grantable=not is_saturated(model))
                if waiter is not None and (candidate is None or _rank(waiter, now) < _rank(candidate, now)):
                    candidate = waiter
            if candidate is None:
                continue
            candidate.future.set_result(None)
            self._standard.move_to_end(tenant)  # round-robin across tenants
            return

    def _next_waiter(self, queue: deque[_Waiter], now: float, grantable: bool) -> _Waiter | None:
        """Earliest deadline first among those still meetable, then the overdue ones.

        Plain EDF collapses under overload: it serves the most overdue requests first, all of
        which have missed already, while the meetable ones behind them go stale too. Without
        SLOs nothing is overdue while queued (due = arrival + queue_timeout_s): FIFO. A waiter
        with a TTFT deadline is skipped while no replica is predicted to meet it; once overdue
        it is refused (``drop_overdue``) or served late like any other. A queue whose model's
        replicas are saturated (not ``grantable``) grants nothing: only its overdue waiters,
        at its front, are looked at, for that refusal."""
        overdue = None
        scanned = 0
        drop = self._config.slo.drop_overdue
        for waiter in queue:  # nothing here removes from it: refused waiters leave in their own task
            if waiter.future.done():
                continue
            if waiter.due > now:
                if not grantable:
                    break  # ordered by deadline: nothing overdue behind it
                if not waiter.slo_gated:
                    return waiter
                if self._slo_verdict(waiter.request, now) is not False:
                    return waiter
                scanned += 1
                if scanned >= _SLO_SCAN:
                    break
            elif waiter.slo_gated and drop:
                waiter.future.set_exception(
                    self._refuse(
                        waiter.request.priority, "slo_deadline_passed", "its TTFT deadline passed in queue"
                    )
                )
            elif overdue is None and grantable:
                overdue = waiter
        return overdue

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
        self.sent(ticket)  # never sent (no replica, an error while routing): it holds up nobody
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


def _rank(waiter: _Waiter, now: float) -> tuple[bool, float]:  # meetable first, then by deadline
    return waiter.due <= now, waiter.due
