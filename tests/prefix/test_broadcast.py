"""Prefix records broadcast between workers: real unix datagram sockets, two buses, one loop."""

from __future__ import annotations

import asyncio

from gateway.prefix.broadcast import BroadcastPrefixIndex, PrefixBus
from gateway.prefix.memory import MemoryPrefixIndex


async def _settle(condition, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


async def test_what_one_worker_records_the_other_matches(tmp_path):
    indexes = [BroadcastPrefixIndex(MemoryPrefixIndex(), PrefixBus(str(tmp_path), w, 2)) for w in range(2)]
    for index in indexes:
        index.start()
    try:
        long_prompt = list(range(1_000, 21_000))  # over one datagram: sent in pieces, tail first
        indexes[0].record([11, 12, 13], "replica-a:1")
        indexes[0].record(long_prompt, "replica-b:2")
        other = indexes[1]
        await _settle(lambda: other.size("replica-b:2") == len(long_prompt))
        assert await other.match([11, 12, 13, 99], ["replica-a:1", "replica-b:2"]) == {
            "replica-a:1": 3,
            "replica-b:2": 0,
        }
        assert (await other.match(long_prompt, ["replica-b:2"]))["replica-b:2"] == len(long_prompt)
        other.set_capacity("replica-b:2", 100)  # its LRU drops tails first: the head stayed newest
        assert (await other.match(long_prompt, ["replica-b:2"]))["replica-b:2"] == 100
        assert indexes[0].size("replica-b:2") == len(long_prompt)  # no echo back to the sender
    finally:
        for index in indexes:
            await index.close()


async def test_a_gone_sibling_costs_a_counted_drop_not_an_error(tmp_path):
    dropped = []
    index = BroadcastPrefixIndex(
        MemoryPrefixIndex(), PrefixBus(str(tmp_path), 0, 2, on_drop=lambda: dropped.append(1))
    )
    index.start()
    try:
        index.record([1, 2], "replica:1")  # worker 1 never bound its socket
        await _settle(lambda: bool(dropped))
        assert dropped == [1]
        assert index.size("replica:1") == 2
    finally:
        await index.close()
