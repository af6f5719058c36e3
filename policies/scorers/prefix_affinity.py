"""Scorer ``prefix-affinity``: the fraction of the prompt's blocks already cached on each candidate.

score = matched blocks / prompt blocks, from the shared prefix index (memory or
Redis). On its own it piles a shared system prompt onto one replica; combine it with
load scorers, or use ``prefix-cost``, which weighs the saved prefill against queueing.
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
    def __init__(self, name: str, prefix: PrefixCache) -> None:
        self.name = name
        self._prefix = prefix

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._prefix.match(request, candidates)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        match = self._prefix.current_match(request)
        if match is None:
            return dict.fromkeys(candidates, 0.0)
        return {e: match.ratio(e) for e in candidates}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> PrefixAffinityScorer:
    Params(parameters).done()
    return PrefixAffinityScorer(name, context.prefix)
