"""Scorer ``in-flight``: prefer endpoints with less gateway-local load.

The gateway's own counters move the instant a request is sent, unlike scraped
metrics, so this scorer keeps a burst from piling onto one replica between scrapes.
``by: requests`` counts requests, ``by: tokens`` counts estimated prompt tokens.
Score = 1 − load / max load over the candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "in-flight"


class InFlightScorer:
    def __init__(self, name: str, by_tokens: bool) -> None:
        self.name = name
        self.by_tokens = by_tokens

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        if self.by_tokens:
            loads = {e: float(e.in_flight_tokens) for e in candidates}
        else:
            loads = {e: float(e.in_flight) for e in candidates}
        high = max(loads.values())
        if high <= 0:
            return dict.fromkeys(candidates, 1.0)
        return {e: 1.0 - load / high for e, load in loads.items()}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> InFlightScorer:
    params = Params(parameters)
    by = params.choice("by", "requests", ("requests", "tokens"))
    params.done()
    return InFlightScorer(name, by_tokens=by == "tokens")
