"""Two workers' response stores over real unix datagram sockets (``--workers`` without Redis)."""

from __future__ import annotations

import os
import socket

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
