"""The exact index at its capacity bound (removals were missed): each new block must not cost O(capacity).

A direct test of the real ExactIndex (what the subscriber feeds on the event loop): one drain of
the stream applies up to 256 batches between yields, so a per-event cost linear in the capacity
stalls every request of the gateway.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from gateway.fleet.kv_wire import BlockStored
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.exact import ExactIndex


def _fill(index: ExactIndex, name: str, blocks: int) -> None:
    step = 8192
    for start in range(0, blocks, step):
        hashes = list(range(start, min(blocks, start + step)))
        index.apply(name, [BlockStored(hashes, None, [1] * len(hashes), 1)], time.time())


async def test_storing_at_capacity_is_not_linear_in_the_capacity() -> None:
    index = ExactIndex(KVEventMetrics(CollectorRegistry()))
    index.set_capacity("e", 500_000)  # an H200-sized engine's block count (x1.1 slack)
    _fill(index, "e", 550_000)  # a full index: BlockRemoved events were missed
    assert index.size("e") == 550_000
    started = time.perf_counter()
    for i in range(256):  # one drain's worth of one-block batches
        index.apply("e", [BlockStored([10**9 + i], None, [2], 1)], time.time())
    took = time.perf_counter() - started
    assert index.size("e") == 550_000
    assert took < 0.25, f"256 one-block stores at capacity held the event loop for {took:.2f}s"
