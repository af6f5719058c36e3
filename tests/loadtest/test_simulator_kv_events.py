"""The simulator's vLLM KV events: wire shape, sequence, eviction, replay, reset; /tokenize.

No captured vLLM KV-event frames exist in tests/e2e_vllm/captures, so the shape is checked
against typed msgspec structs written from vLLM 0.32's ``vllm.distributed.kv_events``
field list (maps tagged ``type``; the batch an array ``[ts, events, data_parallel_rank]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from loadtest.simulator import SimConfig, running_simulator
from loadtest.simulator.cli import add_sim_arguments, config_from_args

MODEL = "sim-llama"


class _Event(msgspec.Struct, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


@contextlib.asynccontextmanager
async def subscribed(**kw: Any) -> AsyncIterator[tuple[Any, aiohttp.ClientSession, Any, dict[str, Any]]]:
    kw.setdefault("time_scale", 50.0)
    async with running_simulator(SimConfig(port=0, kv_events=True, **kw)) as sim:
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/kv_event_sources") as resp:
                sources = (await resp.json())["0"]  # vLLM 0.32: configs keyed by DP rank
            ctx = zmq.asyncio.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(sources["endpoint"].replace("*", "127.0.0.1"))
            await asyncio.sleep(0.2)  # the slow joiner: let the subscription reach the publisher
            try:
                yield sim, session, sub, sources
            finally:
                sub.close(0)
                ctx.term()


async def chat(session: aiohttp.ClientSession, sim: Any, content: str, max_tokens: int = 2) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    async with session.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.json()


async def drain(sub: Any, wait_s: float = 0.5) -> list[tuple[bytes, int, Batch]]:
    out = []
    while True:
        try:
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), wait_s)
        except TimeoutError:
            return out
        out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))


async def test_off_by_default() -> None:
    async with running_simulator(SimConfig(port=0, time_scale=50.0)) as sim, aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/kv_event_sources") as resp:
            assert resp.status == 200
            assert await resp.json() == {"enable_kv_cache_events": False}
        assert sim.engine.kv.events is None


async def test_sources_and_block_stored_carry_the_prompt_tokens() -> None:
    async with subscribed() as (sim, session, sub, sources):
        assert sources["endpoint"].startswith("tcp://*:") and sources["replay_endpoint"].startswith(
            "tcp://*:"
        )
        assert sources["topic"] == "kv-events" and sources["enable_kv_cache_events"] is True
        content = "the river runs past the old stone bridge " * 8
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        async with session.post(sim.url + "/tokenize", json=body) as resp:
            tokens = (await resp.json())["tokens"]
        usage = (await chat(session, sim, content))["usage"]
        assert usage["prompt_tokens"] == len(tokens)
        messages = await drain(sub)
        assert [m[1] for m in messages] == list(range(len(messages)))  # seq from 0, no gap
        assert all(m[0] == b"kv-events" and m[2].data_parallel_rank == 0 for m in messages)
        stored = [e for m in messages for e in m[2].events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        token_ids = [t for e in stored for t in e.token_ids]
        full = len(tokens) // 16 * 16
        assert token_ids[:full] == tokens[:full]
        hashes = [h for e in stored for h in e.block_hashes]
        assert len(token_ids) == 16 * len(hashes)
        for earlier, later in itertools.pairwise(stored):  # one chain: parent = previous block
            assert later.parent_block_hash == earlier.block_hashes[-1]
        # The same prompt again hits its blocks: nothing new stored for the prompt.
        again = (await chat(session, sim, content))["usage"]
        assert again["prompt_tokens_details"]["cached_tokens"] == (len(tokens) - 1) // 16 * 16


async def test_eviction_publishes_block_removed_and_replay_resends() -> None:
    async with subscribed(kv_blocks=24) as (sim, session, sub, sources):
        for i in range(6):
            await chat(session, sim, f"prompt number {i} " + "memory engine layer " * 30)
        messages = await drain(sub)
        removed = [
            h for m in messages for e in m[2].events if isinstance(e, BlockRemoved) for h in e.block_hashes
        ]
        stored = {
            h for m in messages for e in m[2].events if isinstance(e, BlockStored) for h in e.block_hashes
        }
        assert removed and set(removed) <= stored
        assert len(stored) - len(set(removed)) == sim.engine.kv.num_cached  # the stream is the cache

        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(sources["replay_endpoint"].replace("*", "127.0.0.1"))
        try:
            await dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            replayed = []
            while True:
                empty, topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 2)
                assert empty == b"" and topic in (b"kv-events", b"")  # vLLM 0.32: the topic, b"" on the end
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert payload == b""
                    break
                replayed.append((number, payload))
        finally:
            dealer.close(0)
            ctx.term()
        assert [n for n, _ in replayed] == [m[1] for m in messages][2:]
        assert DECODER.decode(replayed[0][1]).events == messages[2][2].events


async def test_reset_prefix_cache_publishes_all_blocks_cleared() -> None:
    async with subscribed() as (sim, session, sub, _):
        await chat(session, sim, "a short prompt about the gateway fleet and its policy " * 3)
        await drain(sub, 0.3)
        async with session.post(sim.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        messages = await drain(sub)
        assert any(isinstance(e, AllBlocksCleared) for m in messages for e in m[2].events)
        assert sim.engine.kv.num_cached == 0


async def test_tokenize_prompt_and_errors() -> None:
    async with running_simulator(SimConfig(port=0, time_scale=50.0)) as sim, aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": "hello, world"}) as resp:
            body = await resp.json()
        assert body["count"] == 3 == len(body["tokens"]) and body["max_model_len"] == 32768
        async with s.post(sim.url + "/tokenize", json={"model": MODEL}) as resp:
            assert resp.status == 400


def test_cli_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    config = config_from_args(parser.parse_args(["--kv-events", "--kv-events-port", "5557"]))
    assert config.kv_events and config.kv_events_port == 5557 and config.kv_events_topic == "kv-events"
    assert not config_from_args(parser.parse_args([])).kv_events


@pytest.mark.parametrize("count", [1])
async def test_skip_makes_a_gap(count: int) -> None:
    async with subscribed() as (sim, session, sub, _):
        assert sim.state.kv_events is not None
        sim.state.kv_events.skip(count)
        await chat(session, sim, "first prompt with words enough for blocks " * 4)
        await chat(session, sim, "second prompt with other words for more blocks " * 4)
        seqs = [m[1] for m in await drain(sub)]
        assert seqs and seqs[0] >= count  # the skipped ones exist only in the replay buffer
