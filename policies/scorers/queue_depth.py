"""Scorer ``queue-depth``: prefer endpoints with fewer waiting requests.

Reads the engine's own waiting queue (``vllm:num_requests_waiting`` /
``sglang:num_queue_reqs``) plus the requests the gateway sent since that scrape
could see them, min-max normalised over the candidates as the GIE scorer does.
Stale metrics are not trusted: such an endpoint is scored on its gateway-local
in-flight count alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "queue-depth"


def effective_queue(endpoint: Endpoint) -> float:
    metrics = endpoint.metrics
    if metrics.fresh() and metrics.waiting is not None and math.isfinite(metrics.waiting):
        running = metrics.running if metrics.running is not None and math.isfinite(metrics.running) else 0.0
        # Requests the gateway has in flight beyond what the engine reported as running
        # or waiting have arrived since the scrape: count them as queued.
        unseen = max(0.0, endpoint.in_flight - running - metrics.waiting)
        return metrics.waiting + unseen
    return float(endpoint.in_flight)


class QueueDepthScorer:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        queues = {e: effective_queue(e) for e in candidates}
        low, high = min(queues.values()), max(queues.values())
        if high == low:
            return dict.fromkeys(candidates, 1.0)
        span = high - low
        return {e: (high - q) / span for e, q in queues.items()}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> QueueDepthScorer:
    Params(parameters).done()
    return QueueDepthScorer(name)
