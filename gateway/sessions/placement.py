"""Where this gateway has been sending each live session: the count per replica.

Why: a session's history grows on its replica's KV cache turn after turn, so a replica that
was given one session more than the others is the first to evict. Prefix scoring cannot see
that when new sessions start: every replica may hold the shared system prompt and little
queued work (docs/benchmarks.md §10: 7 of 12 agent sessions on one of two real vLLM
replicas, that replica evicting from turn 3 on). Counted at send, not at the first byte,
so sessions that start together see each other. Per process; with several workers the
siblings' pins are counted too (:mod:`gateway.sessions.session_broadcast`).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

__all__ = ["SessionPlacement"]


class SessionPlacement:
    """Session id → the replica its latest request was sent to, for ``ttl_s`` after it."""

    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self._ttl_s = ttl_s
        self._max = max_sessions
        # refresh order = expiry order (one TTL for all): the oldest expire from the front
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._per_endpoint: Counter[str] = Counter()

    def place(self, session_id: str, endpoint: str) -> None:
        previous = self._sessions.pop(session_id, None)
        if previous is not None:
            self._drop(previous[0])
        self._sessions[session_id] = (endpoint, time.monotonic() + self._ttl_s)
        self._per_endpoint[endpoint] += 1
        while len(self._sessions) > self._max:
            _, (oldest, _) = self._sessions.popitem(last=False)
            self._drop(oldest)

    def live(self, endpoint: str) -> int:
        """Sessions whose latest request went to ``endpoint`` within the TTL."""
        self._expire()
        return self._per_endpoint.get(endpoint, 0)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._sessions:
            session_id, (endpoint, expires) = next(iter(self._sessions.items()))
            if expires >= now:
                return
            del self._sessions[session_id]
            self._drop(endpoint)

    def _drop(self, endpoint: str) -> None:
        left = self._per_endpoint[endpoint] - 1
        if left > 0:
            self._per_endpoint[endpoint] = left
        else:
            del self._per_endpoint[endpoint]
