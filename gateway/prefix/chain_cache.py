"""Block hashes of recent prompts, kept so that a prompt extending one is hashed only past it.

An agent sends its whole conversation again every turn: turn n+1 is turn n, the answer and
the next message; and an agent's sessions share their system prompt and tools. Hashing is
linear in the prompt (~2.8 µs a KB, one ``xxh3`` call per 64-byte block), so a 50 KB
conversation cost ~140 µs on the event loop every turn, almost all of it hashing bytes
hashed the turn before.

Each entry holds a prompt's bytes, its chain of block hashes, and the hasher's state every
``_CHECKPOINT`` blocks. A prompt is looked up by its session and by windows of its bytes that
end at 1 KB and at each 1.25× past it; the longest run of whole blocks it shares with an entry
found is reused, from the checkpoint at or before the run's end, and only the rest is hashed.
The result is :func:`~gateway.prefix.hashing.block_hashes`'s exactly (same hasher, same
bytes, same order), so the Redis index shared with gateways without this cache stays consistent.

Bounded in bytes and entries, least recently used out first; thread-safe (long prompts are
hashed in a worker thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from gateway.prefix.hashing import MODEL_SEPARATOR, prompt_bytes

__all__ = ["HashChainCache"]

_KEY_BYTES = 1024  # a prompt shorter than this is hashed as it is (16 blocks: ~45 µs at most)
_WINDOW_BYTES = 256  # the bytes of a prompt that a key holds
_MAX_LOOKS = 3  # distinct recent prompts compared with a new one, at most (each a memcmp, or a few)
_CHECKPOINT = 16  # blocks between saved hasher states: a diverging prompt re-hashes < 16 blocks
_STATE_BYTES = 720  # an xxh3 state (~711 bytes measured), as counted against the byte bound
_HASH_BYTES = 40  # an int in a list, as counted against the byte bound


@dataclass(slots=True, eq=False)
class _Chain:
    data: bytes  # the prompt's bytes as hashed (whole blocks, and a tail not hashed)
    hashes: tuple[int, ...]
    checkpoints: tuple[xxhash.xxh3_64, ...]  # the state after i * _CHECKPOINT blocks; never updated
    size: int  # counted against the byte bound
    refs: int = 0  # keys it is stored under (its session's, its windows')


class HashChainCache:
    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 65536) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[object, ...], _Chain] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused_blocks = 0  # since start: hashes taken from an entry (tests, benchmarks)
        self.hashed_blocks = 0  # since start: hashes computed

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def block_hashes(
        self,
        model: str,
        prompt: str,
        block_bytes: int,
        max_blocks: int | None = None,
        session: str | None = None,
    ) -> list[int]:
        """``hashing.block_hashes(model, prompt, block_bytes, max_blocks)``, reusing a recent
        prompt's chain where this one starts with the same blocks."""
        data = prompt_bytes(prompt, block_bytes, max_blocks)
        blocks = len(data) // block_bytes
        if len(data) < _KEY_BYTES or self.max_bytes <= 0:
            return self._hash(model, data, block_bytes, blocks, None, 0)[0]
        keys = _keys(model, block_bytes, data, session)
        with self._lock:
            candidates = {id(c): c for key in keys if (c := self._entries.get(key)) is not None}
        found, shared = None, 0
        for chain in list(candidates.values())[:_MAX_LOOKS]:  # the session's, then by the longest window
            if (blocks_shared := _shared_blocks(data, chain.data, block_bytes, blocks)) > shared:
                found, shared = chain, blocks_shared
            if shared * block_bytes >= len(chain.data) - block_bytes:
                break  # all of a chain found by its longest window: no other is longer
        hashes, checkpoints = self._hash(model, data, block_bytes, blocks, found, shared)
        size = len(data) + _HASH_BYTES * len(hashes) + _STATE_BYTES * len(checkpoints)
        size += (_WINDOW_BYTES + 100) * len(keys) + (len(session) if session is not None else 0)
        if size <= self.max_bytes:
            self._store(keys, _Chain(data, tuple(hashes), tuple(checkpoints), size))
        return hashes

    def _hash(
        self, model: str, data: bytes, block_bytes: int, blocks: int, found: _Chain | None, shared: int
    ) -> tuple[list[int], list[xxhash.xxh3_64]]:
        """The chain of ``data``'s blocks, the first ``shared`` of them as ``found`` has them."""
        if found is not None and shared >= _CHECKPOINT:
            start = shared - shared % _CHECKPOINT
            checkpoints = list(found.checkpoints[: start // _CHECKPOINT + 1])
            hashes = list(found.hashes[:start])
            hasher = checkpoints[-1].copy()
        else:
            start = 0
            hasher = xxhash.xxh3_64(model.encode("utf-8", "surrogatepass") + MODEL_SEPARATOR)
            checkpoints, hashes = [hasher.copy()], []
        update, digest, append = hasher.update, hasher.intdigest, hashes.append
        view = memoryview(data)
        for block in range(start, blocks):
            update(view[block * block_bytes : (block + 1) * block_bytes])
            append(digest())
            if (block + 1) % _CHECKPOINT == 0:
                checkpoints.append(hasher.copy())
        self.reused_blocks += start
        self.hashed_blocks += blocks - start
        return hashes, checkpoints

    def _store(self, keys: list[tuple[object, ...]], chain: _Chain) -> None:
        with self._lock:
            entries = self._entries
            for key in keys:
                self._release(entries.pop(key, None))
                entries[key] = chain
                chain.refs += 1
            self._bytes += chain.size
            while entries and (self._bytes > self.max_bytes or len(entries) > self.max_entries):
                self._release(entries.popitem(last=False)[1])

    def _release(self, chain: _Chain | None) -> None:
        """One key less for ``chain``; its bytes are freed with its last key."""
        if chain is not None:
            chain.refs -= 1
            if chain.refs == 0:
                self._bytes -= chain.size


def _keys(model: str, block_bytes: int, data: bytes, session: str | None) -> list[tuple[object, ...]]:
    """Where a prompt's chain is stored and looked for: its session, and the ``_WINDOW_BYTES``
    of it that end at 1 KB and at each 1.25× past that within it, the longest first. Without a
    session, the next turn of a conversation still finds its own previous turn: one of their
    windows lies past the start that conversations share (system prompt, tools) and holds
    this conversation's own text, once the conversation is a quarter longer than that start."""
    keys: list[tuple[object, ...]] = [] if session is None else [(model, block_bytes, "session", session)]
    ends = []
    end = _KEY_BYTES
    while end <= len(data):
        ends.append(end)
        end += end // 4
    keys += [(model, block_bytes, end, data[end - _WINDOW_BYTES : end]) for end in reversed(ends)]
    return keys


def _shared_blocks(data: bytes, other: bytes, block_bytes: int, blocks: int) -> int:
    """How many whole blocks ``data`` and ``other`` have in common from the start."""
    most = min(blocks, len(other) // block_bytes)
    view = memoryview(other)
    if data.startswith(view[: most * block_bytes]):
        return most  # the usual case: the next turn of the same conversation
    low, high = 0, most  # low blocks are shared, high are not
    while high - low > 1:
        middle = (low + high) // 2
        if data.startswith(view[: middle * block_bytes]):
            low = middle
        else:
            high = middle
    return low
