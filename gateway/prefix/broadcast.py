"""The memory prefix index of one worker, kept in step with its siblings' by broadcast.

Why: the kernel spreads a client's *connections* over the workers, so the turns of one
conversation land on different workers. With a per-worker memory index, the worker that
did not send turn 1 knows nothing of where its prefix went and routes turn 2 blind. Here
every ``record`` (endpoint, block hashes) is also queued for the siblings; the queue is
sent as unix datagrams (``SiblingSocket``: one per worker in the gateway's directory) once per
event-loop turn, off the request's path, and each worker applies what it receives to its
own index as if it had recorded it. With ``prefix.backend: redis`` (or exact KV events) the
index is already shared and this is not used.

Bounded: a datagram carries at most ``_MAX_DATAGRAM`` bytes; a full receive buffer drops
the datagram (counted, never waited for): a lost record costs one less-informed routing
decision, not correctness. Purges are not sent: every worker probes health and scrapes
the engines itself, so each sees a restart or an outage and purges on its own.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Sequence

from gateway.ops.sibling_socket import SiblingSocket
from gateway.prefix.memory import MemoryPrefixIndex

__all__ = ["BroadcastPrefixIndex", "PrefixBus"]

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 60_000
_HEADER = struct.Struct("<HI")  # endpoint name length, hash count


def _encode(records: list[tuple[str, Sequence[int]]]) -> list[bytes]:
    """Records → datagrams. A record too long for one is cut, tail first: each piece recorded
    later is a prefix nearer the root, so the receiver's LRU keeps heads newer than tails."""
    datagrams: list[bytes] = []
    current = bytearray()
    room = (_MAX_DATAGRAM - _HEADER.size - 256) // 8
    for name, hashes in records:
        raw = name.encode()
        pieces = [hashes[i : i + room] for i in range(0, len(hashes), room)]
        for piece in reversed(pieces):
            chunk = _HEADER.pack(len(raw), len(piece)) + raw + struct.pack(f"<{len(piece)}Q", *piece)
            if len(current) + len(chunk) > _MAX_DATAGRAM:
                datagrams.append(bytes(current))
                current = bytearray()
            current += chunk
    if current:
        datagrams.append(bytes(current))
    return datagrams


def _decode(datagram: bytes) -> list[tuple[str, tuple[int, ...]]]:
    records = []
    at = 0
    while at < len(datagram):
        name_len, count = _HEADER.unpack_from(datagram, at)
        at += _HEADER.size
        name = datagram[at : at + name_len].decode()
        at += name_len
        records.append((name, struct.unpack_from(f"<{count}Q", datagram, at)))
        at += 8 * count
    return records


class PrefixBus:
    """Records queued by this worker, sent to its siblings once per loop turn; theirs applied here."""

    def __init__(
        self,
        directory: str,
        worker: int,
        workers: int,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self._socket = SiblingSocket(directory, "prefix", worker, workers, _MAX_DATAGRAM)
        self._on_drop = on_drop
        self._queue: list[tuple[str, Sequence[int]]] = []
        self._flush_scheduled = False

    def publish(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Queue one record; sent with the others of this loop turn."""
        self._queue.append((endpoint, hashes))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        records, self._queue = self._queue, []
        for datagram in _encode(records):
            failed = self._socket.send(datagram)
            if failed and self._on_drop is not None:
                for _ in range(failed):
                    self._on_drop()

    def listen(self, apply: Callable[[str, tuple[int, ...]], None]) -> None:
        """Apply every sibling's records as they arrive (on this loop)."""

        def receive(datagram: bytes) -> None:
            try:
                records = _decode(datagram)
            except (struct.error, UnicodeDecodeError):  # only siblings can write here
                log.warning("prefix broadcast: a malformed datagram was dropped")
                return
            for endpoint, hashes in records:
                apply(endpoint, hashes)

        self._socket.listen(receive)

    def close(self) -> None:
        self._socket.close()


class BroadcastPrefixIndex:
    """A memory index whose records also reach the siblings (``PrefixIndex`` contract)."""

    def __init__(self, local: MemoryPrefixIndex, bus: PrefixBus) -> None:
        self.local = local
        self._bus = bus

    def start(self) -> None:
        self._bus.listen(lambda endpoint, hashes: self.local.record(hashes, endpoint))

    async def match(self, hashes: Sequence[int], endpoints: Sequence[str], model: str = "") -> dict[str, int]:
        return self.local.match_now(hashes, endpoints)

    def record(self, hashes: Sequence[int], endpoint: str, model: str = "") -> None:
        self.local.record(hashes, endpoint, model)
        if hashes:
            self._bus.publish(endpoint, hashes)

    async def purge(self, endpoint: str, models: Sequence[str] = ()) -> None:
        await self.local.purge(endpoint, models)

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self.local.set_capacity(endpoint, blocks)

    def size(self, endpoint: str) -> int:
        return self.local.size(endpoint)

    def capacity(self, endpoint: str) -> int:
        return self.local.capacity(endpoint)

    async def close(self) -> None:
        self._bus.close()
        await self.local.close()
