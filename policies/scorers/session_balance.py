"""Scorer ``session-balance``: start a session (or move one) where the fewest live sessions are.

A conversation's history grows on its replica's KV cache turn after turn, so the replica
given one session more than the others is the first to evict. When agents start together
with one long shared system prompt, prefix scoring sees that prompt on one replica and little
queued work, and piles the new sessions there (7 of 12 on one of two real vLLM replicas,
docs/benchmarks.md §10). For a request whose session has no usable pin, the candidate with
the fewest live sessions (:class:`gateway.sessions.placement.SessionPlacement`, counted at
send) scores 1, the most 0, linearly between; equal counts, a usable pin or no session id
score nothing, so pinned conversations and session-less traffic are left to the others. A
session moving off its saturated replica is balanced over the replicas with headroom only
(the saturated ones score 0): it must not land on another full one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.sessions.affinity import PinState, SessionAffinity
from policies.params import Params

TYPE_NAME = "session-balance"


class SessionBalanceScorer:
    def __init__(self, name: str, affinity: SessionAffinity) -> None:
        self.name = name
        self._affinity = affinity

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        await self._affinity.lookup(request)  # once per request, shared with session-affinity

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        if not request.session_id or self._affinity.usable_pin(request, candidates) is not None:
            return {}
        pin = request.context.session
        targets = candidates
        if pin is not None and pin.state is PinState.SATURATED:  # moving: only where there is room
            targets = self._affinity.with_headroom(candidates)
        live = {e: self._affinity.placement.live(e.name) for e in targets}
        fewest, most = min(live.values(), default=0), max(live.values(), default=0)
        if most == fewest:
            return dict.fromkeys(targets, 1.0) if len(targets) < len(candidates) else {}
        return {e: (most - n) / (most - fewest) for e, n in live.items()}


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> SessionBalanceScorer:
    Params(parameters).done()
    return SessionBalanceScorer(name, context.sessions)
