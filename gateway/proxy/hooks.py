"""The one hook chain around every upstream attempt.

Everything the gateway does *because* a request went to an endpoint is a hook with
the same lifecycle, run by :class:`HookChain` (in order on send, in reverse after,
like Envoy's filters):

- ``on_send``: the attempt is about to go out;
- ``on_headers``: the client's response headers are about to go out (add to them);
- ``on_first_byte``: the first chunk of the answer reached the client;
- ``on_usage``: the answer carried a ``usage`` object;
- ``on_done``: the attempt ended, for any reason (cancellation included), with its
  :class:`Outcome`.

The built-in hooks: in-flight accounting, prefix learning, session pinning, P/D
measurement, circuit breakers and passive health. A P/D prefill leg runs the
in-flight and prefix hooks too (``prefill_chain``), so its accounting is the same code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.cache import PrefixCache
from gateway.proxy.resilience import CircuitBreakers
from gateway.request.types import InferenceRequest, Usage
from gateway.sessions.affinity import SessionAffinity

__all__ = [
    "BreakerHook",
    "HookChain",
    "HookSet",
    "InFlightHook",
    "Outcome",
    "PDHook",
    "PassiveHealthHook",
    "PrefixHook",
    "RequestHooks",
    "SessionHook",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended.

    ``ok``: a complete answer with a status below 400. ``verdict``: what it says about
    the endpoint — ``"ok"``, the endpoint's failure reason (``"connect"``, ``"timeout"``,
    ``"http_503"``, ``"mid_stream"`` …), or None when it says nothing (the client left,
    the prefill partner failed).
    """

    ok: bool
    verdict: str | None


class RequestHooks:
    """Base class: every method is a no-op, so a hook overrides only what it needs."""

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        pass

    def on_headers(self, request: InferenceRequest, endpoint: Endpoint, headers: dict[str, str]) -> None:
        pass

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        pass

    def on_usage(self, request: InferenceRequest, endpoint: Endpoint, usage: Usage) -> None:
        pass

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        pass


def _overriding(hooks: Sequence[RequestHooks], method: str) -> tuple[Callable[..., None], ...]:
    """The bound ``method`` of each hook that overrides the base's no-op (every request
    calls each of them: a chain of six hooks and five events is thirty calls otherwise)."""
    base = getattr(RequestHooks, method)
    return tuple(getattr(h, method) for h in hooks if getattr(type(h), method) is not base)


class HookChain(RequestHooks):
    """Runs hooks in order on send and in reverse afterwards, like a filter chain."""

    def __init__(self, hooks: Sequence[RequestHooks]) -> None:
        self.hooks = tuple(hooks)
        self._reversed = tuple(reversed(self.hooks))
        self._send = _overriding(self.hooks, "on_send")
        self._headers = _overriding(self._reversed, "on_headers")
        self._first_byte = _overriding(self._reversed, "on_first_byte")
        self._usage = _overriding(self._reversed, "on_usage")
        self._done = _overriding(self._reversed, "on_done")

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        for on_send in self._send:
            on_send(request, endpoint)

    def on_headers(self, request: InferenceRequest, endpoint: Endpoint, headers: dict[str, str]) -> None:
        for on_headers in self._headers:
            on_headers(request, endpoint, headers)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        for on_first_byte in self._first_byte:
            on_first_byte(request, endpoint)

    def on_usage(self, request: InferenceRequest, endpoint: Endpoint, usage: Usage) -> None:
        for on_usage in self._usage:
            on_usage(request, endpoint, usage)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        for on_done in self._done:
            on_done(request, endpoint, outcome)


@dataclass(frozen=True, slots=True)
class HookSet:
    """The chains a routing policy runs: around each attempt, and around each P/D prefill leg."""

    attempt: RequestHooks
    prefill: RequestHooks


class InFlightHook(RequestHooks):
    """Counts requests and prompt tokens in flight per endpoint, updated instantly.

    Prometheus reads these fields at scrape time (``GatewayMetrics.watch_endpoints``). With
    several workers the change also goes to this worker's shared cells (``shared_load``),
    which its siblings sum into their own fields (``gateway.fleet.shared_load``).
    ``on_sent`` sees each new count (the saturation detector: a burst from idle triggers a scrape).
    """

    def __init__(self, on_sent: Callable[[Endpoint], None] | None = None) -> None:
        self._on_sent = on_sent

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.in_flight_tokens += request.est_prompt_tokens
        if endpoint.shared_load is not None:
            endpoint.shared_load.add(1, request.est_prompt_tokens)
        if self._on_sent is not None:
            self._on_sent(endpoint)
        if request.model in endpoint.adapters:  # LoRA: what lora-affinity knows before a scrape
            counts = endpoint.adapters_in_flight
            counts[request.model] = counts.get(request.model, 0) + 1

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        if endpoint.shared_load is not None:  # the cell counted at send (a successor shares it)
            endpoint.shared_load.add(-1, -request.est_prompt_tokens)
        if endpoint.replaced_by is not None:  # a reload replaced it meanwhile: its counts moved
            endpoint = endpoint.latest()
        endpoint.in_flight -= 1
        endpoint.in_flight_tokens -= request.est_prompt_tokens
        counts = endpoint.adapters_in_flight
        if request.model in counts:
            if counts[request.model] > 1:
                counts[request.model] -= 1
            else:
                del counts[request.model]


class PrefixHook(RequestHooks):
    """Records where a prompt went, tracks its pending prefill, and feeds usage back.

    Records on send (not on success): the replica starts caching the prefix the moment
    it starts prefilling, and the next request of the conversation may arrive first.
    """

    def __init__(self, prefix: PrefixCache, metrics: GatewayMetrics, *, count_overrides: bool = True) -> None:
        self._prefix = prefix
        self._metrics = metrics
        self._count_overrides = (
            count_overrides  # off for P/D prefill legs: their pool is not the best-match set
        )

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        state = self._prefix.state(request)
        match = state.match
        if self._count_overrides and match is not None and match.matched.get(endpoint, 0) < match.best():
            self._metrics.load_overrides.inc()
        pending = self._prefix.uncached_tokens(request, endpoint)
        state.pending[endpoint] = pending
        endpoint.pending_prefill_tokens += pending
        if endpoint.shared_load is not None:
            endpoint.shared_load.add_pending(pending)
        self._prefix.record(request, endpoint)

    def on_headers(self, request: InferenceRequest, endpoint: Endpoint, headers: dict[str, str]) -> None:
        if request.debug and request.context.prefix is not None:
            predicted, _ = self._prefix.predicted_cached_tokens(request, endpoint)
            headers["x-gateway-predicted-cached-tokens"] = str(predicted)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._release(request, endpoint)

    def on_usage(self, request: InferenceRequest, endpoint: Endpoint, usage: Usage) -> None:
        self._prefix.observe_usage(request, endpoint, usage.prompt_tokens, usage.cached_tokens)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        self._release(request, endpoint)

    def _release(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._prefix.released(request, endpoint)
        state = request.context.prefix
        pending = state.pending.pop(endpoint, None) if state is not None else None
        if pending is not None:
            if endpoint.shared_load is not None:
                endpoint.shared_load.add_pending(-pending)
            endpoint = endpoint.latest()  # replaced in place by a reload meanwhile: counts moved
            endpoint.pending_prefill_tokens = max(0.0, endpoint.pending_prefill_tokens - pending)


class SessionHook(RequestHooks):
    """Pins the request's session to the replica that answered it (and counts hits and moves).

    On the first response byte, not on send: an attempt that fails before answering (a
    dead replica health checks have not caught yet) must neither count as a hit nor pin.
    Also hands out the signed replica token for clients that stick without a session id.
    """

    def __init__(self, affinity: SessionAffinity) -> None:
        self._affinity = affinity

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._affinity.sent(request, endpoint)  # counted now: sessions starting together see each other

    def on_headers(self, request: InferenceRequest, endpoint: Endpoint, headers: dict[str, str]) -> None:
        headers.update(self._affinity.response_headers(request, endpoint))

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._affinity.after_routing(request, endpoint)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        if not outcome.ok:
            self._affinity.attempt_failed(request, endpoint)


class PDHook(RequestHooks):
    """Measures the KV transfer and catches decode replicas that recomputed the prompt.

    A disaggregation that silently degrades is counted and logged: users otherwise lose
    the benefit of P/D without noticing.
    """

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        pd = request.context.pd
        leg = pd.leg if pd is not None else None
        if leg is not None and leg.prefill_done_at is not None:
            self._metrics.pd_kv_transfer.observe(max(0.0, time.monotonic() - leg.prefill_done_at))

    def on_usage(self, request: InferenceRequest, endpoint: Endpoint, usage: Usage) -> None:
        """The decode replica should report (nearly) the whole prompt as not computed by it."""
        pd = request.context.pd
        leg = pd.leg if pd is not None else None
        if leg is not None and usage.prompt_tokens > 0 and usage.cached_tokens < usage.prompt_tokens // 2:
            self._metrics.child(self._metrics.pd_degraded, "recomputed").inc()
            log.warning(
                "request %s: P/D degraded (recomputed) with prefill replica %s",
                request.request_id,
                leg.prefill_endpoint.name,
            )


class BreakerHook(RequestHooks):
    """Feeds every attempt's verdict to the endpoint's circuit breaker."""

    def __init__(self, breakers: CircuitBreakers) -> None:
        self._breakers = breakers

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._breakers.on_send(endpoint)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._breakers.on_first_byte(endpoint)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        if outcome.verdict is None:
            self._breakers.release_probe(endpoint)  # no verdict: let another request probe
        elif outcome.verdict == "ok":
            self._breakers.on_success(endpoint)
        else:
            self._breakers.on_failure(endpoint, outcome.verdict)


class PassiveHealthHook(RequestHooks):
    """A refused connection counts like a failed health probe, without waiting for the next one."""

    def __init__(self, mark_failed: Callable[[Endpoint], None]) -> None:
        self._mark_failed = mark_failed

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        if outcome.verdict == "connect":
            self._mark_failed(endpoint)
