"""Wiring for SLO-aware admission: the best predicted TTFT of a request over its candidates.

Admission sits below the prefix cache, so it is handed this function instead of the
cache itself: the prefix match (done once per request and reused by the scorers) turns
into uncached tokens per replica, and the latency model into milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.admission.latency_model import LatencyModel
from gateway.admission.queue import TtftPredictor
from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest

__all__ = ["PrefixTtftPredictor"]


class PrefixTtftPredictor(TtftPredictor):
    """The latency model's TTFT for a request's uncached tokens on each candidate, best of them."""

    def __init__(self, prefix: PrefixCache, latency: LatencyModel) -> None:
        self._prefix = prefix
        self._latency = latency

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        if candidates:
            await self._prefix.match(request, candidates)

    def best_ms(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> float | None:
        """None (fail open) unless every candidate's prediction rests on enough observations and
        the request was matched (``prepare``); a queued request is re-predicted as the fleet moves."""
        latency, prefix = self._latency, self._prefix
        if not candidates or prefix.current_match(request) is None:
            return None
        if not all(latency.confident(e) for e in candidates):
            return None
        priority = request.priority
        return min(latency.predict_ttft(e, prefix.uncached_tokens(request, e), priority) for e in candidates)
