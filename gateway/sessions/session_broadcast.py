"""The memory session store of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's connections over the workers, so a conversation's next
turn lands on any worker. A worker with no pin for a session falls back to the same hashed
replica as its siblings (:func:`~gateway.sessions.store.rendezvous_pick`), but a session
that *moved* (its replica was drained, down, saturated, or scored worse) is pinned only in
the worker that moved it: its sibling sent the next turn back to the hashed replica, and the
conversation ran on two replicas' caches. Each pin is also sent to the siblings as one small
unix datagram (:class:`~gateway.ops.sibling_socket.SiblingMessages`), applied there to their
store and to their live-session count per replica (``session-balance``), so N workers place
and keep sessions as one process would. The pin is made at the answer's first byte, so the
datagram is in the sibling's buffer before the client has the answer and can send its next
turn. Each pin carries its ``time.monotonic()`` (one clock for the host's processes): a
sibling applies it only if newer than its own, so two workers pinning one session at once
agree on the later pin. A full receive buffer drops it (counted): that worker keeps what it
knew (its older pin, or the hashed fallback). With ``sessions.backend: redis`` the store is shared already and
this is not used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from gateway.ops.sibling_socket import SiblingMessages
from gateway.sessions.placement import SessionPlacement
from gateway.sessions.store import MemorySessionStore

__all__ = ["BroadcastSessionStore"]

_MAX_DATAGRAM = 4096  # a session key (32 hex digits, gateway.request.parse.session_key) and a name


class BroadcastSessionStore:
    """A :class:`MemorySessionStore` whose pins also reach the sibling workers (``SessionStore`` contract)."""

    def __init__(
        self,
        local: MemorySessionStore,
        placement: SessionPlacement,
        directory: str,
        worker: int,
        workers: int,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.local = local
        self._placement = placement
        self._siblings = SiblingMessages(directory, "sessions", worker, workers, _MAX_DATAGRAM, on_drop)

    def start(self) -> None:
        self._siblings.listen(self._receive)

    async def get(self, session_id: str) -> str | None:
        return await self.local.get(session_id)  # a learned pin, else the hashed fallback

    def pin(self, session_id: str, endpoint: str) -> None:
        at = time.monotonic()
        self.local.pin(session_id, endpoint, at)
        self._siblings.send({"s": session_id, "e": endpoint, "t": at})

    def active(self) -> int:
        return self.local.active()

    async def close(self) -> None:
        self._siblings.close()
        await self.local.close()

    def _receive(self, message: dict[str, Any]) -> None:
        session_id, endpoint, at = message["s"], message["e"], message["t"]
        if not isinstance(session_id, str) or not isinstance(endpoint, str) or not isinstance(at, float):
            raise TypeError("pin")
        now = time.monotonic()
        if not math.isfinite(at) or at > now + 1.0:  # NaN or the future: it would never expire
            raise ValueError("pin time")
        if at < now - self.local.ttl_s:
            return  # expired on its way (a stalled worker): nothing to apply or count
        # Two workers answering one session at once each pin, then read the other's pin: the
        # later pin wins in both (their clock is the host's), never a swap.
        if self.local.pin_if_newer(session_id, endpoint, at):
            self._placement.place(session_id, endpoint)
