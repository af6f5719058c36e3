"""The simulator's KV events have the structure of real vLLM 0.32's, frame for frame.

``tests/e2e_vllm/captures/kv-events.vllm.json`` holds frames captured from a real vLLM
0.32 CPU replica (``python -m loadtest.realvllm.kv_capture``: a request, the same one
again, enough others to evict, ``/reset_prefix_cache``, a replay). The same script runs
here against a simulator; both recordings must agree on the frame layout (three frames,
8-byte sequence, the topic), the batch layout (array or map, its length and item
types), the event types, each event type's field names and the type of every field's
value, the replay answer, and the shape of ``GET /kv_event_sources`` and ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.kv_sources import source_from
from gateway.fleet.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from loadtest.realvllm.kv_capture import capture
from loadtest.simulator import SimConfig, running_simulator

CAPTURE = Path(__file__).resolve().parents[1] / "e2e_vllm" / "captures" / "kv-events.vllm.json"


def kind(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return "bytes"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if value is None:
        return "null"
    return type(value).__name__


def frames(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for step in record["steps"].values():
        yield from step["events"]


def events(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for frame in frames(record):
        yield from frame["decoded"][1] if isinstance(frame["decoded"], list) else frame["decoded"]["events"]


def layout(record: dict[str, Any]) -> dict[str, Any]:
    """Everything about a recording's structure, nothing about its values."""
    out: dict[str, Any] = {
        "frames": sorted({f["frames"] for f in frames(record)}),
        "seq_bytes": sorted({len(f["hex"][1]) // 2 for f in frames(record)}),
        "batch": sorted({(kind(f["decoded"]), len(f["decoded"])) for f in frames(record)}),
        "batch_items": sorted({tuple(kind(v) for v in f["decoded"]) for f in frames(record)}),
    }
    fields: dict[str, set[tuple[str, str]]] = {}
    for event in events(record):
        assert isinstance(event, dict), "events are maps tagged 'type'"
        fields.setdefault(event["type"], set()).update((k, kind(v)) for k, v in event.items())
        for name in ("block_hashes", "token_ids", "extra_keys"):
            for item in event.get(name) or ():
                fields[event["type"]].add((f"{name}[]", kind(item)))
    out["events"] = {t: sorted(f) for t, f in sorted(fields.items())}
    sources = record["kv_event_sources"]["body"]
    out["kv_event_sources"] = sorted(
        (k, sorted(v) if isinstance(v, dict) else kind(v)) for k, v in sources.items()
    )
    out["tokenize"] = sorted(record["tokenize"])
    out["replay"] = [(r["dealer_frames"], r["frames"]) for r in record["replay"][-1:]]
    out["replay_end_seq"] = record["replay"][-1]["seq"]
    return out


@pytest.fixture(scope="module")
def vllm_record() -> dict[str, Any]:
    return json.loads(CAPTURE.read_text())


async def simulator_record(vllm_record: dict[str, Any]) -> dict[str, Any]:
    topic = vllm_record["steps"]["first"]["events"][0]["topic"]
    config = SimConfig(
        port=0, model="tiny-llama", kv_events=True, kv_blocks=128, block_size=32, kv_events_topic=topic,
        time_scale=50.0,
    )  # fmt: skip
    async with running_simulator(config) as sim:
        publisher = sim.state.kv_events
        assert publisher is not None
        pub, replay = (f"tcp://127.0.0.1:{p}" for p in (publisher.port, publisher.replay_port))
        return await asyncio.to_thread(capture, sim.url, pub, replay)


async def test_simulator_frames_have_vllm_032s_structure(vllm_record) -> None:
    sim_record = await simulator_record(vllm_record)
    real, sim = layout(vllm_record), layout(sim_record)
    assert {t for t in real["events"]} == {"AllBlocksCleared", "BlockRemoved", "BlockStored"}
    for key in real:
        assert sim[key] == real[key], f"{key}: simulator {sim[key]} vs vLLM {real[key]}"


def test_the_gateway_decodes_every_captured_frame(vllm_record) -> None:
    kinds: set[type] = set()
    for frame in frames(vllm_record):
        ts, decoded, errors = decode_batch(bytes.fromhex(frame["hex"][2]))
        assert errors == [] and ts > 0
        kinds.update(type(e) for e in decoded)
        for event in decoded:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_the_gateway_reads_vllms_kv_event_sources(vllm_record) -> None:
    body = vllm_record["kv_event_sources"]["body"]
    source = source_from(body, "10.1.2.3")
    assert source is not None and source.endpoint.startswith("tcp://")
    assert source.replay_endpoint is not None
    assert source.topic == vllm_record["steps"]["first"]["events"][0]["topic"]
