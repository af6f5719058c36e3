"""Session affinity: looks up a request's pin, judges whether it is usable, re-pins after routing.

Shared by the ``session-affinity`` scorer (read side) and the session hook (write side),
so both agree on what "the pinned replica" is for a request.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.metrics import GatewayMetrics
from gateway.saturation import SaturationDetector
from gateway.sessions import SessionStore, SessionTokens
from gateway.types import Endpoint, InferenceRequest

__all__ = ["SessionAffinity"]

_PIN = "session_pin"
_PIN_STATE = "session_pin_state"  # "usable" | "saturated" | "gone"


class SessionAffinity:
    def __init__(
        self,
        store: SessionStore,
        tokens: SessionTokens,
        detector: SaturationDetector,
        metrics: GatewayMetrics,
        token_header: str | None,
    ) -> None:
        self.store = store
        self.tokens = tokens
        self._detector = detector
        self._metrics = metrics
        self.token_header = token_header

    async def lookup(self, request: InferenceRequest) -> str | None:
        if _PIN in request.attributes:
            return request.attributes[_PIN]
        pinned: str | None = None
        if request.session_id:
            pinned = await self.store.get(request.session_id)
        elif self.token_header and (token := request.headers.get(self.token_header)):
            pinned = self.tokens.verify(token)  # forged or foreign tokens pin nothing
        request.attributes[_PIN] = pinned
        return pinned

    def pinned_name(self, request: InferenceRequest) -> str | None:
        return request.attributes.get(_PIN)

    def usable_pin(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Endpoint | None:
        """The pinned endpoint if it is a candidate and has headroom, else None."""
        name = self.pinned_name(request)
        if name is None:
            return None
        for endpoint in candidates:
            if endpoint.name == name:
                if self._detector.saturated(endpoint):
                    request.attributes[_PIN_STATE] = "saturated"
                    return None
                request.attributes[_PIN_STATE] = "usable"
                return endpoint
        request.attributes[_PIN_STATE] = "gone"
        return None

    def after_routing(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """Count the hit or the move (with its reason) and pin the session to ``endpoint``.

        Called once per request, for the attempt that got an answer.
        """
        if _PIN not in request.attributes:
            return  # no session-affinity scorer looked at this request
        pinned = self.pinned_name(request)
        if pinned is not None:
            if pinned == endpoint.name:
                self._metrics.session_hits.inc()
            else:
                state = request.attributes.get(_PIN_STATE, "gone")
                self._metrics.session_moves.labels("scored" if state == "usable" else state).inc()
        if request.session_id:
            self.store.pin(request.session_id, endpoint.name)

    def attempt_failed(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """The pinned replica failed before answering (e.g. refused): a retry elsewhere is a move "gone"."""
        if self.pinned_name(request) == endpoint.name:
            request.attributes[_PIN_STATE] = "gone"

    def response_headers(self, request: InferenceRequest, endpoint: Endpoint) -> dict[str, str]:
        """The signed replica token, for clients that stick without a session id."""
        if self.token_header is None or _PIN not in request.attributes:
            return {}
        return {self.token_header: self.tokens.issue(endpoint.name)}
