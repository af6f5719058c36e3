"""Scorer ``session-affinity``: keep a conversation on the replica its session is pinned to.

A scorer, not a hard pin: the pinned replica scores 1 while it is a candidate
(healthy, serves the model) and not saturated — or saturated while no other candidate is
known to have headroom: moving then would only trade its warm cache for another full
replica, which the next turn would leave again. Otherwise nobody scores on this signal, the
other scorers pick the best replica (``session-balance`` only among those with headroom), and
the session is re-pinned there (by the session hook, which counts the move and why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.sessions.affinity import SessionAffinity
from policies.params import Params

TYPE_NAME = "session-affinity"


class SessionAffinityScorer:
    def __init__(self, name: str, affinity: SessionAffinity) -> None:
        self.name = name
        self._affinity = affinity

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._affinity.lookup(request)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        pinned = self._affinity.usable_pin(request, candidates)
        return {e: 1.0 if e is pinned else 0.0 for e in candidates}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> SessionAffinityScorer:
    Params(parameters).done()
    return SessionAffinityScorer(name, context.sessions)
