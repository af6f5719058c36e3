"""Two workers' session stores over real unix datagram sockets (``--workers`` without Redis)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import time

from gateway.sessions.placement import SessionPlacement
from gateway.sessions.session_broadcast import BroadcastSessionStore
from gateway.sessions.store import MemorySessionStore
from tests.support.waiting import until


def _two_workers(tmp_path) -> tuple[list[SessionPlacement], list[BroadcastSessionStore]]:
    """Two workers' stores, listening, over real sockets in ``tmp_path``."""
    placements = [SessionPlacement(60, 100), SessionPlacement(60, 100)]
    stores = [
        BroadcastSessionStore(MemorySessionStore(60, 100), placements[w], str(tmp_path), w, 2) for w in (0, 1)
    ]
    for store in stores:
        store.start()
    return placements, stores


async def test_pins_reach_the_sibling_with_their_placement_and_garbage_is_dropped(tmp_path, caplog):
    placements, stores = _two_workers(tmp_path)
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
    placements, stores = _two_workers(tmp_path)
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


async def _datagrams(sock: socket.socket) -> list[dict]:
    """What a raw sibling socket received so far (non-blocking)."""
    got = []
    while True:
        try:
            got.append(json.loads(sock.recv(4096)))
        except BlockingIOError:
            return got


async def test_a_session_on_the_same_replica_is_told_once_then_again_before_its_siblings_copy_expires(
    tmp_path,
):
    """Every turn of a session pins; the siblings hear of a new replica at once, of the same one
    only every ttl/16 (each datagram cost both ends ~16 us a request, 11 % of a session request)."""
    ttl = 1.6  # told again every 0.1 s
    local, placement = MemorySessionStore(ttl, 100), SessionPlacement(ttl, 100)
    store = BroadcastSessionStore(local, placement, str(tmp_path), 0, 2)
    sibling = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # worker 1's socket, read raw
    sibling.bind(os.path.join(str(tmp_path), "sessions-1.sock"))
    sibling.setblocking(False)
    store.start()
    try:
        for _ in range(50):  # 50 turns on one replica within ~0.01 s: told once
            store.pin("s", "replica-a:8000")
        assert [(d["s"], d["e"]) for d in await _datagrams(sibling)] == [("s", "replica-a:8000")]
        store.pin("s", "replica-b:8000")  # moved: told at once
        assert [d["e"] for d in await _datagrams(sibling)] == ["replica-b:8000"]
        told_at = time.monotonic()
        while time.monotonic() - told_at < 0.35:  # turns every 10 ms for 0.35 s: told ~3 more times
            store.pin("s", "replica-b:8000")
            await asyncio.sleep(0.01)
        again = await _datagrams(sibling)
        assert 2 <= len(again) <= 5, again
        assert all(d["e"] == "replica-b:8000" for d in again)
        assert all(b["t"] - a["t"] >= ttl / 16 for a, b in itertools.pairwise(again)), again
    finally:
        await store.close()
        sibling.close()


async def test_a_newer_pin_not_yet_told_is_told_when_a_sibling_announces_an_older_move(tmp_path):
    """Worker 0 pinned replica A again after it last told (not told: the same replica); worker 1
    moved the session to B a moment before that, and told. Worker 0 keeps its newer A, so it must
    tell it now, or worker 1 (and every other) would route the session to B and worker 0 to A."""
    _, stores = _two_workers(tmp_path)
    try:
        stores[0].pin("s", "replica-a:8000")
        assert await until(lambda: stores[1].local.get_now("s") == "replica-a:8000")
        stores[1].pin("s", "replica-b:8000")  # a move, told to worker 0 (read on its next loop turn)
        stores[0].pin("s", "replica-a:8000")  # later, the same replica as told: not told again
        assert await until(lambda: all(s.local.get_now("s") == "replica-a:8000" for s in stores))
        await asyncio.sleep(0.05)  # and it stays agreed (no ping-pong of re-tells)
        assert [s.local.get_now("s") for s in stores] == ["replica-a:8000", "replica-a:8000"]
    finally:
        for store in stores:
            await store.close()


async def test_a_replacement_catches_up_on_its_siblings_pins_and_keeps_its_newer_ones(tmp_path):
    sibling = BroadcastSessionStore(
        MemorySessionStore(60, 100), SessionPlacement(60, 100), str(tmp_path), 0, 2
    )
    for i in range(4):
        sibling.local.pin(f"session-{i}", f"replica-{i}:8000")
    pinned_at = {s: sibling.local.entry(s)[1] for s in sibling.local.sessions_newest_first()}
    placement = SessionPlacement(60, 100)
    new = BroadcastSessionStore(MemorySessionStore(60, 100), placement, str(tmp_path), 1, 2)
    sibling.start()
    new.start(catch_up=True)  # asks the sibling, which answers with its file
    try:
        new.pin("session-2", "replica-9:8000")  # moved here since: newer than the sibling's
        assert await until(lambda: new.catch_up.applied == 4)
        assert new.local.sessions_newest_first() == ["session-2", "session-3", "session-1", "session-0"]
        assert new.local.entry("session-0") == ("replica-0:8000", pinned_at["session-0"])  # its own time
        assert new.local.entry("session-2")[0] == "replica-9:8000"
        assert placement.live("replica-1:8000") == 1 and placement.live("replica-2:8000") == 0
    finally:
        await new.close()
        await sibling.close()
