"""Prompt tokens by key, least recently used out first, bounded in prompts and in tokens.

Bounded by count alone, 4,096 long prompts would be gigabytes. Used for the engine tokens of
whole prompts (:mod:`gateway.prefix.engine_tokens`) and of conversations' turns
(:mod:`gateway.prefix.turn_tokens`); each entry carries one integer beside its tokens.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

__all__ = ["TokenCache"]


class TokenCache:
    def __init__(self, entries: int, max_tokens: int = 16_000_000) -> None:
        self._entries = entries
        self._max_tokens = max_tokens
        self._cache: OrderedDict[bytes, tuple[array[int], int]] = OrderedDict()
        self.tokens = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._cache

    def get(self, key: bytes) -> tuple[array[int], int] | None:
        """The tokens and the integer stored with them; the entry is now the most recent."""
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
        return cached

    def put(self, key: bytes, tokens: list[int], note: int = 0) -> None:
        if not self._entries:
            return
        stored = array("I", tokens)
        replaced = self._cache.pop(key, None)
        self.tokens += len(stored) - (len(replaced[0]) if replaced is not None else 0)
        self._cache[key] = (stored, note)
        while len(self._cache) > self._entries or self.tokens > self._max_tokens:
            self.tokens -= len(self._cache.popitem(last=False)[1][0])
