"""Scorer ``lora-affinity``: send an adapter's requests where the adapter is already in use.

vLLM batches at most ``--max-loras`` adapters at once; a request for another one waits
until a slot frees, and an adapter not resident is loaded first (an eviction when the slots
are full). From each replica's ``vllm:lora_requests_info`` (:class:`~gateway.fleet.lora.LoraLoad`)
the levels are those of the Gateway API Inference Extension's lora-affinity scorer:

- 1.0: the adapter is running there;
- 0.8: a free adapter slot (running and waiting adapters fewer than ``max_lora``);
- 0.6: the adapter is waiting there (it will run when a slot frees);
- 0.0: it would wait for a slot and push another adapter out.

The scrape lags by an interval, so the gateway's own requests in flight count as running
(``Endpoint.adapters_in_flight``, kept by the in-flight hook): a burst for a new adapter
follows the first request instead of spreading over every replica with a free slot. A
replica without a fresh report scores ``unknown`` (0.4: better than a sure eviction, worse
than any known room) unless the gateway has the adapter in flight there. A request for a
base model, or for a model no candidate lists as an adapter, scores the same everywhere:
this scorer is then neutral (so it sits in the default preset at no cost to other fleets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "lora-affinity"

RUNNING, FREE_SLOT, WAITING, MUST_EVICT = 1.0, 0.8, 0.6, 0.0


def adapter_score(endpoint: Endpoint, adapter: str, unknown: float) -> float:
    local = endpoint.adapters_in_flight
    if adapter in local:
        return RUNNING
    load = endpoint.metrics.lora
    if load is None or not endpoint.metrics.fresh():
        return unknown
    if adapter in load.running:
        return RUNNING
    if load.has_free_slot(local):
        return FREE_SLOT
    if adapter in load.waiting:
        return WAITING
    return MUST_EVICT


class LoraAffinityScorer:
    def __init__(self, name: str, unknown: float) -> None:
        self.name = name
        self._unknown = unknown

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        adapter = request.model
        if not any(adapter in e.adapters for e in candidates):
            return dict.fromkeys(candidates, 1.0)  # a base model: nothing to prefer
        return {e: adapter_score(e, adapter, self._unknown) for e in candidates}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> LoraAffinityScorer:
    params = Params(parameters)
    unknown = params.number("unknown_score", 0.4, low=0.0, high=1.0)
    params.done()
    return LoraAffinityScorer(name, unknown)
