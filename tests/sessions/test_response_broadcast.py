"""Two workers' response stores over real unix datagram sockets (``--workers`` without Redis)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import pytest

from gateway.ops import catch_up
from gateway.ops.catch_up import remove_files_of
from gateway.sessions.response_broadcast import BroadcastResponseStore
from gateway.sessions.responses import MemoryResponseStore, ResponseRecord
from tests.support.waiting import until


async def test_puts_and_forgets_reach_the_sibling_and_garbage_is_dropped(tmp_path, caplog):
    stores = [
        BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), worker, 2) for worker in (0, 1)
    ]
    for store in stores:
        store.start()
    try:
        stores[0].put("resp_1", ResponseRecord("replica-a:8000", "chain-1", "tenant-a"))
        stores[0].put("resp_2", ResponseRecord("replica-b:8000", "chain-2", None))
        assert await until(lambda: stores[1].local.get_now("resp_2") is not None)
        assert await stores[1].get("resp_1") == ResponseRecord("replica-a:8000", "chain-1", "tenant-a")
        assert (await stores[1].get("resp_2")).tenant is None

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:  # not a sibling's message
            target = os.path.join(str(tmp_path), "responses-1.sock")
            for junk in (b"\xff\x00", b"[]", b'{"id": 5}', b'{"id": "x", "e": "r", "c": "c", "t": 7}'):
                raw.sendto(junk, target)
        stores[1].forget("resp_2")  # from the other side, after the junk
        assert await until(lambda: stores[0].local.get_now("resp_2") is None)
        assert await stores[1].get("resp_1") is not None  # the junk changed nothing
        assert await stores[1].get("x") is None
        assert sum("malformed datagram" in r.getMessage() for r in caplog.records) == 4
    finally:
        for store in stores:
            await store.close()


async def test_a_replacement_catches_up_in_order_with_expiries_and_without_what_was_deleted(tmp_path):
    old = BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), 0, 2)
    for i in range(5):
        old.put(f"resp_{i}", ResponseRecord(f"replica-{i}:8000", f"chain-{i}", "tenant-a"))
    expiries = {rid: old.local.entry(rid)[1] for rid in old.local.ids_newest_first()}
    new = BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), 1, 2)
    new.start(catch_up=True)  # the sibling does not listen here: its answer is made below
    try:
        new.put("resp_new", ResponseRecord("replica-9:8000", "chain-9", "tenant-a"))  # made since
        new._receive({"id": "resp_3"})  # a sibling's delete, after its file was begun
        await old.catch_up._answer(1, str(os.getpid()))  # as asked by the worker with this pid
        assert await until(lambda: new.catch_up.applied == 5)  # every row read, resp_3 then left out
        ids = new.local.ids_newest_first()
        assert ids == ["resp_new", "resp_4", "resp_2", "resp_1", "resp_0"]
        assert all(new.local.entry(rid)[1] == expiries[rid] for rid in ids[1:])  # not a new TTL
        assert new.local.get_now("resp_3") is None  # not brought back
        assert new.local.get_now("resp_2") == ResponseRecord("replica-2:8000", "chain-2", "tenant-a")
        assert not list(tmp_path.glob("responses-catch-up-*"))  # the file is removed once read
    finally:
        await new.close()
        await old.close()


async def test_a_malformed_catch_up_file_costs_its_bad_rows_only(tmp_path, caplog):
    caplog.set_level(logging.INFO, "gateway.ops.catch_up")
    new = BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), 1, 2)
    new.start(catch_up=True)
    pid = str(os.getpid())
    try:
        good = ["resp_ok", "replica-a:8000", "chain-1", None, time.monotonic() + 30]
        later = ["resp_later", "replica-a:8000", "chain-2", None, time.monotonic() + 30]
        rows = [
            "not json at all",
            json.dumps([good, ["short"], [1, "r", "c", None, 1.0], ["resp_x", "r", "c", None, 1e300]]),
            "[" * 100_000,  # past msgspec's depth: a RecursionError, which used to end the whole file
            json.dumps([later]),
        ]
        (tmp_path / f"responses-catch-up-0-to-1-{pid}").write_text("\n".join(rows))
        stale = tmp_path / "responses-catch-up-0-to-1-1"  # for an earlier worker of this slot
        stale.write_text(json.dumps([["resp_stale", "r", "c", None, time.monotonic() + 30]]))
        new._receive({"caught_up": 0, "to": 1, "n": "1"})  # not this worker's request: left alone
        new._receive({"caught_up": 0, "to": 1, "n": pid})
        assert await until(lambda: new.catch_up.applied == 2)
        assert new.local.get_now("resp_ok") is not None and new.local.get_now("resp_later") is not None
        assert new.local.get_now("resp_x") is None and new.local.get_now("resp_stale") is None
        logged = [r.getMessage() for r in caplog.records]
        assert "responses: caught up from worker 0 (2 records, 3 malformed)" in logged, logged
        new._receive({"caught_up": 0, "to": 1, "n": pid})  # a second notice: no file any more, no crash
        assert await until(lambda: any("catch-up: taking" in r.getMessage() for r in caplog.records))
        assert stale.exists()
        remove_files_of(str(tmp_path), 1)  # the parent, once the worker it was for is dead
        assert not stale.exists()
    finally:
        await new.close()


@pytest.mark.parametrize("first_answers", [True, False])
async def test_one_sibling_is_asked_and_the_others_only_when_it_does_not_answer(
    tmp_path, monkeypatch, first_answers
):
    monkeypatch.setattr(catch_up, "ASK_ALL_AFTER_S", 0.2)
    first, new, other = (
        BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), w, 3) for w in range(3)
    )
    for sibling in (first, other):
        for i in range(3):
            sibling.local.put(f"resp_{i}", ResponseRecord("replica-a:8000", f"chain-{i}", None))
    if first_answers:
        first.start()  # else it never reads its socket (hung)
    other.start()
    new.start(catch_up=True)  # asks worker 0 only
    try:
        assert await until(lambda: new.catch_up.applied == 3)  # worker 0, or worker 2 after 0.2 s
        await asyncio.sleep(0.4)
        assert new.catch_up.applied == 3  # one file, not one per sibling
        assert len(new.local) == 3
    finally:
        for store in (first, new, other):
            await store.close()


@pytest.mark.parametrize(
    "message",
    [{"catch_up": True, "n": "1"}, {"catch_up": 7, "n": "1"}, {"catch_up": 1, "n": "../x"}, {"catch_up": 1}],
)
async def test_a_catch_up_request_from_no_sibling_is_dropped(tmp_path, caplog, message):
    store = BroadcastResponseStore(MemoryResponseStore(60, 100), str(tmp_path), 0, 2)
    store.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.sendto(json.dumps(message).encode(), os.path.join(str(tmp_path), "responses-0.sock"))
        assert await until(lambda: any("malformed datagram" in r.getMessage() for r in caplog.records))
        await asyncio.sleep(0.05)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["responses-0.sock"]  # no file written
    finally:
        await store.close()
