"""Adversarial KV-event streams: frames and events a broken or hostile publisher may send.

Every test uses a real simulator publishing over real ZMQ sockets and a real in-process gateway.
"""

from __future__ import annotations

import asyncio

from tests.support.harness import metric_value

from .helpers import EXACT, chat, metrics_text, name_of, wait_for

DEEP = b"\x91" * 5000 + b"\xc0"  # [[[[...nil...]]]]: 5000 nested one-element arrays (10 kB)


def _restarts(text: str, name: str) -> float:
    return metric_value(text, "llm_gateway_background_task_restarts_total", task=f"kv-events-{name}") or 0.0


async def _setup(start_sim, start_gateway, http):
    sim = await start_sim(kv_events=True, kv_blocks=256, block_size=16, model="sim-llama")
    gw = await start_gateway([sim.url], prefix=EXACT)
    index = gw.state.prefix.exact.index
    name = name_of(sim)
    await wait_for(lambda: index.live(name))
    status, body = await chat(http, gw.url, "the quick brown fox jumps over the lazy dog " * 8)
    assert status == 200, body
    await wait_for(lambda: index.size(name) > 0)
    return sim, gw, index, name


async def test_deeply_nested_msgpack_frame_is_a_decode_error_not_a_stream_crash(
    start_sim, start_gateway, http
):
    sim, gw, _index, name = await _setup(start_sim, start_gateway, http)
    pub = sim.state.kv_events
    # The next frame in sequence is a msgpack nesting bomb (it is not kept in the replay buffer).
    pub.send_raw([pub.topic.encode(), pub.next_seq.to_bytes(8, "big"), DEEP])
    await asyncio.sleep(1.5)
    text = await metrics_text(http, gw.url)
    assert _restarts(text, name) == 0, "a malformed frame crashed the KV-event stream task"
    assert (metric_value(text, "llm_gateway_kv_events_decode_errors_total", endpoint=name) or 0) >= 1
    status, body = await chat(http, gw.url, "still serving " * 8)
    assert status == 200, body


async def test_nesting_bomb_in_the_replay_buffer_does_not_disable_exact_state_forever(
    start_sim, start_gateway, http
):
    sim, gw, index, name = await _setup(start_sim, start_gateway, http)
    pub = sim.state.kv_events
    seq, pub.next_seq = pub.next_seq, pub.next_seq + 1
    pub._buffer.append((seq, DEEP))  # an engine's buffered batch that is garbage
    pub.send_raw([pub.topic.encode(), seq.to_bytes(8, "big"), DEEP])
    await asyncio.sleep(0.5)
    # A well-formed batch after it: the stream must be (or become again) live and in sequence.
    status, body = await chat(http, gw.url, "another prompt with its own words " * 8)
    assert status == 200, body
    await wait_for(lambda: index.live(name), within_s=8)
    await asyncio.sleep(3)
    assert index.live(name), "the stream crash-loops on the replayed bomb and never stays live"
    text = await metrics_text(http, gw.url)
    assert _restarts(text, name) == 0


async def test_block_stored_with_an_absurd_block_size_never_fails_a_request(start_sim, start_gateway, http):
    sim, gw, _index, _name = await _setup(start_sim, start_gateway, http)
    pub = sim.state.kv_events
    # No blocks, so ``len(token_ids) == block_size * len(block_hashes)`` holds for any block_size.
    pub.inject(
        [{"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": [],
          "block_size": 2**62, "medium": "GPU"}]
    )  # fmt: skip
    await asyncio.sleep(0.5)
    statuses = []
    for i in range(3):
        status, body = await chat(http, gw.url, f"prompt number {i} with words " * 10)
        statuses.append((status, body[:200]))
    assert all(s == 200 for s, _ in statuses), statuses
