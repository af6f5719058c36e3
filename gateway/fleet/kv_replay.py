"""Asks an engine's replay endpoint for the KV-event batches it still buffers (vLLM 0.32).

A DEALER sends ``[b"", start_seq]``; the ROUTER answers each buffered batch from there as
``[b"", topic, seq, payload]`` (older versions leave the topic out), then seq -1. vLLM's
ROUTER sends with the default 1,000-message queue and drops, silently, what does not fit:
batches (holes, which the caller asks for again) and sometimes the end marker itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from gateway.fleet.kv_wire import decode_seq
from gateway.ops.time_slice import TimeSlice

__all__ = ["Replay", "fetch_replay"]

_SLICE_S = 0.005  # ready frames are had without yielding: yield to the loop this often
_MAX_REPLAY_BATCHES = 200_000  # a replay that goes on past this is cut there (vLLM buffers 10,000)


@dataclass(frozen=True, slots=True)
class Replay:
    batches: list[tuple[int, bytes]]  # (seq, payload), as they came
    ended: bool  # its end marker came; else it went quiet after some batches, or ran too long


async def fetch_replay(
    ctx: zmq.asyncio.Context, address: str, start: int, wait_s: float, malformed: Callable[[str], None]
) -> Replay:
    """The batches from ``start``. ``wait_s`` bounds each wait for the next frame, not the whole
    replay (10,000 batches take ~1 s to come): nothing at all within it raises TimeoutError;
    silence after some batches ends the replay there (its end marker was dropped). A socket
    the context cannot make raises ``zmq.ZMQError``, an undecodable seq ``DecodeError``."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, bytes]] = []
    time_slice = TimeSlice(_SLICE_S)
    try:
        dealer.connect(address)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while len(out) < _MAX_REPLAY_BATCHES:
            try:
                frames = await dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                try:
                    async with asyncio.timeout(wait_s):
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    if not out:
                        raise
                    return Replay(out, ended=False)
            if len(frames) not in (3, 4):
                malformed(f"replay: {len(frames)} frames, not 3 or 4")
                continue
            seq = decode_seq(frames[-2])
            if seq == -1:
                return Replay(out, ended=True)
            out.append((seq, frames[-1]))
            await time_slice.pause()
        return Replay(out, ended=False)
    finally:
        dealer.close(0)
