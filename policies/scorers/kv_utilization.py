"""Scorer ``kv-utilization``: prefer endpoints with free KV-cache blocks (1 − usage).

Unknown or stale usage scores a neutral 0.5, so a replica that stopped reporting is
neither favoured nor starved on this signal alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "kv-utilization"

NEUTRAL = 0.5


class KvUtilizationScorer:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        scores = {}
        for endpoint in candidates:
            metrics = endpoint.metrics
            usage = metrics.kv_usage if metrics.fresh() else None
            scores[endpoint] = NEUTRAL if usage is None else 1.0 - usage
        return scores


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> KvUtilizationScorer:
    Params(parameters).done()
    return KvUtilizationScorer(name)
