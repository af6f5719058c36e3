"""In-memory prefix index: one bounded LRU of block hashes per endpoint.

Blocks are touched leaf-first (last block first, root last), so a parent is always
at least as recent as its children and LRU eviction drops the tail of a prefix
before its head — exactly what an engine's own LRU does. That keeps the invariant
"block i present ⇒ blocks 0..i present", which lets ``match`` binary-search the
longest prefix in O(log n) lookups per endpoint instead of walking every block.
Entries also age out after ``ttl_s`` without use.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["MemoryPrefixIndex"]


class _EndpointBlocks:
    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, float] = OrderedDict()  # hash → last use (monotonic)


class MemoryPrefixIndex:
    def __init__(self, default_capacity: int = 65536, ttl_s: float = 3600.0) -> None:
        self.default_capacity = default_capacity
        self.ttl_s = ttl_s
        self._endpoints: dict[str, _EndpointBlocks] = {}

    def _blocks(self, endpoint: str) -> _EndpointBlocks:
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            blocks = self._endpoints[endpoint] = _EndpointBlocks(self.default_capacity)
        return blocks

    def match_now(self, hashes: Sequence[int], endpoints: Sequence[str]) -> dict[str, int]:
        """Synchronous match (the memory index never waits)."""
        expired_before = time.monotonic() - self.ttl_s
        result = {}
        for endpoint in endpoints:
            blocks = self._endpoints.get(endpoint)
            if blocks is None or not hashes:
                result[endpoint] = 0
                continue
            entries = blocks.entries
            first = entries.get(hashes[0])
            if first is None or first < expired_before:  # holds nothing of this prompt: one lookup
                result[endpoint] = 0
                continue
            low, high = 1, len(hashes)  # invariant: hashes[:low] present; hashes[high:] absent
            while low < high:
                mid = (low + high + 1) // 2
                seen = entries.get(hashes[mid - 1])
                if seen is not None and seen >= expired_before:
                    low = mid
                else:
                    high = mid - 1
            result[endpoint] = low
        return result

    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        return self.match_now(hashes, endpoints)

    def record(self, hashes: Sequence[int], endpoint: str, model: str = "") -> None:
        if not hashes:
            return
        blocks = self._blocks(endpoint)
        entries = blocks.entries
        now = time.monotonic()
        move = entries.move_to_end
        for block_hash in reversed(hashes):
            if block_hash in entries:
                move(block_hash)
            entries[block_hash] = now
        overflow = len(entries) - blocks.capacity
        for _ in range(max(0, overflow)):
            entries.popitem(last=False)

    async def purge(self, endpoint: str, models: Sequence[str] = ()) -> None:
        self._endpoints.pop(endpoint, None)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        entry = self._blocks(endpoint)
        entry.capacity = max(1, blocks)
        while len(entry.entries) > entry.capacity:
            entry.entries.popitem(last=False)

    def capacity(self, endpoint: str) -> int:
        return self._blocks(endpoint).capacity

    def size(self, endpoint: str) -> int:
        blocks = self._endpoints.get(endpoint)
        return len(blocks.entries) if blocks else 0

    async def close(self) -> None:
        self._endpoints.clear()
