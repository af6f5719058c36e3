"""Per-attempt request hooks: the gateway's own in-flight accounting (and, later, index updates)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.metrics import GatewayMetrics
from gateway.pd import PDCoordinator
from gateway.prefix.cache import PrefixCache
from gateway.proxy import RequestHooks
from gateway.sessions_affinity import SessionAffinity
from gateway.types import Endpoint, InferenceRequest

__all__ = ["HookChain", "InFlightHook", "PDHook", "PrefixHook", "SessionHook"]


class InFlightHook(RequestHooks):
    """Counts requests and prompt tokens in flight per endpoint, updated instantly.

    Prometheus reads these fields at scrape time (``GatewayMetrics.watch_endpoints``).
    """

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.in_flight_tokens += request.est_prompt_tokens

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        endpoint.in_flight -= 1
        endpoint.in_flight_tokens -= request.est_prompt_tokens


class HookChain(RequestHooks):
    """Runs hooks in order on send and in reverse on done, like a filter chain."""

    def __init__(self, hooks: Sequence[RequestHooks]) -> None:
        self._hooks = tuple(hooks)
        self._reversed = tuple(reversed(self._hooks))

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        for hook in self._hooks:
            hook.on_send(request, endpoint)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        for hook in self._reversed:
            hook.on_first_byte(request, endpoint)

    def on_usage(
        self, request: InferenceRequest, endpoint: Endpoint, prompt_tokens: int, cached_tokens: int
    ) -> None:
        for hook in self._reversed:
            hook.on_usage(request, endpoint, prompt_tokens, cached_tokens)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        for hook in self._reversed:
            hook.on_done(request, endpoint, ok)


class PrefixHook(RequestHooks):
    """Records where a prompt went, tracks its pending prefill, and feeds usage back.

    Records on send (not on success): the replica starts caching the prefix the moment
    it starts prefilling, and the next request of the conversation may arrive first.
    """

    def __init__(self, prefix: PrefixCache, metrics: GatewayMetrics) -> None:
        self._prefix = prefix
        self._metrics = metrics

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        match = self._prefix.current_match(request)
        if match is not None and match.matched.get(endpoint, 0) < match.best():
            self._metrics.load_overrides.inc()
        pending = self._prefix.uncached_tokens(request, endpoint)
        request.attributes.setdefault(_PENDING, {})[endpoint] = pending
        endpoint.pending_prefill_tokens += pending
        self._prefix.record(request, endpoint)

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._release(request, endpoint)

    def on_usage(
        self, request: InferenceRequest, endpoint: Endpoint, prompt_tokens: int, cached_tokens: int
    ) -> None:
        self._prefix.observe_usage(request, endpoint, prompt_tokens, cached_tokens)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        self._release(request, endpoint)

    @staticmethod
    def _release(request: InferenceRequest, endpoint: Endpoint) -> None:
        pending = request.attributes.get(_PENDING, {}).pop(endpoint, None)
        if pending is not None:
            endpoint.pending_prefill_tokens = max(0.0, endpoint.pending_prefill_tokens - pending)


_PENDING = "pending_prefill"


class SessionHook(RequestHooks):
    """Pins the request's session to the replica that answered it (and counts hits and moves).

    On the first response byte, not on send: an attempt that fails before answering (a
    dead replica health checks have not caught yet) must neither count as a hit nor pin.
    """

    def __init__(self, affinity: SessionAffinity) -> None:
        self._affinity = affinity

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._affinity.after_routing(request, endpoint)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        if not ok:
            self._affinity.attempt_failed(request, endpoint)


class PDHook(RequestHooks):
    """Measures the KV transfer and catches decode replicas that recomputed the prompt."""

    def __init__(self, pd: PDCoordinator) -> None:
        self._pd = pd

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        self._pd.decode_first_byte(request)

    def on_usage(
        self, request: InferenceRequest, endpoint: Endpoint, prompt_tokens: int, cached_tokens: int
    ) -> None:
        self._pd.decode_usage(request, prompt_tokens, cached_tokens)
