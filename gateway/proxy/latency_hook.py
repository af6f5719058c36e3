"""The hook that trains the latency model, and counts SLO attainment.

- ``on_send``: the replica's state as the routing saw it (it runs first in the chain,
  before this attempt's own in-flight and pending prefill are counted) and the
  prediction for it, into ``request.context.latency`` — for the answers that train the
  model (``admission.slo.training_per_s`` a second per replica; every debug request);
- ``on_headers``: with ``x-gateway-debug: 1``, ``x-gateway-predicted-ttft-ms`` (what routing
  predicted for the replica that serves it), so a client can measure the model's error;
- ``on_first_byte``: the TTFT of a streamed answer → the model and the predicted-vs-observed
  histograms; met or missed for a request with a TTFT objective (streamed or not);
- ``on_usage``: the completion token count; ``on_done``: the time per output token of a
  complete streamed answer → the model.

A buffered answer's "first byte" is its last one, so it teaches the model nothing. The
predicted-vs-observed histograms count the answers that trained it.
"""

from __future__ import annotations

import time

from gateway.admission.latency_model import LatencyModel
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.cache import PrefixCache
from gateway.proxy.hooks import Outcome, RequestHooks
from gateway.request.types import InferenceRequest, Usage

__all__ = ["LatencyHook"]


class LatencyHook(RequestHooks):
    def __init__(self, model: LatencyModel, prefix: PrefixCache, metrics: GatewayMetrics) -> None:
        self._model = model
        self._prefix = prefix
        self._metrics = metrics

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        training = self._model.training(endpoint.name, always=request.debug) if request.stream else None
        if training is None:  # buffered, or past the model's training rate: no sample
            request.context.latency = None
            return
        uncached = self._prefix.uncached_tokens(request, endpoint)
        request.context.latency = self._model.sample(endpoint, uncached, training)

    def on_headers(self, request: InferenceRequest, endpoint: Endpoint, headers: dict[str, str]) -> None:
        sample = request.context.latency
        if request.debug and sample is not None and sample.endpoint == endpoint.name:
            predicted = sample.predicted_ttft_ms * self._model.class_bias(request.priority)
            headers["x-gateway-predicted-ttft-ms"] = f"{predicted:.1f}"

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        now = time.monotonic()
        slo = request.slo
        if slo is not None and slo.deadline is not None:
            result = "met" if now <= slo.deadline else "missed"
            self._metrics.child(self._metrics.slo_results, request.priority, result).inc()
        sample = request.context.latency
        if sample is None or sample.endpoint != endpoint.name:
            return
        sample.first_byte_at = now
        ttft_ms = (now - sample.sent_at) * 1000
        model = self._model
        predicted_ms = sample.predicted_ttft_ms * model.class_bias(request.priority)  # as routing saw it
        model.observe_ttft(
            endpoint.name,
            sample.ttft_x,
            ttft_ms,
            priority=request.priority,
            predicted_ms=sample.predicted_ttft_ms,
            training=sample.training,
        )
        metrics = self._metrics
        metrics.child(metrics.ttft_predicted, endpoint.name).observe(predicted_ms / 1000)
        metrics.child(metrics.ttft_observed, endpoint.name).observe(ttft_ms / 1000)

    def on_usage(self, request: InferenceRequest, endpoint: Endpoint, usage: Usage) -> None:
        sample = request.context.latency
        if sample is not None:
            sample.completion_tokens = usage.completion_tokens

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        sample = request.context.latency
        if sample is None or sample.first_byte_at is None or sample.endpoint != endpoint.name:
            return
        request.context.latency = None
        if not outcome.ok:
            return
        tokens = sample.completion_tokens
        if tokens is None:  # no usage in the stream: data chunks less the role chunk and [DONE]
            tokens = request.context.streamed_chunks - 1
        if tokens >= 2:
            tpot_ms = (time.monotonic() - sample.first_byte_at) * 1000 / (tokens - 1)
            self._model.observe_tpot(endpoint.name, sample.tpot_x, tpot_ms, sample.training)
