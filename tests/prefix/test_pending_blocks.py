"""Pending blocks in the exact index: sent and not reported yet, they count for routing only;
a BlockStored confirms them, a release starts their grace, and they are bounded and dropped
with the endpoint's state (AllBlocksCleared, a reset, a restart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.fleet.kv_wire import AllBlocksCleared, BlockStored
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.exact import ExactIndex, block_keys
from gateway.prefix.pending_blocks import PendingBlocks

TOKENS = list(range(100, 116))  # four blocks of 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def index(clock: Clock, grace: float | None = 0.5) -> ExactIndex:
    return ExactIndex(KVEventMetrics(CollectorRegistry()), pending_grace_s=grace, clock=clock)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 4)  # type: ignore[arg-type]


def test_pending_counts_for_routing_until_its_grace_after_release() -> None:
    clock = Clock()
    idx = index(clock)
    keys = block_keys(TOKENS, 4)
    idx.apply("e", [stored([1], None, TOKENS[:4])], 0.0)  # the engine holds block 0
    held = idx.matched_blocks("e", keys)
    assert held == 1 and idx.routing_blocks("e", keys, held) == 1
    idx.add_pending("e", keys[held:])
    assert idx.matched_blocks("e", keys) == 1  # the engine-exact answer does not change
    assert idx.routing_blocks("e", keys, 1) == 4 and idx.pending_size("e") == 3
    assert idx.routing_blocks("other", keys, 0) == 0
    clock.now += 30  # still in flight (no first byte yet): still pending
    assert idx.routing_blocks("e", keys, 1) == 4
    idx.release_pending("e", keys[held:])
    clock.now += 0.4
    assert idx.routing_blocks("e", keys, 1) == 4  # within the grace
    clock.now += 0.2
    assert idx.routing_blocks("e", keys, 1) == 1 and idx.pending_size("e") == 0  # expired


def test_a_key_stays_pending_while_another_request_with_it_is_in_flight() -> None:
    clock = Clock()
    idx = index(clock)
    keys = block_keys(TOKENS, 4)
    idx.add_pending("e", keys)
    idx.add_pending("e", keys[:2])  # a second request sharing two blocks
    idx.release_pending("e", keys)
    clock.now += 1.0
    assert idx.routing_blocks("e", keys, 0) == 2  # the second one is still in flight
    idx.release_pending("e", keys[:2])
    clock.now += 1.0
    assert idx.routing_blocks("e", keys, 0) == 0


def test_block_stored_confirms_and_a_never_answered_request_expires() -> None:
    clock = Clock()
    idx = index(clock)
    keys = block_keys(TOKENS, 4)
    idx.add_pending("e", keys)
    idx.apply("e", [stored([1, 2], None, TOKENS[:8])], 0.0)
    assert idx.pending_size("e") == 2  # blocks 0-1 are held now, no longer pending
    assert idx.matched_blocks("e", keys) == 2 and idx.routing_blocks("e", keys, 2) == 4
    clock.now += 61  # past the in-flight bound without a first byte
    assert idx.routing_blocks("e", keys, 2) == 2 and idx.pending_size("e") == 0


def test_cleared_reset_and_forgotten_endpoints_drop_their_pending_blocks() -> None:
    clock = Clock()
    idx = index(clock)
    keys = block_keys(TOKENS, 4)
    idx.add_pending("e", keys)
    idx.apply("e", [AllBlocksCleared()], 0.0)
    assert idx.pending_size("e") == 0 and idx.routing_blocks("e", keys, 0) == 0
    idx.add_pending("e", keys)
    idx.clear("e", "reconnect")  # a new stream (a restarted engine) starts the state over
    assert idx.pending_size("e") == 0
    idx.add_pending("e", keys)
    idx.set_live("e", True)
    idx.drop_pending("e")  # ExactPrefix.forget: removed, restarted or down
    assert idx.pending_size("e") == 0


def test_off_by_default_and_bounded_per_endpoint() -> None:
    clock = Clock()
    off = index(clock, grace=None)
    keys = block_keys(TOKENS, 4)
    off.add_pending("e", keys)
    assert off.pending_size("e") == 0 and off.routing_blocks("e", keys, 0) == 0
    idx = index(clock)
    idx.set_capacity("e", 10)  # 11 blocks with slack: no more pending keys than that
    for i in range(40):
        idx.add_pending("e", [1000 + i])
    assert idx.pending_size("e") == 11
    assert idx.routing_blocks("e", [1039], 0) == 1 and idx.routing_blocks("e", [1000], 0) == 0  # oldest went


def test_release_sweeps_expired_keys_from_the_front() -> None:
    pending = PendingBlocks(limit=100, grace_s=0.5, in_flight_s=60)
    pending.add(range(50), now=0.0)
    pending.release(range(50), now=0.0)
    pending.add([99], now=1.0)
    pending.release([99], now=1.0)  # the first 50 expired at 0.5: swept
    assert len(pending) == 1 and pending.live(99, 1.2)
