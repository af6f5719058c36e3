"""The exact prefix index: per endpoint, the blocks its engine says it holds (KV events).

Keys are the gateway's own chained hash of each block's token ids — never the engine's
hash, whose recipe (sha256 or xxhash, seeds, extra keys) varies by version and config:

    key(block 0) = xxh3_64(tokens(block 0) [+ extra], seed=root(lora_name))
    key(block i) = xxh3_64(tokens(block i) [+ extra], seed=key(block i-1))

so the request side computes the same keys from the engine's tokens for the prompt, in
O(prompt blocks). A map engine-hash → key lets ``BlockRemoved`` evict exactly, and a key
is reference-counted (two engine hashes — e.g. different cache salts — may share it).
A block whose extra keys carry more than its LoRA name (multimodal hashes, a cache salt)
gets them mixed into its key, so a text-only request never matches it. Only GPU blocks
(``medium`` None or ``GPU``) of KV-cache group 0 count: that is what a request hits.
Memory is bounded per endpoint (its engine's block count plus slack, or a configured
default): past the bound the oldest-stored blocks go, which happens only when removals
were missed. With ``pending_grace_s`` set, blocks of requests sent to an endpoint and not
reported yet count for routing (:class:`~gateway.prefix.pending_blocks.PendingBlocks`,
:meth:`ExactIndex.routing_blocks`); ``matched_blocks`` stays what the engine reported.
This class is the :class:`~gateway.fleet.kv_wire.KVEventSink` of the
subscribers; it runs on the event loop, and each call is O(blocks in the batch).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgspec
import xxhash

from gateway.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.pending_blocks import PendingBlocks

__all__ = ["ExactIndex", "block_keys"]

log = logging.getLogger(__name__)

_ROOT = xxhash.xxh3_64_intdigest(b"llm-gateway exact prefix root")
_GPU = (None, "GPU", "gpu")
_SLACK = 1.1
_PENDING_MAX = 65_536  # pending keys per endpoint at most (and never more than its capacity)
_PENDING_IN_FLIGHT_S = 60.0  # a request that never answers stops counting then


def _root(lora_name: str | None) -> int:
    return _ROOT if not lora_name else xxhash.xxh3_64_intdigest(lora_name.encode(), seed=_ROOT)


def _extra_bytes(extra: Any, lora_name: str | None) -> bytes:
    if extra is None:
        return b""
    items = extra if isinstance(extra, list | tuple) else [extra]
    if all(item == lora_name for item in items):
        return b""  # the LoRA name is in the root already
    return b"\x00extra" + msgspec.msgpack.encode(extra)


def block_keys(tokens: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """The gateway keys of every full block of ``tokens`` (the request side)."""
    keys: list[int] = []
    parent = _root(lora_name)
    pack = struct.Struct(f"<{block_size}I").pack
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = digest(pack(*tokens[start : start + block_size]), seed=parent)
        keys.append(parent)
    return keys


class _Blocks:
    __slots__ = ("block_size", "by_engine", "capacity", "keys", "live", "loras", "pending")

    def __init__(self, capacity: int) -> None:
        self.keys: dict[int, int] = {}  # gateway key → how many engine blocks have it
        # engine hash → gateway key, oldest stored first; ordered so that evicting the oldest at
        # the capacity bound is O(1) (a plain dict's list() of it was O(capacity) per stored block)
        self.by_engine: OrderedDict[Hashable, int] = OrderedDict()
        self.block_size = 0
        self.loras: set[str] = set()
        self.capacity = capacity
        self.live = False
        self.pending: PendingBlocks | None = None  # sent, not reported yet (pending_grace_s set)

    def drop(self, engine_hash: Hashable) -> None:
        key = self.by_engine.pop(engine_hash, None)
        if key is not None:
            left = self.keys[key] - 1
            if left:
                self.keys[key] = left
            else:
                del self.keys[key]

    def clear(self) -> None:
        self.keys.clear()
        self.by_engine.clear()
        self.loras.clear()  # bounded by what one engine's lifetime names
        if self.pending is not None:
            self.pending.clear()


class ExactIndex:
    def __init__(
        self,
        metrics: KVEventMetrics,
        default_capacity: int = 1_048_576,
        *,
        pending_grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._default_capacity = default_capacity
        self._endpoints: dict[str, _Blocks] = {}
        self.pending_grace_s = pending_grace_s  # None: no pending blocks
        self._clock = clock

    def _blocks(self, endpoint: str) -> _Blocks:
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            blocks = self._endpoints[endpoint] = _Blocks(self._default_capacity)
        return blocks

    # -- KVEventSink --------------------------------------------------------------------
    def apply(self, endpoint: str, events: Sequence[KVEvent], published_at: float) -> None:
        blocks = self._blocks(endpoint)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(endpoint, blocks, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in _GPU and not event.group_idx:
                    for engine_hash in event.block_hashes:
                        blocks.drop(engine_hash)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
        self._metrics.exact_blocks.labels(endpoint).set(len(blocks.by_engine))

    def _stored(self, endpoint: str, blocks: _Blocks, event: BlockStored) -> None:
        if event.medium not in _GPU or event.group_idx:
            return
        size = event.block_size
        if blocks.block_size != size:
            if blocks.block_size:
                log.warning("exact index: %s changed block size %d → %d", endpoint, blocks.block_size, size)
                blocks.clear()
            blocks.block_size = size
        lora = event.lora_name
        if lora:
            blocks.loras.add(lora)
        if event.parent_block_hash is None:
            parent = _root(lora)
        else:
            known = blocks.by_engine.get(event.parent_block_hash)
            if known is None:
                return  # its parent is gone (or was never seen): nothing below it can be hit
            parent = known
        pending = blocks.pending
        try:
            pack = struct.Struct(f"<{size}I").pack
            for i, engine_hash in enumerate(event.block_hashes):
                data = pack(*event.token_ids[i * size : (i + 1) * size])
                if event.extra_keys is not None:
                    data += _extra_bytes(event.extra_keys[i], lora)
                parent = xxhash.xxh3_64_intdigest(data, seed=parent)
                if engine_hash in blocks.by_engine:
                    blocks.drop(engine_hash)
                blocks.by_engine[engine_hash] = parent
                blocks.keys[parent] = blocks.keys.get(parent, 0) + 1
                if pending is not None:
                    pending.confirm(parent)
        except (struct.error, TypeError, ValueError):
            self._metrics.decode_errors.labels(endpoint).inc()
            return
        for _ in range(len(blocks.by_engine) - blocks.capacity):
            blocks.drop(next(iter(blocks.by_engine)))

    def clear(self, endpoint: str, reason: str) -> None:
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            return
        if blocks.by_engine and reason != "removed":
            self._metrics.resets.labels(endpoint, reason).inc()
        if reason == "removed":
            del self._endpoints[endpoint]
            return
        blocks.clear()
        self._metrics.exact_blocks.labels(endpoint).set(0)

    def set_live(self, endpoint: str, live: bool) -> None:
        blocks = self._blocks(endpoint)
        if blocks.live != live:
            log.info("exact index: %s %s", endpoint, "live" if live else "not live (approximate answers)")
        blocks.live = live

    # -- queries ------------------------------------------------------------------------
    def live(self, endpoint: str) -> bool:
        blocks = self._endpoints.get(endpoint)
        return blocks is not None and blocks.live

    def known(self, endpoint: str) -> bool:
        """The endpoint has (or had) a stream: its fallback is worth counting."""
        return endpoint in self._endpoints

    def block_size(self, endpoint: str) -> int:
        blocks = self._endpoints.get(endpoint)
        return blocks.block_size if blocks else 0

    def lora_known(self, endpoint: str, lora_name: str) -> bool:
        blocks = self._endpoints.get(endpoint)
        return blocks is not None and lora_name in blocks.loras

    def matched_blocks(self, endpoint: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` the endpoint holds (walks from the root: O(blocks))."""
        blocks = self._endpoints.get(endpoint)
        if blocks is None:
            return 0
        held = blocks.keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def routing_blocks(self, endpoint: str, keys: Sequence[int], held: int) -> int:
        """Leading blocks of ``keys`` the endpoint holds or has pending (``held``: those it holds)."""
        blocks = self._endpoints.get(endpoint)
        pending = blocks.pending if blocks is not None else None
        if pending is None or not len(pending):
            return held
        now = self._clock()
        have = blocks.keys  # type: ignore[union-attr]
        count = held
        for key in keys[held:]:
            if key not in have and not pending.live(key, now):
                break
            count += 1
        return count

    def add_pending(self, endpoint: str, keys: Sequence[int]) -> None:
        """A request with these blocks (those after the ones held) was sent to ``endpoint``."""
        if self.pending_grace_s is None or not keys:
            return
        blocks = self._blocks(endpoint)
        if blocks.pending is None:
            limit = min(_PENDING_MAX, blocks.capacity)
            blocks.pending = PendingBlocks(limit, self.pending_grace_s, _PENDING_IN_FLIGHT_S)
        blocks.pending.add(keys, self._clock())

    def release_pending(self, endpoint: str, keys: Sequence[int]) -> None:
        """The request that added ``keys`` answered or ended: they count ``pending_grace_s`` more."""
        blocks = self._endpoints.get(endpoint)
        if blocks is not None and blocks.pending is not None:
            blocks.pending.release(keys, self._clock())

    def drop_pending(self, endpoint: str) -> None:
        blocks = self._endpoints.get(endpoint)
        if blocks is not None and blocks.pending is not None:
            blocks.pending.clear()

    def pending_size(self, endpoint: str) -> int:
        """Pending keys of ``endpoint`` not expired (sweeps them: O(pending))."""
        blocks = self._endpoints.get(endpoint)
        if blocks is None or blocks.pending is None:
            return 0
        return blocks.pending.count_live(self._clock())

    def size(self, endpoint: str) -> int:
        blocks = self._endpoints.get(endpoint)
        return len(blocks.by_engine) if blocks else 0

    def set_capacity(self, endpoint: str, engine_blocks: int) -> None:
        """The engine's KV size in blocks bounds what it can report holding (plus slack)."""
        blocks = self._blocks(endpoint)
        blocks.capacity = max(1, int(engine_blocks * _SLACK))
        if blocks.pending is not None:
            blocks.pending.limit = min(_PENDING_MAX, blocks.capacity)
