"""Scorer ``prefix-affinity``: how much of the prompt each candidate already caches.

``normalize: ratio`` (default): matched blocks / prompt blocks, from the shared prefix index
(memory or Redis). ``normalize: min-max``: llm-d's ``precise-prefix-cache-scorer`` reading —
each candidate's cached prompt tokens (exact engine blocks where KV events are live, with their
pending blocks if on; else the index's estimate), min-max normalised over the candidates that
hold any (1 for the longest match; 1 for all of them when they hold the same; 0 without a hit),
as llm-d-inference-scheduler's ``indexedScoresToNormalizedScoredPods`` does. With it, llm-d's
weighted sum (this ×3, ``kv-utilization`` ×2, ``queue-depth`` ×2) runs as a profile of our
scorers, for measurement against ``prefix-cost`` (docs/benchmarks.md §11).

On its own it piles a shared system prompt onto one replica; combine it with load scorers,
or use ``prefix-cost``, which weighs the saved prefill against queueing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "prefix-affinity"


class PrefixAffinityScorer:
    def __init__(self, name: str, prefix: PrefixCache, min_max: bool = False) -> None:
        self.name = name
        self._prefix = prefix
        self._min_max = min_max

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._prefix.match(request, candidates)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        match = self._prefix.current_match(request)
        if match is None:
            return dict.fromkeys(candidates, 0.0)
        if self._min_max:
            return self._min_max_scores(request, candidates)
        return {e: match.ratio(e) for e in candidates}

    def _min_max_scores(
        self, request: InferenceRequest, candidates: Sequence[Endpoint]
    ) -> dict[Endpoint, float]:
        cached = {e: self._prefix.routing_cached_tokens(request, e) for e in candidates}
        hits = [tokens for tokens in cached.values() if tokens > 0]
        if not hits:
            return dict.fromkeys(candidates, 0.0)
        low, high = min(hits), max(hits)
        if low == high:
            return {e: 1.0 if tokens > 0 else 0.0 for e, tokens in cached.items()}
        return {e: (tokens - low) / (high - low) if tokens > 0 else 0.0 for e, tokens in cached.items()}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> PrefixAffinityScorer:
    params = Params(parameters)
    normalize = params.choice("normalize", "ratio", ("ratio", "min-max"))
    params.done()
    return PrefixAffinityScorer(name, context.prefix, min_max=normalize == "min-max")
