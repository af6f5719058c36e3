"""Scorer ``cache-room``: prefer replicas whose prefix cache still has room (1 − occupancy).

For a cold prompt (no hit anywhere) this sends the new prefix where it can stay
cached, so the fleet's caches fill evenly instead of one replica thrashing while
another sits empty (seen with sglang-router's ``cache_aware`` on two vLLM replicas).
Use it with a small weight, as a tie-breaker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "cache-room"


class CacheRoomScorer:
    def __init__(self, name: str, prefix: PrefixCache) -> None:
        self.name = name
        self._prefix = prefix

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        return {e: 1.0 - self._prefix.occupancy(e) for e in candidates}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> CacheRoomScorer:
    Params(parameters).done()
    return CacheRoomScorer(name, context.prefix)
