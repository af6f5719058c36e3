"""vLLM's KV-event wire: every shape vLLM has used decodes; bad events are skipped, not fatal."""

from __future__ import annotations

import msgspec
import pytest

from gateway.config.kv_events import KVEventSourceConfig
from gateway.fleet.kv_sources import source_from
from gateway.fleet.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    UnknownEvent,
    decode_batch,
    decode_seq,
)

enc = msgspec.msgpack.encode
STORED_MAP = {
    "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5, 6, 7, 8],
    "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
}  # fmt: skip
STORED_ARRAY = ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None]


@pytest.mark.parametrize("stored", [STORED_MAP, STORED_ARRAY])
@pytest.mark.parametrize("as_map", [False, True])
def test_batch_and_event_shapes(stored: object, as_map: bool) -> None:
    events = [stored, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}, ["AllBlocksCleared"]]
    batch = {"ts": 1.5, "events": events, "data_parallel_rank": 0} if as_map else [1.5, events, 0]
    ts, decoded, errors = decode_batch(enc(batch))
    assert ts == 1.5 and errors == []
    assert decoded[0] == BlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU")
    assert decoded[1] == BlockRemoved([2], "GPU") and decoded[2] == AllBlocksCleared()


def test_bad_events_are_skipped_and_unknown_types_returned() -> None:
    bad_tokens = {**STORED_MAP, "token_ids": [1]}
    _, events, errors = decode_batch(enc([0.0, [bad_tokens, {"type": "Frob"}, 7, STORED_MAP]]))
    assert events[0] == UnknownEvent("Frob") and isinstance(events[1], BlockStored)
    assert len(errors) == 2
    for payload in (b"\xc1", enc({"x": 1}), enc([None, []]), enc("text")):
        with pytest.raises(DecodeError):
            decode_batch(payload)
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(DecodeError):
        decode_seq(b"\x01")


def test_sources_put_the_replica_host_for_a_wildcard() -> None:
    vllm = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558", "topic": "kv"}  # fmt: skip
    source = source_from(vllm, "10.0.0.7")
    assert source is not None and source.endpoint == "tcp://10.0.0.7:5557"
    assert source.replay_endpoint == "tcp://10.0.0.7:5558" and source.topic == "kv"
    assert source_from([vllm], "::1").endpoint == "tcp://[::1]:5557"  # type: ignore[union-attr]
    assert source_from({"enable_kv_cache_events": False}, "h") is None
    assert source_from({"publisher": "null", "endpoint": "tcp://*:1"}, "h") is None
    configured = KVEventSourceConfig(endpoint="tcp://0.0.0.0:9000")
    assert source_from(configured, "gpu-3").endpoint == "tcp://gpu-3:9000"  # type: ignore[union-attr]
    assert source_from(KVEventSourceConfig(endpoint="tcp://h:1", enabled=False), "h") is None
