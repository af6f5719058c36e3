"""Per-attempt request hooks: the gateway's own in-flight accounting (and, later, index updates)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.metrics import GatewayMetrics
from gateway.proxy import RequestHooks
from gateway.types import Endpoint, InferenceRequest

__all__ = ["HookChain", "InFlightHook"]


class InFlightHook(RequestHooks):
    """Counts requests and prompt tokens in flight per endpoint, updated instantly."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.in_flight_tokens += request.est_prompt_tokens
        self._publish(endpoint)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        endpoint.in_flight -= 1
        endpoint.in_flight_tokens -= request.est_prompt_tokens
        self._publish(endpoint)

    def _publish(self, endpoint: Endpoint) -> None:
        self._metrics.in_flight.labels(endpoint.name).set(endpoint.in_flight)
        self._metrics.in_flight_tokens.labels(endpoint.name).set(endpoint.in_flight_tokens)


class HookChain(RequestHooks):
    """Runs hooks in order on send and in reverse on done, like a filter chain."""

    def __init__(self, hooks: Sequence[RequestHooks]) -> None:
        self._hooks = tuple(hooks)
        self._reversed = tuple(reversed(self._hooks))

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        for hook in self._hooks:
            hook.on_send(request, endpoint)

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        for hook in self._reversed:
            hook.on_done(request, endpoint, ok)
