"""Blocks sent to an endpoint that its engine has not reported yet (``prefix.kv_events.pending_blocks``).

The exact index learns a block only from the engine's ``BlockStored``, which comes after the
prefill that computes it; a request sharing the prefix and routed in between would see no hit
anywhere and go by load alone. A request's blocks are therefore *pending* on the endpoint it
was sent to — a routing signal only, never in the predicted cached tokens (those stay what
the engine reported) — from the send until:

- the engine's ``BlockStored`` confirms the block (it becomes a held block), or
- the request's first byte (or its end) plus ``grace_s`` (the time the event takes to arrive;
  past it the engine did not store the block: evicted, or never computed), or
- ``in_flight_s`` after the last send that added it (a request that never answers), or
- the endpoint's reset (``AllBlocksCleared``, a new stream, a restart), which drops them all.

A key is counted per request in flight (two requests sharing a prefix), so the first one to
answer does not end the second's. At most ``limit`` keys per endpoint (the oldest added go
first); expired keys go as they are met (a query, or the front of the queue on a release).
Every call is O(keys given). Pending blocks are this process's own sends: sibling workers and
other gateways learn the blocks from the engine's events, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["PendingBlocks"]


class PendingBlocks:
    __slots__ = ("_entries", "grace_s", "in_flight_s", "limit")

    def __init__(self, limit: int, grace_s: float, in_flight_s: float) -> None:
        # key → [requests in flight with it, expires at]; least recently added first
        self._entries: OrderedDict[int, list[float]] = OrderedDict()
        self.limit = max(1, limit)
        self.grace_s = grace_s
        self.in_flight_s = in_flight_s

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, keys: Iterable[int], now: float) -> None:
        entries = self._entries
        until = now + self.in_flight_s
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                entries[key] = [1, until]
            else:
                entry[0] += 1
                entry[1] = max(entry[1], until)
                entries.move_to_end(key)
        while len(entries) > self.limit:
            entries.popitem(last=False)

    def release(self, keys: Iterable[int], now: float) -> None:
        """A request that added ``keys`` answered (or ended): they last ``grace_s`` more."""
        entries = self._entries
        until = now + self.grace_s
        for key in keys:
            entry = entries.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    entry[1] = until
        self.sweep(now)

    def sweep(self, now: float) -> None:
        """Drop expired keys from the front (the least recently added), up to the first live one."""
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry[1] > now:
                return
            del entries[key]

    def confirm(self, key: int) -> None:
        """The engine reported the block stored: the index holds it now."""
        self._entries.pop(key, None)

    def live(self, key: int, now: float) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry[1] > now:
            return True
        del self._entries[key]
        return False

    def count_live(self, now: float) -> int:
        """Keys not expired (drops the expired ones: O(keys))."""
        expired = [key for key, entry in self._entries.items() if entry[1] <= now]
        for key in expired:
            del self._entries[key]
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
