"""Wiring for SLO-aware admission: the best predicted TTFT of a request over its candidates.

Admission sits below the prefix cache, so it is handed this function instead of the
cache itself: the prefix match (done once per request and reused by the scorers) turns
into uncached tokens per replica, and the latency model into milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.admission.latency_model import LatencyModel
from gateway.admission.queue import TtftEstimate
from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest

__all__ = ["ttft_estimator"]


def ttft_estimator(prefix: PrefixCache, latency: LatencyModel) -> TtftEstimate:
    async def best_ttft_ms(request: InferenceRequest, candidates: Sequence[Endpoint]) -> float | None:
        """None (fail open) unless every candidate's prediction rests on enough observations."""
        if not candidates or not all(latency.confident(e) for e in candidates):
            return None
        await prefix.match(request, candidates)
        priority = request.priority
        return min(latency.predict_ttft(e, prefix.uncached_tokens(request, e), priority) for e in candidates)

    return best_ttft_ms
