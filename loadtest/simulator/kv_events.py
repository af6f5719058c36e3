"""vLLM 0.32's KV-event publisher, on the simulator's own KV cache.

Same wire as vLLM's ``ZmqEventPublisher``: a ZMQ PUB socket sends one message per engine
step that changed the prefix cache, three frames ``[topic, seq, payload]`` — ``seq`` an
8-byte big-endian counter from 0, ``payload`` a msgpack ``EventBatch``
``[ts, events, data_parallel_rank]`` whose events are maps tagged ``type``:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
     "extra_keys": [None, ...], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

A ROUTER socket serves replays: a DEALER sends ``[b"", start_seq]`` and gets every
buffered message from ``start_seq`` on as ``[b"", topic, seq, payload]``, then
``[b"", b"", -1, b""]`` (vLLM 0.32's layout, checked against captured frames by
``tests/loadtest/test_kv_events_parity.py``).
``sources()`` is what ``GET /kv_event_sources`` answers under the publisher's DP rank: its
config, endpoints written as vLLM's ``--kv-events-config`` has them (``tcp://*:PORT``).

Fault hooks for tests: ``skip(n)`` buffers the next n messages without sending them (a
sequence gap the subscriber must replay), ``send_raw`` sends arbitrary frames, ``inject``
publishes arbitrary events in sequence, ``close`` is a dead publisher while the HTTP
server stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.fleet.zmq_context import OwnedContext

from .kvcache import KVCache

__all__ = ["KVEventPublisher", "wire_events"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


def wire_events(recorded: Sequence[tuple[Any, ...]], block_size: int) -> list[dict[str, Any]]:
    """The cache's recorded tuples as vLLM events; consecutive blocks of one chain share a BlockStored."""
    out: list[dict[str, Any]] = []
    for item in recorded:
        kind = item[0]
        last = out[-1] if out else None
        if kind == "stored":
            _, block_hash, parent, tokens, *rest = item
            lora = rest[0] if rest else None  # vLLM: the adapter's name, and it as each block's extra key
            extra = [lora] if lora is not None else None
            if (
                last is not None
                and last["type"] == "BlockStored"
                and last["block_hashes"][-1] == parent
                and parent is not None
                and last["lora_name"] == lora
            ):
                last["block_hashes"].append(block_hash)
                last["token_ids"].extend(tokens)
                last["extra_keys"].append(extra)
                continue
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hash],
                    "parent_block_hash": parent,
                    "token_ids": list(tokens),
                    "block_size": block_size,
                    "lora_id": None,
                    "medium": MEDIUM_GPU,
                    "lora_name": lora,
                    "extra_keys": [extra],  # one per block
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            )
        elif kind == "removed":
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(item[1])
                continue
            out.append(
                {"type": "BlockRemoved", "block_hashes": [item[1]], "medium": MEDIUM_GPU, "group_idx": 0}
            )
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"})
    return out


class KVEventPublisher:
    def __init__(
        self,
        cache: KVCache,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._cache = cache
        self._host = host
        self._want_ports = (port, replay_port)
        self.topic = topic
        self.buffer_steps = buffer_steps
        self._rank = self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0
        self.replay_port = 0
        self.next_seq = 0
        self._skip = 0
        self.replays_served = 0

    async def start(self) -> None:
        self._ctx = OwnedContext()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        base = f"tcp://{self._host}"
        self.port = self._bind(self._pub, base, self._want_ports[0])
        self.replay_port = self._bind(self._router, base, self._want_ports[1])
        self._cache.events = []
        self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")

    @staticmethod
    def _bind(socket: zmq.asyncio.Socket, base: str, port: int) -> int:
        if port:
            socket.bind(f"{base}:{port}")
            return port
        return socket.bind_to_random_port(base)

    def sources(self) -> dict[str, Any]:
        """vLLM's KVEventsConfig as ``GET /kv_event_sources`` shows it."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "buffer_steps": self.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.topic,
        }

    # -- publishing (called by the engine after each step) --------------------------------
    def flush(self) -> None:
        recorded = self._cache.events
        if not recorded or self._pub is None:
            return
        self._cache.events = []
        events = wire_events(recorded, self._cache.block_size)
        payload = self._encoder.encode([time.time(), events, self._rank])
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if self._skip > 0:
            self._skip -= 1
            return
        self._send([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    def _send(self, frames: list[bytes]) -> None:
        if self._pub is None:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)  # PUB drops at its HWM, never waits

    # -- fault hooks (tests) ----------------------------------------------------------------
    def skip(self, messages: int) -> None:
        self._skip += messages

    def send_raw(self, frames: list[bytes]) -> None:
        self._send(frames)

    def inject(self, events: list[Any], rank: Any = None) -> None:
        """Publish ``events`` (any shape) as the next batch in sequence, as if the engine had;
        ``rank``: another data_parallel_rank in the batch than this publisher's."""
        payload = self._encoder.encode([time.time(), events, self._rank if rank is None else rank])
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self._buffer.append((seq, payload))
        self._send([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    # -- replay ----------------------------------------------------------------------------
    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays_served += 1
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        """Sockets and context first, before any wait: a close cut short by a cancellation
        must not leave an open context to the garbage collector, whose ``Context.__del__``
        can block the process forever (see ``gateway.fleet.kv_events``)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self._pub = self._router = None
        self._cache.events = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)  # closes the PUB and ROUTER sockets, then terminates
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await task
