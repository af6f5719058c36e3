"""The memory session store of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's connections over the workers, so a conversation's next
turn lands on any worker. A worker with no pin for a session falls back to the same hashed
replica as its siblings (:func:`~gateway.sessions.store.rendezvous_pick`), but a session
that *moved* (its replica was drained, down, saturated, or scored worse) is pinned only in
the worker that moved it: its sibling sent the next turn back to the hashed replica, and the
conversation ran on two replicas' caches. A pin is also sent to the siblings as one small
unix datagram (:class:`~gateway.ops.sibling_socket.SiblingMessages`), applied there to their
store and to their live-session count per replica (``session-balance``), so N workers place
and keep sessions as one process would. Every turn of a session pins, nearly always to the
replica it had, so a pin is sent only when the siblings do not know it: a new replica, or the
same one ``ttl / 16`` after they last heard of it (so their copy lives while the session is in
use; at its end they forget it up to ``ttl / 16`` early and fall back to the hashed replica).
Sending every pin cost ~11 % of the CPU of a session request with two workers. The pin is
made at the answer's first byte, so the datagram is in the sibling's buffer before the client
has the answer and can send its next turn. Each pin carries its ``time.monotonic()`` (one
clock for the host's processes): a sibling applies it only if newer than its own, so two
workers pinning one session at once agree on the later pin (a worker whose newer pin was not
sent sends it when a sibling's older one arrives). A full receive buffer drops it (counted):
that worker keeps what it knew (its older pin, or the hashed fallback). A worker started in
place of a dead one asks a sibling for every pin it holds
(:class:`~gateway.ops.catch_up.CatchUp`). With ``sessions.backend: redis`` the store is
shared already and this is not used.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.ops.catch_up import CatchUp
from gateway.ops.sibling_socket import SiblingMessages
from gateway.sessions.placement import SessionPlacement
from gateway.sessions.store import MemorySessionStore

__all__ = ["BroadcastSessionStore"]

_RETELL_EVERY = 16  # the same pin is told again after ttl / this (siblings lose at most that at its end)
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
        # per session, the last pin every worker heard (sent from here or received): (replica, time)
        self._told: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_told = local.max_sessions
        self._retell_s = local.ttl_s / _RETELL_EVERY
        self._siblings = SiblingMessages(directory, "sessions", worker, workers, _MAX_DATAGRAM, on_drop)
        # newest first: each is restored as older than the ones before it
        self.catch_up = CatchUp(self._siblings, local.sessions_newest_first, self._encode, self._caught_up)

    def start(self, catch_up: bool = False) -> None:
        """Listen to the siblings; ``catch_up`` (a replacement worker): ask them for their pins."""
        self._siblings.listen(self._receive)
        if catch_up:
            self.catch_up.request()

    async def get(self, session_id: str) -> str | None:
        return await self.local.get(session_id)  # a learned pin, else the hashed fallback

    def pin(self, session_id: str, endpoint: str) -> None:
        """Pin here; tell the siblings only what they do not know: a new replica for the session,
        or the same one when what they last heard is ``ttl / _RETELL_EVERY`` old (their copy
        must not expire while the session is in use). Every turn of a session pins, and most
        pin the replica it already had."""
        at = time.monotonic()
        self.local.pin(session_id, endpoint, at)
        told = self._told.get(session_id)
        if told is None or told[0] != endpoint or at - told[1] >= self._retell_s:
            self._tell(session_id, endpoint, at)

    def _tell(self, session_id: str, endpoint: str, at: float) -> None:
        self._siblings.send({"s": session_id, "e": endpoint, "t": at})
        self._remember(session_id, endpoint, at)

    def _remember(self, session_id: str, endpoint: str, at: float) -> None:
        told = self._told
        told[session_id] = (endpoint, at)
        told.move_to_end(session_id)
        if len(told) > self._max_told:
            told.popitem(last=False)

    def active(self) -> int:
        return self.local.active()

    async def close(self) -> None:
        await self.catch_up.close()
        self._siblings.close()
        await self.local.close()

    def _encode(self, session_id: str) -> list[Any] | None:
        pinned = self.local.entry(session_id)
        return None if pinned is None else [session_id, *pinned]

    def _caught_up(self, row: list[Any]) -> None:
        """A pin from a sibling's file (this worker was started in place of a dead one). It goes in
        as older than every pin made here (the file is read newest first), so pins stay in the
        order they expire in; one this worker has a newer pin of is left out."""
        session_id, endpoint, at = row
        if self._live(session_id, endpoint, at) and self.local.restore(session_id, endpoint, at):
            self._placement.place(session_id, endpoint)
            self._remember(session_id, endpoint, at)

    def _receive(self, message: dict[str, Any]) -> None:
        if self.catch_up.handle(message):
            return
        session_id, endpoint, at = message["s"], message["e"], message["t"]
        if not self._live(session_id, endpoint, at):
            return  # expired on its way (a stalled worker): nothing to apply or count
        # Two workers answering one session at once each pin, then read the other's pin: the
        # later pin wins in both (their clock is the host's), never a swap.
        if self.local.pin_if_newer(session_id, endpoint, at):
            self._placement.place(session_id, endpoint)
            self._remember(session_id, endpoint, at)
            return
        # Ours is newer. If it is another replica the siblings never heard of (a pin made here
        # after the last one told, not told since), they would now keep this older one: tell ours.
        mine = self.local.entry(session_id)
        if mine is not None and mine[0] != endpoint and self._told.get(session_id) != mine:
            self._tell(session_id, *mine)

    def _live(self, session_id: Any, endpoint: Any, at: Any) -> bool:
        """Whether a sibling's pin is still live; a malformed one raises (logged, dropped)."""
        if not isinstance(session_id, str) or not isinstance(endpoint, str) or not isinstance(at, float):
            raise TypeError("pin")
        now = time.monotonic()
        if not math.isfinite(at) or at > now + 1.0:  # NaN or the future: it would never expire
            raise ValueError("pin time")
        return at >= now - self.local.ttl_s
