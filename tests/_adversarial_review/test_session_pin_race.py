"""Adversarial review of a31fd9d: session pins broadcast between workers.

Two workers pin the same session to different replicas before either has read the other's
datagram (two concurrent requests of one session, e.g. an agent's parallel calls, answered
by two workers). Each applies its own pin, then the sibling's (older or newer, no order
carried in the message): the two workers end up with *swapped* pins and disagree for the
rest of the session's life -- the very split the broadcast was added to prevent.
"""

from __future__ import annotations

import asyncio

from gateway.sessions.placement import SessionPlacement
from gateway.sessions.session_broadcast import BroadcastSessionStore
from gateway.sessions.store import MemorySessionStore


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def test_concurrent_pins_of_one_session_leave_the_workers_disagreeing(tmp_path):
    placements = [SessionPlacement(60, 100), SessionPlacement(60, 100)]
    stores = [
        BroadcastSessionStore(MemorySessionStore(60, 100), placements[w], str(tmp_path), w, 2)
        for w in (0, 1)
    ]
    for store in stores:
        store.start()
    try:
        # worker 0 answers turn N (replica-a), worker 1 answers a concurrent request of the same
        # session (replica-b) before its loop has read worker 0's datagram.
        stores[0].pin("s", "replica-a:8000")
        stores[1].pin("s", "replica-b:8000")
        await _settle()
        views = [s.local.get_now("s") for s in stores]
        # Any consistent outcome (both a, or both b) would be fine; swapped views are the defect.
        assert views[0] == views[1], f"workers disagree on the session's replica: {views}"
    finally:
        for store in stores:
            await store.close()
