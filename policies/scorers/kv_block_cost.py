"""Scorer ``kv-block-cost``: NVIDIA Dynamo's KV-router cost, in engine blocks, per candidate.

    logit(e) = overlap_score_weight × prefill_blocks(e) + decode_blocks(e)
    prefill_blocks(e) = (pending_prefill(e) + uncached(request, e)) / block_size
    decode_blocks(e)  = (in_flight_tokens(e) + request tokens) / block_size

Dynamo's default worker selector (``lib/llm/src/kv_router/scheduler.rs``, ``DefaultWorkerSelector``)
computes ``overlap_score_weight × potential_prefill_blocks + potential_active_blocks`` and takes
the lowest (``router_temperature`` 0, its default: ties at random); ``potential_prefill_blocks``
is the worker's active prefill tokens plus this request's uncached tokens, in blocks;
``potential_active_blocks`` the blocks of the sequences in flight there plus this request's.
It exists here so the gateway's own cost model (``prefix-cost``) can be measured against it on
the same fleet (``loadtest/exact_bench.py``, docs/benchmarks.md §11).

Where the terms come from, and why:
- ``uncached`` is the prefix index's answer (exact engine blocks where KV events are live);
- ``pending_prefill`` and ``in_flight_tokens`` are the gateway's own counters, moved the instant
  a request is sent or answered — Dynamo's router also counts active blocks itself
  (``ActiveSequences``) rather than from the engines' published load, which lags;
- the in-flight count is prompt tokens: the gateway does not follow each stream's output
  tokens, and counts a prefix shared by two requests in flight twice (Dynamo counts unique
  blocks and adds output blocks as they are generated);
- this request's own blocks are the same on every candidate (Dynamo subtracts the part already
  held by sequences in flight there, which the gateway does not track), so they only keep the
  logit positive.

``active_blocks: engine`` reads the decode term from the engine instead: ``kv_cache_usage_perc ×
num_blocks`` of the last fresh scrape (blocks referenced by running and waiting requests: shared
prefixes counted once, output blocks included — what Dynamo's unique active blocks mean) plus
the prompt tokens the gateway sent since that scrape; without a fresh scrape it falls back to
the gateway's count. It lags by a scrape interval, which is why ``gateway`` is the default.

``block_size`` is the engine's (``vllm:cache_config_info``) once scraped, ``block_tokens``
before. The score is ``min logit / logit`` over the candidates (1 for the cheapest), so
``max-score`` with ``tolerance: 0`` picks Dynamo's argmin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.prefix.cache import PrefixCache
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params
from policies.scorers.relative_cost import relative_scores

TYPE_NAME = "kv-block-cost"


class KvBlockCostScorer:
    def __init__(
        self,
        name: str,
        prefix: PrefixCache,
        overlap_score_weight: float,
        block_tokens: int,
        engine_active: bool = False,
    ) -> None:
        self.name = name
        self._prefix = prefix
        self._weight = overlap_score_weight
        self._block_tokens = block_tokens
        self._engine_active = engine_active

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._prefix.match(request, candidates)

    def block_size(self, endpoint: Endpoint) -> int:
        return endpoint.metrics.block_size or self._block_tokens

    def logit(self, request: InferenceRequest, endpoint: Endpoint) -> float:
        size = self.block_size(endpoint)
        prefill = endpoint.pending_prefill_tokens + self._prefix.uncached_tokens(request, endpoint)
        own_blocks = max(1, math.ceil(request.est_prompt_tokens / size))
        return self._weight * prefill / size + self.active_blocks(endpoint) + own_blocks

    def active_blocks(self, endpoint: Endpoint) -> float:
        """Blocks held by the sequences in flight on ``endpoint`` (see the module doc)."""
        size = self.block_size(endpoint)
        m = endpoint.metrics
        if self._engine_active and m.fresh() and m.kv_usage is not None and m.num_blocks:
            sent = max(0, endpoint.in_flight_tokens - m.in_flight_tokens_at_scrape)
            return m.kv_usage * m.num_blocks + sent / size
        return endpoint.in_flight_tokens / size

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        return relative_scores({e: self.logit(request, e) for e in candidates})


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> KvBlockCostScorer:
    params = Params(parameters)
    weight = params.number("overlap_score_weight", 1.0, low=0)
    block_tokens = params.integer("block_tokens", 16, low=1)
    active = params.choice("active_blocks", "gateway", ("gateway", "engine"))
    params.done()
    assert block_tokens is not None  # a default is given
    return KvBlockCostScorer(name, context.prefix, weight, block_tokens, engine_active=active == "engine")
