"""Sticky sessions: session id → the replica that holds its warm cache, with a TTL.

Two stores behind one protocol: in memory (bounded LRU, the default) and Redis
(shared by gateway instances). Like the prefix index, the Redis store mirrors every
pin locally and answers from that copy when Redis is slow or down — a request never
fails because of Redis.

Clients that cannot send a session id can stick with the opaque token the gateway
returns (``x-session-token``): the replica's name plus an HMAC, so a client can replay
its own token but cannot forge one that picks an arbitrary backend.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from gateway.sessions.redis_mirror import MirroredStore

__all__ = ["MemorySessionStore", "RedisSessionStore", "SessionStore", "SessionTokens", "rendezvous_pick"]


class SessionStore(Protocol):
    async def get(self, session_id: str) -> str | None:
        """The endpoint name the session is pinned to, if the pin is alive."""
        ...

    def pin(self, session_id: str, endpoint: str) -> None:
        """Pin (or re-pin) and refresh the TTL. Never waits: remote writes run later."""
        ...

    def active(self) -> int:
        """Sessions this instance knows to be alive (the local view)."""
        ...

    async def close(self) -> None: ...


def rendezvous_pick(session_id: str, names: Iterable[str]) -> str | None:
    """The name with the highest hash of (session, name): highest-random-weight hashing.

    Every process computes the same answer from the same names, with no shared state, and
    when one replica leaves or joins only the sessions that hashed to it move.
    """
    key = session_id.encode()
    best: str | None = None
    best_weight = b""
    for name in names:
        weight = hashlib.blake2b(key + b"\x00" + name.encode(), digest_size=8).digest()
        if weight > best_weight:
            best, best_weight = name, weight
    return best


class MemorySessionStore:
    """Pins in this process's memory (with several workers, kept in step by
    :class:`~gateway.sessions.session_broadcast.BroadcastSessionStore`).

    ``fallback`` answers for a session this process has no pin for. With several workers
    (``server.workers``) the kernel spreads a client's connections across them, so the
    wiring gives each worker the same deterministic fallback (:func:`rendezvous_pick` over
    the healthy replicas): a conversation lands on the same replica whichever worker
    receives it, without a shared store. A learned pin still wins where one exists.
    """

    def __init__(
        self, ttl_s: float, max_sessions: int, fallback: Callable[[str], str | None] | None = None
    ) -> None:
        self.ttl_s = ttl_s
        self._max = max_sessions
        # id → (endpoint, expires, pinned at), in refresh order
        self._pins: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self.fallback = fallback

    def get_now(self, session_id: str) -> str | None:
        entry = self._pins.get(session_id)
        if entry is None:
            return None
        endpoint, expires, _ = entry
        if expires < time.monotonic():
            del self._pins[session_id]
            return None
        return endpoint

    async def get(self, session_id: str) -> str | None:
        pinned = self.get_now(session_id)
        if pinned is None and self.fallback is not None:
            return self.fallback(session_id)
        return pinned

    def pin(self, session_id: str, endpoint: str, at: float | None = None) -> None:
        """Pin now (or at ``at``, a ``time.monotonic()`` reading), refreshing the TTL."""
        at = time.monotonic() if at is None else at
        self._pins[session_id] = (endpoint, at + self.ttl_s, at)
        self._pins.move_to_end(session_id)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    @property
    def max_sessions(self) -> int:
        return self._max

    def sessions_newest_first(self) -> list[str]:
        """Every pinned session, most recently pinned first (references only, nothing copied)."""
        return list(reversed(self._pins))

    def entry(self, session_id: str) -> tuple[str, float] | None:
        """The live pin of a session as (replica, the time it was pinned), if any."""
        entry = self._pins.get(session_id)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0], entry[2]

    def pin_if_newer(self, session_id: str, endpoint: str, at: float) -> bool:
        """A pin made elsewhere at ``at`` (``time.monotonic()``: one clock for every process on
        the host), applied unless this store's pin of the session is newer (equal times: the
        greater replica name wins, the same choice everywhere); whether it was applied."""
        entry = self._pins.get(session_id)
        if entry is not None and (entry[2], entry[0]) >= (at, endpoint):
            return False
        self.pin(session_id, endpoint, at)
        return True

    def restore(self, session_id: str, endpoint: str, at: float) -> bool:
        """An older pin from elsewhere (a sibling worker's), kept unless this store pinned the
        session later or is full; it goes in as less recent than every pin here. Whether it was kept."""
        entry = self._pins.get(session_id)
        if (entry is not None and (entry[2], entry[0]) >= (at, endpoint)) or len(self._pins) >= self._max:
            return False
        self._pins[session_id] = (endpoint, at + self.ttl_s, at)
        self._pins.move_to_end(session_id, last=False)
        return True

    def active(self) -> int:
        # Pins are kept in refresh order and share one TTL, so the oldest expire first (a
        # sibling worker's pin arrives a moment after it was made: counted that moment longer).
        now = time.monotonic()
        while self._pins:
            _, (_, expires, _) = next(iter(self._pins.items()))
            if expires >= now:
                break
            self._pins.popitem(last=False)
        return len(self._pins)

    async def close(self) -> None:
        self._pins.clear()


class RedisSessionStore(MirroredStore[MemorySessionStore]):
    """Keys ``<prefix>:session:{<id>}`` → endpoint name, with ``PX ttl`` refreshed on every pin
    (the Redis side is :class:`~gateway.sessions.redis_mirror.RedisMirror`, shared with the
    response store)."""

    kind = "session"

    async def get(self, session_id: str) -> str | None:
        value = await self._redis.get(session_id)
        if value is None:
            # Redis down, or it does not know a pin this instance just made (its SET may
            # still be in flight) or made while Redis was down: the local pin is still true.
            return self.local.get_now(session_id)
        try:
            return value.decode()
        except UnicodeDecodeError:  # not a pin this gateway wrote: the local one, as when Redis is down
            return self.local.get_now(session_id)

    def pin(self, session_id: str, endpoint: str) -> None:
        self.local.pin(session_id, endpoint)
        self._redis.set(session_id, endpoint)

    def active(self) -> int:
        return self.local.active()


class SessionTokens:
    """Opaque, signed replica tokens: ``base64url(endpoint) . hmac[:16]``.

    The secret must be the same in every process that may see the token back: all
    instances (``sessions.token_secret``) and, when it is not set, all workers of one
    instance (the parent generates one for them, :func:`gateway.http.server.serve`).
    """

    def __init__(self, secret: str | None) -> None:
        self._key = (secret or secrets.token_hex(32)).encode()

    def _mac(self, payload: bytes) -> str:
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()[:32]

    def issue(self, endpoint: str) -> str:
        payload = endpoint.encode()
        return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + self._mac(payload)

    def verify(self, token: str) -> str | None:
        """The endpoint name if the token is ours and intact, else None."""
        encoded, _, mac = token.partition(".")
        if not encoded or not mac or len(token) > 512 or not token.isascii():
            return None
        try:
            payload = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except ValueError:
            return None
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        return payload.decode(errors="replace")
