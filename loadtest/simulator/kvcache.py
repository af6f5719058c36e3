"""vLLM-style paged KV cache with automatic prefix caching.

Mirrors vLLM's KVCacheManager: a fixed pool of blocks, chained hashes of *full*
blocks, ref counts, and an LRU free queue in which blocks of finished requests
stay cached (ref 0) until evicted. This is what makes routing quality show up in
TTFT: a request only skips prefill for the blocks that are still resident here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash

_ROOT_HASH = 0x9E3779B97F4A7C15


def block_hashes(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: int | None = None
) -> list[int]:
    """Chained xxh3_64 hashes of the full blocks of `tokens`, from block index `start`."""
    out: list[int] = []
    prev = _ROOT_HASH if parent is None else parent
    n_full = len(tokens) // block_size
    for b in range(start, n_full):
        chunk = tokens[b * block_size : (b + 1) * block_size]
        h = xxhash.xxh3_64()
        h.update(prev.to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in chunk))
        prev = h.intdigest()
        out.append(prev)
    return out


class SeqBlocks:
    """Blocks owned by one sequence, and how many of them are registered in the cache."""

    __slots__ = ("block_ids", "hashes", "lora", "root")

    def __init__(self) -> None:
        self.root: int | None = None  # the hash chain's seed: a LoRA adapter's (None: the base model)
        self.lora: str | None = None  # that adapter's name (KV events carry it)
        self.block_ids: list[int] = []
        self.hashes: list[int] = []  # hashes of the first len(hashes) blocks (all full + cached)


class KVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Blocks with ref 0, oldest (next to evict) first. Cached ones keep their hash.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0
        # KV events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) as plain tuples, for
        # loadtest.simulator.kv_events to publish after each step; None: not recorded (the default).
        self.events: list[tuple[Any, ...]] | None = None

    # ---- state -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_blocks

    # ---- lookup ------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of leading full blocks."""
        out: list[int] = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries_tokens += queried_tokens
        self.hits_tokens += hit_tokens

    # ---- allocation ----------------------------------------------------------
    def touch(self, seq: SeqBlocks, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Give `seq` the cached blocks `block_ids` (a prefix hit)."""
        for bid in block_ids:
            if self.ref[bid] == 0:
                self.free_queue.pop(bid, None)
            self.ref[bid] += 1
        seq.block_ids.extend(block_ids)
        seq.hashes.extend(hashes[: len(block_ids)])

    def blocks_needed(self, seq: SeqBlocks, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_ids))

    def can_allocate(self, n: int, extra_hits: Sequence[int] = ()) -> bool:
        # Cached hit blocks with ref 0 sit in the free queue but will be taken, not evicted.
        reclaim = sum(1 for b in extra_hits if self.ref[b] == 0)
        return self.num_free - reclaim >= n

    def allocate(self, seq: SeqBlocks, num_tokens: int) -> bool:
        """Grow `seq` to hold `num_tokens` tokens, evicting LRU cached blocks. False if out of blocks."""
        n = self.blocks_needed(seq, num_tokens)
        if n > self.num_free:
            return False
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            old = self.block_hash[bid]
            if old is not None:
                if self.cached.get(old) == bid:
                    del self.cached[old]
                    if self.events is not None:
                        self.events.append(("removed", old))
                self.block_hash[bid] = None
                self.evictions += 1
            self.ref[bid] = 1
            seq.block_ids.append(bid)
        return True

    def cache_full_blocks(self, seq: SeqBlocks, tokens: Sequence[int], num_computed: int) -> list[int]:
        """Register blocks that are now full of computed tokens so later requests can hit them.

        Returns the indices (within the sequence) of the blocks this call newly put in the cache,
        which is what vLLM reports as ``created_cache_tokens``.
        """
        n_full = min(num_computed // self.block_size, len(seq.block_ids))
        if n_full <= len(seq.hashes):
            return []
        parent = seq.hashes[-1] if seq.hashes else seq.root
        bs = self.block_size
        new = block_hashes(tokens[: n_full * bs], bs, len(seq.hashes), parent)
        created: list[int] = []
        for i, h in enumerate(new, start=len(seq.hashes)):
            bid = seq.block_ids[i]
            if h not in self.cached:  # duplicates stay uncached, as in vLLM
                self.cached[h] = bid
                self.block_hash[bid] = h
                created.append(i)
                if self.events is not None:
                    k = i - 1 - len(seq.hashes)
                    block_parent = None if i == 0 else new[k] if k >= 0 else seq.hashes[i - 1]
                    block = tokens[i * bs : (i + 1) * bs]
                    self.events.append(("stored", h, block_parent, block, seq.lora))
        seq.hashes.extend(new)
        return created

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block, only when none is in use."""
        if self.num_free != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(("cleared",))
        return True

    def free(self, seq: SeqBlocks) -> None:
        """Drop a sequence's references; blocks stay cached, tail blocks are evicted first."""
        for bid in reversed(seq.block_ids):
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self.free_queue[bid] = None
        seq.block_ids.clear()
        seq.hashes.clear()
