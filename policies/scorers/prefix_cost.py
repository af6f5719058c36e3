"""Scorer ``prefix-cost``: expected time-to-first-token, in prefill-token units, per candidate.

    cost(e) = pending_prefill(e) + miss_weight × uncached(request, e) + decode_weight × in_flight(e)

- ``uncached`` is the part of this prompt that ``e`` would have to prefill: the
  prefix index tells how much ``e`` already holds;
- ``pending_prefill`` is the prefill work the gateway has sent to ``e`` that has not
  produced a first token yet (updated the instant a request is sent or its first
  chunk arrives, so it does not lag like scraped metrics);
- ``in_flight`` requests cost ``decode_weight`` token-equivalents each: decoding
  sequences slow every step and hold batch slots;
- ``miss_weight`` > 1 charges a miss more than the same amount of queued work: queued
  prefill is paid once, but a prefix recomputed on a second replica also takes cache
  room there and evicts someone else's prefix later (measured: 1.5 keeps shared-prefix
  groups on one replica without piling load; see docs/benchmarks.md).

A cache hit wins exactly while the prefill it saves outweighs the extra queue it
joins — the trade Dynamo's KV router makes with ``overlap × prefill + decode``
blocks, and which SGLang approximates with fixed imbalance thresholds. The score is
``min cost / cost`` over the candidates (1 for the best). A shared system prompt is
cached everywhere, so it cancels out and load decides: no hot spot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params
from policies.scorers.relative_cost import relative_scores

TYPE_NAME = "prefix-cost"


class PrefixCostScorer:
    def __init__(
        self, name: str, prefix: PrefixCache, decode_weight: float, miss_weight: float, floor_tokens: float
    ) -> None:
        self.name = name
        self._prefix = prefix
        self._decode_weight = decode_weight
        self._miss_weight = miss_weight
        self._floor = floor_tokens

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._prefix.match(request, candidates)

    def cost(self, request: InferenceRequest, endpoint: Endpoint) -> float:
        return (
            self._floor
            + endpoint.pending_prefill_tokens
            + self._miss_weight * self._prefix.uncached_tokens(request, endpoint)
            + self._decode_weight * endpoint.in_flight
        )

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        return relative_scores({e: self.cost(request, e) for e in candidates})


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> PrefixCostScorer:
    params = Params(parameters)
    decode_weight = params.number("decode_weight", 48.0, low=0)
    miss_weight = params.number("miss_weight", 1.5, low=0)
    floor_tokens = params.number("floor_tokens", 16.0, low=1)
    params.done()
    return PrefixCostScorer(name, context.prefix, decode_weight, miss_weight, floor_tokens)
