"""Scorer ``slo-headroom``: replicas predicted to meet the request's TTFT objective, most headroom first.

The learned latency model (:mod:`gateway.admission.latency_model`) predicts each
candidate's TTFT from its state now and this request's *uncached* prompt tokens there,
so a prefix hit counts exactly as the prefill it saves, and a long prefill queue as the
time it costs (times the request's class bias: a sheddable request waits longer).
With ``left`` = the milliseconds left until the request's deadline:

- predicted to meet it (``p ≤ left``): ``0.5 + 0.5 × (left − p) / left`` — in (0.5, 1],
  more headroom scores higher;
- predicted to miss it: ``0.5 × left / p`` — below every replica that meets it, and a
  near miss above a far one;
- a TPOT objective the replica is predicted to miss halves its score;
- no objective: ``min p / p`` over the candidates (1 for the fastest), as ``prefix-cost`` does.

Before the model has any data it predicts with the fleet prior (prefill and queue cost
per token and per request), so a cold start routes like a cost model, not at random.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.admission.latency_model import LatencyModel
from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "slo-headroom"


class SloHeadroomScorer:
    def __init__(self, name: str, prefix: PrefixCache, latency: LatencyModel, tpot_penalty: float) -> None:
        self.name = name
        self._prefix = prefix
        self._latency = latency
        self._tpot_penalty = tpot_penalty

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._prefix.match(request, candidates)

    def predicted_ttft_ms(self, request: InferenceRequest, endpoint: Endpoint) -> float:
        uncached = self._prefix.uncached_tokens(request, endpoint)
        return self._latency.predict_ttft(endpoint, uncached, request.priority)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        predicted = {e: self.predicted_ttft_ms(request, e) for e in candidates}
        slo = request.slo
        if slo is None or slo.deadline is None:
            best = min(predicted.values())
            scores = {e: best / p for e, p in predicted.items()}
        else:
            left = max(1.0, (slo.deadline - time.monotonic()) * 1000)
            scores = {
                e: 0.5 + 0.5 * (left - p) / left if p <= left else 0.5 * left / p
                for e, p in predicted.items()
            }
        if slo is not None and slo.tpot_ms is not None:
            for endpoint in candidates:
                if self._latency.predict_tpot(endpoint) > slo.tpot_ms:
                    scores[endpoint] *= self._tpot_penalty
        return scores


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> SloHeadroomScorer:
    params = Params(parameters)
    tpot_penalty = params.number("tpot_penalty", 0.5, low=0, high=1)
    params.done()
    if context.latency is None:
        raise ValueError("slo-headroom needs the gateway's latency model (none in this plugin context)")
    return SloHeadroomScorer(name, context.prefix, context.latency, tpot_penalty)
