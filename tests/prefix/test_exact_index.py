"""The exact index: the gateway's own keys over token blocks, exact removal, bounded memory."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.exact import ExactIndex, block_keys

TOKENS = list(range(100, 112))  # three blocks of 4


def index() -> ExactIndex:
    return ExactIndex(KVEventMetrics(CollectorRegistry()))


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 4, **kw)  # type: ignore[arg-type]


def test_chain_matches_request_keys_and_removal_is_exact() -> None:
    idx = index()
    keys = block_keys([*TOKENS, 1, 2], 4)  # the partial block is not a key
    assert len(keys) == 3
    idx.apply("e", [stored([11, 12], None, TOKENS[:8]), stored([13], 12, TOKENS[8:])], 0.0)
    assert idx.matched_blocks("e", keys) == 3 and idx.block_size("e") == 4
    idx.apply("e", [BlockRemoved([12])], 0.0)
    assert idx.matched_blocks("e", keys) == 1  # the walk stops at the hole
    idx.apply("e", [stored([99], None, TOKENS[:4])], 0.0)  # a second engine hash, same key
    idx.apply("e", [BlockRemoved([11])], 0.0)
    assert idx.matched_blocks("e", keys) == 1  # still held once
    idx.apply("e", [AllBlocksCleared()], 0.0)
    assert idx.matched_blocks("e", keys) == 0 and idx.size("e") == 0


def test_orphans_other_media_and_extra_keys_never_match() -> None:
    idx = index()
    keys = block_keys(TOKENS, 4)
    idx.apply("e", [stored([2], 1, TOKENS[4:8])], 0.0)  # parent never seen
    idx.apply("e", [stored([3], None, TOKENS[:4], medium="CPU")], 0.0)
    idx.apply("e", [stored([4], None, TOKENS[:4], extra_keys=[("mm-hash", 0)])], 0.0)
    assert idx.matched_blocks("e", keys) == 0
    idx.apply("e", [stored([5], None, TOKENS[:4], lora_name="ad", extra_keys=[("ad",)])], 0.0)
    assert idx.matched_blocks("e", keys) == 0 and idx.lora_known("e", "ad")
    assert idx.matched_blocks("e", block_keys(TOKENS, 4, "ad")) == 1


def test_bounded_and_cleared_per_endpoint() -> None:
    idx = index()
    idx.set_capacity("e", 10)  # 11 with slack
    for i in range(30):
        idx.apply("e", [stored([1000 + i], None, [i, i, i, i])], 0.0)
    assert idx.size("e") == 11
    idx.set_live("e", True)
    assert idx.live("e") and not idx.live("other")
    idx.clear("e", "gap")
    assert idx.size("e") == 0 and idx.known("e")
    idx.clear("e", "removed")
    assert not idx.known("e")
