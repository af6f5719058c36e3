"""Session affinity: looks up a request's pin, judges whether it is usable, re-pins after routing.

Shared by the ``session-affinity`` scorer (read side) and the session hook (write side),
so both agree on what "the pinned replica" is for a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gateway.admission.saturation import SaturationDetector
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import InferenceRequest
from gateway.sessions.placement import SessionPlacement
from gateway.sessions.responses import MemoryResponseStore, ResponseStore
from gateway.sessions.store import SessionStore, SessionTokens

__all__ = ["PinState", "SessionAffinity", "SessionPin"]


class PinState(StrEnum):
    """What became of the pinned replica for this request."""

    USABLE = "usable"  # a candidate with headroom (or no replica has more): the scorer favoured it
    SATURATED = "saturated"  # a candidate, but saturated while another has headroom: it may move there
    GONE = "gone"  # not a candidate any more (down, removed), or it failed this request


@dataclass(slots=True)
class SessionPin:
    """The request's session pin, looked up once (``pinned`` is an endpoint name or None)."""

    pinned: str | None
    state: PinState | None = None


class SessionAffinity:
    def __init__(
        self,
        store: SessionStore,
        tokens: SessionTokens,
        detector: SaturationDetector,
        metrics: GatewayMetrics,
        token_header: str | None,
        responses: ResponseStore | None = None,
        placement: SessionPlacement | None = None,
    ) -> None:
        self.store = store
        # live sessions per replica, counted at send (the session-balance scorer reads it)
        self.placement = placement if placement is not None else SessionPlacement(1800.0, 1_000_000)
        # Responses API: response id → the replica that stored it (and the chain's session)
        self.responses = responses if responses is not None else MemoryResponseStore(86400.0, 100_000)
        self.tokens = tokens
        self._detector = detector
        self._metrics = metrics
        self.token_header = token_header

    async def lookup(self, request: InferenceRequest) -> str | None:
        if request.context.session is not None:
            return request.context.session.pinned
        pinned: str | None = None
        if request.session_id:
            pinned = await self.store.get(request.session_id)
        elif self.token_header and (token := request.headers.get(self.token_header)):
            pinned = self.tokens.verify(token)  # forged or foreign tokens pin nothing
        request.context.session = SessionPin(pinned)
        return pinned

    def pinned_name(self, request: InferenceRequest) -> str | None:
        pin = request.context.session
        return pin.pinned if pin is not None else None

    def usable_pin(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Endpoint | None:
        """The pinned endpoint if it is a candidate and has headroom, or is saturated while no
        other candidate is known to have any (a move would trade its warm cache for another
        full replica, and the next turn would move again); else None."""
        pin = request.context.session
        if pin is None or pin.pinned is None:
            return None
        for endpoint in candidates:
            if endpoint.name == pin.pinned:
                if self._detector.saturated(endpoint) and self.with_headroom(candidates):
                    pin.state = PinState.SATURATED
                    return None
                pin.state = PinState.USABLE
                return endpoint
        # Left out at its concurrency cap: saturated, not gone.
        pin.state = PinState.SATURATED if pin.pinned in request.context.at_cap else PinState.GONE
        return None

    def with_headroom(self, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """The candidates known not to be saturated (stale metrics are not known)."""
        return [e for e in candidates if self._detector.saturated(e) is False]

    def sent(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """A request of a session went to ``endpoint``: count the session there (until a move)."""
        if request.session_id and request.context.session is not None:
            self.placement.place(request.session_id, endpoint.name)

    def after_routing(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """Count the hit or the move (with its reason) and pin the session to ``endpoint``.

        Called once per request, for the attempt that got an answer.
        """
        pin = request.context.session
        if pin is None:
            return  # no session-affinity scorer looked at this request
        if pin.pinned is not None:
            if pin.pinned == endpoint.name:
                self._metrics.session_hits.inc()
            else:
                state = pin.state or PinState.GONE
                self._metrics.session_moves.labels("scored" if state is PinState.USABLE else state).inc()
        if request.session_id:
            self.store.pin(request.session_id, endpoint.name)

    def attempt_failed(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """The pinned replica failed before answering (e.g. refused): a retry elsewhere is a move "gone"."""
        pin = request.context.session
        if pin is not None and pin.pinned == endpoint.name:
            pin.state = PinState.GONE

    def response_headers(self, request: InferenceRequest, endpoint: Endpoint) -> dict[str, str]:
        """The signed replica token, for clients that stick without a session id."""
        if self.token_header is None or request.context.session is None:
            return {}
        return {self.token_header: self.tokens.issue(endpoint.name)}
