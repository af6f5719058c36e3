"""Two workers' session stores over real unix datagram sockets (``--workers`` without Redis)."""

from __future__ import annotations

import json
import os
import socket
import time

from gateway.sessions.placement import SessionPlacement
from gateway.sessions.session_broadcast import BroadcastSessionStore
from gateway.sessions.store import MemorySessionStore
from tests.support.waiting import until


async def test_pins_reach_the_sibling_with_their_placement_and_garbage_is_dropped(tmp_path, caplog):
    placements = [SessionPlacement(60, 100), SessionPlacement(60, 100)]
    stores = [
        BroadcastSessionStore(MemorySessionStore(60, 100), placements[worker], str(tmp_path), worker, 2)
        for worker in (0, 1)
    ]
    for store in stores:
        store.start()
    try:
        stores[0].pin("session-a", "replica-a:8000")
        stores[0].pin("session-b", "replica-a:8000")
        assert await until(lambda: stores[1].local.get_now("session-b") is not None)
        assert await stores[1].get("session-a") == "replica-a:8000"
        assert placements[1].live("replica-a:8000") == 2  # session-balance sees the sibling's sessions
        stores[1].pin("session-a", "replica-b:8000")  # moved by the other worker
        assert await until(lambda: stores[0].local.get_now("session-a") == "replica-b:8000")
        assert placements[0].live("replica-b:8000") == 1

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:  # not a sibling's message
            target = os.path.join(str(tmp_path), "sessions-1.sock")
            for junk in (
                b"\xff\x00",
                b"[]",
                b'{"s": 5, "e": "r", "t": 1.0}',
                b'{"s": "x", "e": "r"}',
                b'{"s": "x", "e": "r", "t": NaN}',
                b'{"s": "x", "e": "r", "t": Infinity}',
                b'{"s": "x", "e": "r", "t": 1e300}',
                b"[" * 4000,
            ):
                raw.sendto(junk, target)
        stores[0].pin("session-c", "replica-c:8000")  # after the junk: still delivered
        assert await until(lambda: stores[1].local.get_now("session-c") == "replica-c:8000")
        assert await stores[1].get("x") is None
        assert stores[1].local.get_now("session-a") == "replica-b:8000"  # the junk changed nothing
        assert sum("malformed datagram" in r.getMessage() for r in caplog.records) == 8
    finally:
        for store in stores:
            await store.close()


async def test_a_sibling_that_is_gone_costs_a_counted_drop_not_a_failed_pin(tmp_path):
    dropped: list[int] = []
    store = BroadcastSessionStore(
        MemorySessionStore(60, 100), SessionPlacement(60, 100), str(tmp_path), 0, 2, lambda: dropped.append(1)
    )
    store.start()
    try:
        store.pin("session-a", "replica-a:8000")  # worker 1 never bound its socket
        assert await store.get("session-a") == "replica-a:8000"
        assert dropped == [1]
    finally:
        await store.close()


async def test_two_workers_pinning_one_session_at_once_agree_on_the_later_pin(tmp_path):
    """Two concurrent requests of one session answered by two workers: each pins before it
    reads the other's datagram. Each pin carries its time, so both keep the later one (without
    it each applied the other's last: swapped pins, the workers disagreeing)."""
    placements = [SessionPlacement(60, 100), SessionPlacement(60, 100)]
    stores = [
        BroadcastSessionStore(MemorySessionStore(60, 100), placements[w], str(tmp_path), w, 2) for w in (0, 1)
    ]
    for store in stores:
        store.start()
    try:
        for round_ in range(20):
            first, second = (0, 1) if round_ % 2 else (1, 0)
            stores[first].pin(f"s{round_}", "replica-a:8000")
            stores[second].pin(f"s{round_}", "replica-b:8000")  # later, before either reads
            assert await until(
                lambda r=round_: all(s.local.get_now(f"s{r}") == "replica-b:8000" for s in stores)
            )
        # a sibling counts a session where its winning pin is (the pinner counted it at send)
        assert placements[0].live("replica-a:8000") + placements[1].live("replica-a:8000") == 0
        assert placements[0].live("replica-b:8000") + placements[1].live("replica-b:8000") == 20
    finally:
        for store in stores:
            await store.close()


def test_an_older_pin_from_a_sibling_is_refused_and_ties_go_to_the_greater_name():
    store, now = MemorySessionStore(60, 100), time.monotonic()
    store.pin("s", "replica-b:8000", at=now)
    assert not store.pin_if_newer("s", "replica-a:8000", now - 1)  # older: refused
    assert store.get_now("s") == "replica-b:8000"
    assert store.pin_if_newer("s", "replica-c:8000", now)  # the same time: the greater name
    assert not store.pin_if_newer("s", "replica-a:8000", now)
    assert store.get_now("s") == "replica-c:8000"
    assert store.pin_if_newer("s", "replica-a:8000", now + 0.5)  # newer: applied
    assert store.get_now("s") == "replica-a:8000"


async def test_a_pin_that_expired_on_its_way_is_neither_applied_nor_counted(tmp_path):
    placement = SessionPlacement(60, 100)
    receiver = BroadcastSessionStore(MemorySessionStore(60, 100), placement, str(tmp_path), 1, 2)
    receiver.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            target = os.path.join(str(tmp_path), "sessions-1.sock")
            stale = json.dumps({"s": "old", "e": "replica-a:8000", "t": time.monotonic() - 61}).encode()
            fresh = json.dumps({"s": "new", "e": "replica-a:8000", "t": time.monotonic()}).encode()
            raw.sendto(stale, target)
            raw.sendto(fresh, target)
        assert await until(lambda: receiver.local.get_now("new") is not None)
        assert receiver.local.get_now("old") is None
        assert placement.live("replica-a:8000") == 1
    finally:
        await receiver.close()
