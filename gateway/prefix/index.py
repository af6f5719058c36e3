"""The prefix-index contract: which endpoint holds how much of a request's prefix.

An index never answers "yes" for a block it did not record for that endpoint, is
bounded per endpoint, and can forget an endpoint at once (removed, restarted, down).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["PrefixIndex"]


class PrefixIndex(Protocol):
    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        """Blocks of the longest recorded prefix of ``hashes`` per endpoint (0 when none).

        ``model`` namespaces storage (the hashes already include it); backends may ignore it.
        """
        ...

    def record(self, hashes: Sequence[int], endpoint: str, model: str = "") -> None:
        """``endpoint`` now holds every block of ``hashes``. Never waits: remote writes run later."""
        ...

    async def purge(self, endpoint: str, models: Sequence[str] = ()) -> None:
        """Forget everything recorded for ``endpoint``."""
        ...

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        """Bound ``endpoint``'s entries to ``blocks`` (its real KV capacity in our block size)."""
        ...

    def size(self, endpoint: str) -> int:
        """Entries currently held for ``endpoint`` (the local view)."""
        ...

    def capacity(self, endpoint: str) -> int: ...

    async def close(self) -> None: ...
