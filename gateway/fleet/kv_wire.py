"""vLLM's KV-event wire, decoded: ``[topic, seq, msgpack EventBatch]`` → typed events.

vLLM encodes with msgspec; across versions the batch is an array ``[ts, events, dp_rank]``
or a map ``{"ts", "events", "data_parallel_rank"}``, and each event a map tagged ``type``
or an array whose first item is the tag (``array_like``). All four shapes decode here,
fields by name or by vLLM's field order; unknown extra fields are ignored. A malformed
event is reported and skipped without losing the rest of its batch; an unknown event type
is returned as :class:`UnknownEvent` so the caller counts it.

The consumer of the events (the exact prefix index) sits above ``fleet`` in the layers, so
it is fed through the one-method-per-change :class:`KVEventSink` protocol.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVEvent",
    "KVEventSink",
    "UnknownEvent",
    "decode_batch",
    "decode_ranked_batch",
    "decode_seq",
]


class DecodeError(ValueError):
    """A frame or an event that is not vLLM's KV-event wire."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[Hashable]  # the engine's hashes: int or bytes
    parent_block_hash: Hashable | None
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block (multimodal hashes, cache salt, …)
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[Hashable]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


@dataclass(slots=True)
class UnknownEvent:
    type: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent

# vLLM's field order, for array-like events (after the tag).
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx",
)  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_DECODER = msgspec.msgpack.Decoder()


class KVEventSink(Protocol):
    """Where a subscriber delivers one endpoint's stream (implemented by the exact prefix index)."""

    def apply(self, endpoint: str, events: Sequence[KVEvent], published_at: float) -> None:
        """Events of one batch, in order; ``published_at`` is the batch's wall-clock ``ts``."""
        ...

    def clear(self, endpoint: str, reason: str) -> None:
        """Everything known about ``endpoint`` is void (restart, reconnect, lost events, removal)."""
        ...

    def set_live(self, endpoint: str, live: bool) -> None:
        """``live``: the stream is connected and in sequence; else the endpoint's state is not trusted."""
        ...


# Tokens per KV block: engines use 16-256; past this a value is garbage (and would make the
# request path build absurd structs).
MAX_BLOCK_SIZE = 4096


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], list[str]]:
    """``(ts, events, errors)``: the batch's events in order, and why any event was skipped."""
    ts, events, errors, _ = decode_ranked_batch(payload)
    return ts, events, errors


def decode_ranked_batch(payload: bytes) -> tuple[float, list[KVEvent], list[str], int | None]:
    """:func:`decode_batch` plus the batch's ``data_parallel_rank`` (None: absent or not an int)."""
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # Recursion: a nesting bomb
        raise DecodeError(f"not msgpack: {exc!r}"[:200]) from None
    if isinstance(batch, dict):
        ts, raw_events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, raw_events, rank = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    else:
        raise DecodeError("an EventBatch is [ts, events, ...] or {ts, events, ...}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(raw_events, list):
        raise DecodeError("EventBatch needs a numeric ts and a list of events")
    events: list[KVEvent] = []
    errors: list[str] = []
    for raw in raw_events:
        try:
            events.append(_event(raw))
        except DecodeError as exc:
            errors.append(str(exc))
    rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    return float(ts), events, errors, rank


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get("type")
        return tag, raw  # type: ignore[return-value]
    if isinstance(raw, list) and raw:
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise DecodeError("an event is a map tagged 'type' or an array starting with its tag")


def _hashes(value: Any) -> list[Hashable]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise DecodeError("block_hashes must be a list of integers or bytes")
    return value


def _optional(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise DecodeError(f"{name} has the wrong type")
    return value


def _event(raw: Any) -> KVEvent:
    tag = raw.get("type") if isinstance(raw, dict) else raw[0] if isinstance(raw, list) and raw else None
    if not isinstance(tag, str):
        raise DecodeError("event without a type tag")
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        hashes = _hashes(f.get("block_hashes"))
        tokens, size = f.get("token_ids"), f.get("block_size")
        if not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
            raise DecodeError(f"BlockStored.block_size must be an integer in 1..{MAX_BLOCK_SIZE}")
        if not hashes:
            raise DecodeError("BlockStored without blocks")
        if not isinstance(tokens, list) or len(tokens) != size * len(hashes):
            raise DecodeError("BlockStored.token_ids must hold block_size tokens per block")
        if not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise DecodeError("BlockStored.token_ids must be non-negative integers")
        parent = _optional(f.get("parent_block_hash"), (int, bytes), "parent_block_hash")
        extra = _optional(f.get("extra_keys"), list, "extra_keys")
        if extra is not None and len(extra) != len(hashes):
            raise DecodeError("BlockStored.extra_keys must have one entry per block")
        return BlockStored(
            hashes,
            parent,
            tokens,
            size,
            lora_name=_optional(f.get("lora_name"), str, "lora_name"),
            medium=_optional(f.get("medium"), str, "medium"),
            extra_keys=extra,
            group_idx=_optional(f.get("group_idx"), int, "group_idx"),
        )
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(
            _hashes(f.get("block_hashes")),
            medium=_optional(f.get("medium"), str, "medium"),
            group_idx=_optional(f.get("group_idx"), int, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag)
